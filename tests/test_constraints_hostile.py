"""Hostile constraints (generation/schema_bounds.py, constraints.py, generation/tool_grammar/):
every constraint compiles before anything runs, within bounds, or is refused with a 400 naming
the field the client sent and the bound; never a crash, a 500 mid-reply, or an empty reply
that "succeeded".

- Against a real `mlxlis serve` (the session's tiny server) through the official `openai` and
  `anthropic` clients: `$ref` chains 1100 and 3000 deep (3000 killed the process here with
  SIGSEGV; a thread with less stack dies sooner), a regex whose counts unroll to 10**6 (a 500
  at the first token), schemas that only refer to themselves (a 200 with an empty reply), a
  grammar the engine fails at its first token or that accepts nothing; the server still
  answers and /health is "ok" after each.
- A pydantic model with a nested model (its `$defs`) forced as a tool call in the Chat,
  Anthropic and Responses dialects: the arguments validate against pydantic's own schema with
  `jsonschema` (the reference validator); a tool's refused schema is named by the field the
  client sent (`tools[0].function.parameters`, `tools[0].input_schema`, `tools[0].parameters`).
- A hypothesis fuzz of schemas ($ref chains, cycles, nesting, big enums) and regexes (big
  counts) through `constraint`: a ConstraintError naming the field, or a constraint whose
  every complete reply (random allowed tokens, the tiny vocabulary) validates (`jsonschema`,
  `re.fullmatch`).
"""

from __future__ import annotations

import json
import os
import random
import re

import mlxlis
from mlxlis.generation.constraints import ConstraintError, constraint

import anthropic
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

MODEL = "llama_long"
HELLO = [{"role": "user", "content": "Plan a trip."}]
SELF = {"$ref": "#"}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
BIG_REGEX = "(a{1000}){1000}"
SCHEMA = "response_format.json_schema.schema"


def chain(n: int) -> dict:
    """`$ref`s n deep: #/$defs/d0 -> d1 -> … -> an integer."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


# closed objects, bounded values: the tiny model's noise ends each call
class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=3)
    country: str = Field(max_length=2)


class Trip(BaseModel):
    model_config = ConfigDict(extra="forbid")
    place: Place
    days: int = Field(ge=1, le=9)


def visit_schema() -> dict:  # another tool's, its "Place" of another shape
    class Place(BaseModel):
        model_config = ConfigDict(extra="forbid")
        zone: int = Field(ge=0, le=9)

    class Visit(BaseModel):
        model_config = ConfigDict(extra="forbid")
        at: Place

    return Visit.model_json_schema()


TRIP, VISIT = Trip.model_json_schema(), visit_schema()
assert "Place" in TRIP["$defs"] and "Place" in VISIT["$defs"]  # pydantic's nested models
UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


def chat_tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


@pytest.fixture(scope="module")
def oai(tiny_server):
    return tiny_server.client()


@pytest.fixture(scope="module")
def claude(tiny_server):
    return tiny_server.anthropic_client()


def still_serving(srv, oai) -> None:
    """The process lives, /health says ok and a plain request is answered."""
    assert srv.proc.poll() is None, srv.log()
    status, health = srv.request("GET", "/health")
    assert status == 200 and health["status"] == "ok", health
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def chat_refusal(oai, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, **kw)
    return e.value.body


@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        (fmt(chain(1100)), f"{SCHEMA}.$defs.d", "more than 64 levels"),
        (fmt(chain(3000)), f"{SCHEMA}.$defs.d", "more than 64 levels"),  # SIGSEGV before
        ({"type": "regex", "regex": BIG_REGEX}, "response_format.regex", "over 10000"),
        (fmt(SELF), SCHEMA, "no finite value"),
        (fmt(MUTUAL), f"{SCHEMA}.$defs.", "no finite value"),
        ({"type": "grammar", "grammar": 'start: a\na: a "x"\n'}, "response_format.grammar", "no"),
        (
            {"type": "grammar", "grammar": f"start: /{BIG_REGEX}/\n"},
            "response_format.grammar",
            "too many expressions",
        ),
    ],
)
def test_chat_refuses_what_cannot_compile_and_keeps_serving(
    tiny_server, oai, response_format, param, says
):
    """Each hostile response_format is a 400 before anything runs, `param` naming the field
    (a $ref chain: the def where it passes 64 levels), the message the bound; then the
    server still serves."""
    err = chat_refusal(oai, response_format=response_format)
    assert err["param"].startswith(param) and says in err["message"], err
    still_serving(tiny_server, oai)


def test_anthropic_and_responses_name_their_own_fields(tiny_server, oai, claude):
    """The same refusals through Anthropic's output_config.format and the Responses API's
    text.format name those fields."""
    for schema, says in ((chain(1100), "more than 64 levels"), (SELF, "no finite value")):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model=MODEL,
                max_tokens=8,
                messages=HELLO,
                output_config={"format": {"type": "json_schema", "schema": schema}},
            )
        message = e.value.body["error"]["message"]
        assert message.startswith("output_config.format") and says in message, message
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(
                model=MODEL,
                input="Hi",
                max_output_tokens=8,
                text={"format": {"type": "json_schema", "name": "t", "schema": schema}},
            )
        assert e.value.body["param"].startswith("text.format") and says in e.value.body["message"]
    still_serving(tiny_server, oai)


def test_a_forced_tool_with_a_bad_schema_is_refused_by_its_own_field(tiny_server, oai, claude):
    """A forced tool whose parameters refer only to themselves (a 500 mid-reply before) or
    use a keyword the engine cannot enforce: a 400 naming the tool's parameters as each
    dialect calls them."""
    for params, at, says in ((SELF, "", "no finite value"), (UNIQUE, ".properties.tags", "")):
        named = {"type": "function", "function": {"name": "plan"}}
        err = chat_refusal(oai, tools=[chat_tool("plan", params)], tool_choice=named)
        assert err["param"].startswith(f"tools[0].function.parameters{at}"), err
        assert says in err["message"], err
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model=MODEL,
                max_tokens=8,
                messages=HELLO,
                tools=[{"name": "plan", "input_schema": params}],
                tool_choice={"type": "tool", "name": "plan"},
            )
        assert e.value.body["error"]["message"].startswith(f"tools[0].input_schema{at}"), e.value
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(
                model=MODEL,
                input="Hi",
                max_output_tokens=8,
                tools=[{"type": "function", "name": "plan", "parameters": params}],
                tool_choice="required",
            )
        assert e.value.body["param"].startswith(f"tools[0].parameters{at}"), e.value.body
    still_serving(tiny_server, oai)


def test_pydantic_schemas_are_forced_in_every_dialect(oai, claude):
    """A pydantic model with a nested model ($defs/$ref) as a forced tool: the arguments
    validate against pydantic's schema (jsonschema) and parse back into the model, in Chat
    (a named tool), Anthropic (tool_choice tool) and Responses ("required"); with two tools
    whose $defs share a name, each call follows its own tool's."""
    named = {"type": "function", "function": {"name": "plan"}}
    r = oai.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=150,
        tools=[chat_tool("plan", TRIP)],
        tool_choice=named,
    )
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(args, TRIP)
    Trip.model_validate(args)
    m = claude.messages.create(
        model=MODEL,
        max_tokens=150,
        messages=HELLO,
        tools=[{"name": "plan", "input_schema": TRIP}],
        tool_choice={"type": "tool", "name": "plan"},
    )
    assert m.content[0].type == "tool_use" and m.stop_reason == "tool_use"
    jsonschema.validate(m.content[0].input, TRIP)
    resp = oai.responses.create(
        model=MODEL,
        input="Plan a trip.",
        max_output_tokens=150,
        tools=[{"type": "function", "name": "plan", "parameters": TRIP}],
        tool_choice="required",
    )
    (call,) = [o for o in resp.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), TRIP)
    schemas = {"plan": TRIP, "visit": VISIT}
    for seed in range(3):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=150,
            temperature=1.0,
            seed=seed,
            tools=[chat_tool(n, s) for n, s in schemas.items()],
            tool_choice="required",
        )
        fn = r.choices[0].message.tool_calls[0].function
        jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])


@pytest.fixture(scope="module")
def tok(tiny):
    return mlxlis.load_tokenizer(tiny("llama")[0])


def compiled(tok, response_format: dict):
    return constraint(response_format, tok, tok.vocab_size, sorted(tok.stop_ids))


def test_bounds_and_the_first_tokens_are_checked_at_compile_time(tok):
    """In-process, the same refusals: the $ref depth bound (a chain of 1100 compiles in the
    engine here, 2500 overflows its stack), a chain of 60 compiles; 501 optional
    properties (past the parser's row, where llguidance failed at the object's first key,
    mid-reply) are refused by where they are; a grammar that accepts nothing or fails at its
    first token is refused by the first-token probe."""
    wide = {f"k{i}": {"const": 1} for i in range(501)}
    wide = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "x": {"type": "object", "properties": wide}},
        "required": ["a", "x"],
    }
    cases = [
        (fmt(chain(1100)), f"{SCHEMA}.$defs.d"),
        (fmt(wide), f"{SCHEMA}.properties.x"),
        ({"type": "grammar", "grammar": 'start: a\na: a "x"\n'}, "response_format.grammar"),
        ({"type": "grammar", "grammar": f"start: /{BIG_REGEX}/\n"}, "response_format.grammar"),
    ]
    for rf, field in cases:
        with pytest.raises(ConstraintError) as e:
            compiled(tok, rf)
        assert e.value.field.startswith(field), e.value
    compiled(tok, fmt(chain(60)))


# `make fuzz` (MLXLIS_FUZZ_EXAMPLES=5000) randomises; `make test` runs a few, the same each run
EXAMPLES = max(1, int(os.environ.get("MLXLIS_FUZZ_EXAMPLES", "100")) // 4)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="MLXLIS_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=list(HealthCheck),
)
LEAVES = [
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "string", "maxLength": 2},
    {"type": "boolean"},
    {"enum": ["x", "y"]},
]


@st.composite
def regexes(draw) -> str:
    atom = st.sampled_from(["a", "b", "[0-9]", "(?:ab|c)", "x?"])

    def counted(inner: str) -> str:
        lo = draw(st.one_of(st.integers(0, 9), st.integers(0, 1200)))
        hi = draw(st.one_of(st.none(), st.integers(lo, lo + 9), st.integers(lo, lo + 1200)))
        return f"({inner}){{{lo}}}" if hi is None else f"({inner}){{{lo},{hi}}}"

    rx = draw(atom)
    for _ in range(draw(st.integers(0, 3))):
        rx = counted(rx) if draw(st.booleans()) else rx + draw(atom)
    return rx


@st.composite
def schemas(draw) -> dict:
    """$defs d0..dn, each a leaf (a string with a regex pattern among them), an object or
    array around a $ref, an anyOf, a $ref alone (chains up to 200 deep, cycles, references to
    the root), a big enum, a wide object or anyOf; the root one of them or a literal
    nesting."""
    n = draw(st.one_of(st.integers(0, 6), st.integers(0, 200)))
    ref = st.integers(-1, n).map(lambda j: {"$ref": "#" if j < 0 else f"#/$defs/d{j}"})
    one = st.one_of(
        st.sampled_from(LEAVES),
        regexes().map(lambda rx: {"type": "string", "pattern": f"^{rx}$"}),
        ref,
        ref.map(
            lambda r: {"type": "object", "properties": {"a": r}, "additionalProperties": False}
        ),
        ref.map(
            lambda r: {
                "type": "object",
                "properties": {"a": r},
                "required": ["a"],
                "additionalProperties": False,
            }
        ),
        st.tuples(ref, st.integers(0, 2)).map(
            lambda p: {"type": "array", "items": p[0], "minItems": p[1], "maxItems": 2}
        ),
        st.tuples(ref, st.sampled_from(LEAVES)).map(lambda p: {"anyOf": list(p)}),
        st.one_of(st.integers(1, 3), st.integers(1, 6000)).map(lambda k: {"enum": list(range(k))}),
        st.integers(1, 600).map(  # wide: optional properties, anyOf members
            lambda k: {
                "type": "object",
                "properties": {f"p{i}": LEAVES[0] for i in range(k)},
                "additionalProperties": False,
            }
        ),
        st.tuples(st.integers(1, 2500), ref).map(lambda p: {"anyOf": [p[1]] * p[0]}),
    )
    defs = {f"d{i}": draw(one) for i in range(n + 1)}
    if draw(st.booleans()):  # a chain d0 -> d1 -> … as long as the defs
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)} | {f"d{n}": defs["d0"]}
    root: dict = {"$ref": "#/$defs/d0"}
    for _ in range(draw(st.one_of(st.integers(0, 3), st.integers(0, 70)))):  # literal nesting
        root = {"type": "array", "items": root, "maxItems": 1}
    return {"$defs": defs, **root}


def walk(mask, tok, steps: int = 120, seed: int = 0) -> str | None:
    """The text of a random reply the mask allows (uniform draws among its tokens), or None
    when it has not ended within `steps` tokens."""
    rng, history = random.Random(seed), [0]
    for _ in range(steps):
        allowed = np.flatnonzero(mask.allowed(history))
        assert len(allowed), "a mask that allows nothing"
        token = int(allowed[rng.randrange(len(allowed))])
        if token in tok.stop_ids:
            return tok.decode(history[1:])
        history.append(token)
    return None


@FUZZ
@given(schema=schemas(), seed=st.integers(0, 3))
def test_fuzz_schemas_are_refused_by_name_or_enforced(tok, schema, seed):
    """A ConstraintError naming the schema's field, or a reply that is JSON and validates."""
    try:
        mask = compiled(tok, fmt(schema))
    except ConstraintError as e:
        assert e.field.startswith(SCHEMA), e
        return
    text = walk(mask, tok, seed=seed)
    if text is not None:
        jsonschema.validate(json.loads(text), schema)


@FUZZ
@given(rx=regexes(), seed=st.integers(0, 3))
def test_fuzz_regexes_are_refused_by_name_or_enforced(tok, rx, seed):
    """A ConstraintError naming response_format.regex, or a reply that fully matches."""
    try:
        mask = compiled(tok, {"type": "regex", "regex": rx})
    except ConstraintError as e:
        assert e.field == "response_format.regex", e
        return
    text = walk(mask, tok, seed=seed)
    if text is not None:
        assert re.fullmatch(rx, text), (rx, text)
