"""Structured output (mlxlis/generation/constraints.py), against independent references:

- the mask is llguidance's own answer: a matcher built straight from llguidance's API on the
  same vocabulary and fed the same tokens allows exactly what mlxlis's processor allows, at
  every step of a recorded reply (mlxlis passes the engine's mask through unchanged);
- every reply of SmolLM2 sampled at temperature 1 under 24 schemas parses and validates with
  the `jsonschema` package (the reference validator), the 24 decoding as one batch;
- under a batch of 8 mixed constrained and free greedy requests, each equals the same request
  alone (self-consistency of the batched step: each row keeps its own mask);
- refusals name the feature's JSON path before anything generates; a reply cut by max_tokens
  ends "length", never a clean "stop".
"""

from __future__ import annotations

import json

import mlxlis
from mlxlis.generation.constraints import ConstraintError, constraint, engine_tokenizer, grammar
from mlxlis.generation.core import Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.sampling import SamplingParams

import jsonschema
import llguidance as llg
import llguidance.numpy as llnp
import numpy as np
import pytest
from conftest import need_pulled, trajectory

OBJ = {"type": "object", "additionalProperties": False}
NAME = {"type": "string", "maxLength": 12}
# 24 schemas: nested objects, arrays with bounds, enum, const, anyOf, $ref/$defs, pattern,
# numeric bounds, required, additionalProperties false, formats
SCHEMAS = [
    {**OBJ, "properties": {"name": NAME}, "required": ["name"]},
    {
        **OBJ,
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
    },
    {**OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {**OBJ, "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {
        **OBJ,
        "properties": {
            "kind": {"const": "point"},
            "x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
        },
        "required": ["kind", "x"],
    },
    {
        **OBJ,
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    {
        **OBJ,
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
    },
    {
        **OBJ,
        "properties": {
            "person": {
                **OBJ,
                "properties": {
                    "name": NAME,
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "age"],
            }
        },
        "required": ["person"],
    },
    {
        **OBJ,
        "properties": {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "pattern": "^[a-z]{3}$"},
                ]
            }
        },
        "required": ["id"],
    },
    {
        "$defs": {
            "pt": {
                **OBJ,
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        **OBJ,
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
    {
        **OBJ,
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    {
        **OBJ,
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}
        },
        "required": ["price"],
    },
    {**OBJ, "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {
        **OBJ,
        "properties": {"mail": {"type": "string", "format": "email", "maxLength": 30}},
        "required": ["mail"],
    },
    {**OBJ, "properties": {"a": NAME, "b": NAME}, "required": ["a"]},
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 50},
        "minItems": 1,
        "maxItems": 5,
    },
    {"type": "array", "items": NAME, "minItems": 2, "maxItems": 2},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {
        **OBJ,
        "properties": {
            "m": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["m"],
    },
    {
        **OBJ,
        "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
        "required": ["v"],
    },
    {
        **OBJ,
        "properties": {
            "title": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]}, "maxItems": 2},
        },
        "required": ["title", "year", "genres"],
    },
    {
        **OBJ,
        "properties": {
            "q": {"type": "string", "enum": ["a", "b"]},
            "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
        },
        "required": ["q", "n"],
    },
    {
        **OBJ,
        "properties": {
            "inner": {
                **OBJ,
                "properties": {
                    "deep": {
                        **OBJ,
                        "properties": {"leaf": {"type": "boolean"}},
                        "required": ["leaf"],
                    }
                },
                "required": ["deep"],
            }
        },
        "required": ["inner"],
    },
]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def smol():
    need_pulled("smollm2-135m")
    return mlxlis.load("smollm2-135m")


def chat_ids(model, text: str) -> list[int]:
    prompt = model.render_chat([{"role": "user", "content": text}])
    return model.tokenizer.encode(prompt, special=True)


@pytest.mark.real
def test_the_mask_is_the_engines_own_answer(smol):
    """A recorded reply (a valid document tokenized by the model's tokenizer) fed to mlxlis's
    processor and to a matcher built from llguidance's API alone: the allowed tokens are the
    same at every step, each recorded token is among them, and at the end only the stop
    tokens are (the grammar is complete)."""
    schema = SCHEMAS[7]
    doc = json.dumps({"person": {"name": "Ada", "age": 36}})
    tokens = smol.tokenizer.encode(doc, add_bos=False)
    stops = sorted(smol.stop_ids())
    vocab = smol.config.vocab_size
    ours = constraint(fmt(schema), smol.tokenizer, vocab, stops)
    theirs = llg.LLMatcher(engine_tokenizer(smol.tokenizer, vocab, stops), grammar(fmt(schema)))
    bitmask = llnp.allocate_token_bitmask(1, vocab)
    prompt = [1, 2, 3]
    for i in range(len(tokens) + 1):
        got = ours.allowed(prompt + tokens[:i])
        llnp.fill_next_token_bitmask(theirs, bitmask, 0)
        want = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        assert np.array_equal(got, want), i
        if i < len(tokens):
            assert got[tokens[i]], (i, smol.tokenizer.decode([tokens[i]]))
            assert theirs.consume_token(tokens[i])
    assert sorted(np.flatnonzero(got).tolist()) == [s for s in stops if s < vocab]


@pytest.mark.real
@pytest.mark.parametrize(
    "name",  # `make test-all` (23 s): make test keeps the mask's match with llguidance's own
    [pytest.param(n, marks=pytest.mark.extended) for n in ("smollm2-135m", "qwen2.5-coder-0.5b")],
)
def test_sampled_replies_follow_every_schema(smol, name):
    """SmolLM2 and Qwen2.5-Coder (`make test-all`) at temperature 1 (the sampler roams)
    under each of the 24 schemas, all decoding as one batch: every reply ends on its own
    ("stop"), parses, and validates."""
    if name != "smollm2-135m":
        need_pulled(name)
        smol = mlxlis.load(name)
    engine = Engine(smol, max_active=len(SCHEMAS), prefix_cache_bytes=0)
    ids = chat_ids(smol, "Answer in JSON.")
    stops = frozenset(smol.stop_ids())
    try:
        streams = [
            engine.submit(
                Request(
                    ids,
                    SamplingParams(max_tokens=160, temperature=1.0, seed=i),
                    stops,
                    processors=(
                        constraint(fmt(s), smol.tokenizer, smol.config.vocab_size, sorted(stops)),
                    ),
                )
            )
            for i, s in enumerate(SCHEMAS)
        ]
        replies = [list(s) for s in streams]
    finally:
        engine.shutdown()
    for schema, events in zip(SCHEMAS, replies, strict=True):
        text = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_batched_constrained_and_free_rows_equal_each_alone(tiny):
    """8 greedy requests on a tiny model, 4 under schemas and 4 free, decoding together: each
    gives the tokens the same request gives alone through `generate`."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    vocab = model.config.vocab_size
    stops = sorted(model.stop_ids())
    prompts = [trajectory(5 + 3 * i, seed=40 + i, vocab=vocab) for i in range(8)]
    formats = [fmt(SCHEMAS[i]) if i % 2 == 0 else None for i in range(8)]
    params = SamplingParams(max_tokens=24)

    def masks(f):
        return () if f is None else (constraint(f, model.tokenizer, vocab, stops),)

    engine = Engine(model, max_active=8, prefix_cache_bytes=0)
    try:
        streams = [
            engine.submit(Request(p, params, frozenset(stops), processors=masks(f)))
            for p, f in zip(prompts, formats, strict=True)
        ]
        got = [[e.token for e in s if e.token is not None] for s in streams]
    finally:
        engine.shutdown()
    alone = [
        [
            e.token
            for e in mlxlis.generate(model, p, params, stop_ids=set(stops), response_format=f)
            if e.token is not None
        ]
        for p, f in zip(prompts, formats, strict=True)
    ]
    assert got == alone
    free = [
        [
            e.token
            for e in mlxlis.generate(model, p, params, stop_ids=set(stops))
            if e.token is not None
        ]
        for p in prompts[:2]
    ]
    assert free[1] == got[1] and free[0] != got[0]  # the mask changed the constrained row


@pytest.mark.parametrize(
    ("response_format", "path"),
    [
        (
            fmt({"type": "array", "uniqueItems": True}),
            "response_format.json_schema.schema.uniqueItems",
        ),
        (
            fmt({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}),
            "response_format.json_schema.schema.properties.a.not",
        ),
        (fmt({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema.$defs.missing"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema.schema",
        ),
        ({"type": "regex", "regex": "(a"}, "response_format.regex"),
        ({"type": "grammar", "grammar": "start: ("}, "response_format.grammar"),
        ({"type": "yaml"}, "response_format.type"),
        ("json", "response_format"),
    ],
)
def test_refusals_name_the_feature_and_its_path(tiny, response_format, path):
    """What the engine cannot enforce, or cannot read, is a ConstraintError naming the field
    (for a schema keyword: where in the schema it is), before anything generates."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    with pytest.raises(ConstraintError) as e:
        next(mlxlis.generate(model, [1, 2, 3], response_format=response_format))
    assert e.value.field == path


def test_a_reply_cut_by_max_tokens_ends_length(tiny):
    """A schema that needs more than 3 tokens, max_tokens=3: "length", the text a prefix of a
    document of that schema; and a regex reply that completes ends "stop" on a stop token."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    stops = set(model.stop_ids())
    cut = list(
        mlxlis.generate(
            model, [1, 2, 3], max_tokens=3, stop_ids=stops, response_format=fmt(SCHEMAS[9])
        )
    )
    assert cut[-1].finish_reason == "length"
    assert '{"a": {"x": '.startswith("".join(e.text for e in cut)[:12])
    done = list(
        mlxlis.generate(
            model,
            [1, 2, 3],
            max_tokens=40,
            stop_ids=stops,
            response_format={"type": "regex", "regex": "[0-9]{3}"},
        )
    )
    text = "".join(e.text for e in done)
    assert done[-1].finish_reason == "stop" and len(text) == 3 and text.isdigit()


def test_the_one_shot_command_enforces_and_refuses(tiny, tmp_path):
    """`mlxlis -m M --json-schema FILE "…"` as a real process: the reply on stdout validates;
    a schema with a keyword the engine cannot enforce exits 2 with one line naming its path."""
    import subprocess
    import sys

    folder, _ = tiny("llama")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(SCHEMAS[3]))
    bad.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    base = [sys.executable, "-m", "mlxlis", "-m", str(folder), "--chat-template", "chatml"]
    out = subprocess.run(
        [*base, "--json-schema", str(good), "--max-tokens", "40", "Colour?"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), SCHEMAS[3])
    out = subprocess.run(
        [*base, "--json-schema", str(bad), "Hi"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "schema.uniqueItems" in out.stderr


def test_tool_call_grammars_refuse_what_they_cannot_hold(tiny):
    """Strict tools under "auto" with a format that has no call tag (Llama 3's bare object),
    whose calls follow reasoning (gpt-oss's harmony) or whose tag is no token of the
    vocabulary are refused; a required call in each syntax compiles in the engine (every
    format's calls: test_tool_forcing; through a server: test_serve_real)."""
    from mlxlis.generation.tool_grammar import tool_grammar
    from mlxlis.prompt.tool_formats import GEMMA4, HARMONY, HERMES, for_template

    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMAS[1]}}]
    llama3 = for_template('{{ "parameters" }}')
    with pytest.raises(ConstraintError, match="cannot tell"):
        tool_grammar(llama3, tools, model.tokenizer, None, required=False)
    with pytest.raises(ConstraintError, match="not one token"):  # the tiny vocabulary's
        tool_grammar(HERMES, tools, model.tokenizer, None, required=False)
    with pytest.raises(ConstraintError, match="reasons first"):
        tool_grammar(HARMONY, tools, model.tokenizer, None, required=False)
    stops = sorted(model.stop_ids())
    mistral = (for_template("[TOOL_CALLS]"), for_template("[TOOL_CALLS][ARGS]"))
    for fmt in (HERMES, llama3, *mistral, HARMONY, GEMMA4):
        lark = tool_grammar(fmt, tools, model.tokenizer, "f", required=True)
        constraint(
            {"type": "grammar", "grammar": lark}, model.tokenizer, model.config.vocab_size, stops
        )
