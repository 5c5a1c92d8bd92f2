"""Structured output: a constraint (a JSON schema, any JSON object, a regular expression or a
grammar) enforced token by token, as one more logits processor of the request's row.

The grammar engine is llguidance (the Earley parser with a lexer that llama.cpp, vLLM and
SGLang use): it needs no torch, computes a mask of a 152k vocabulary in ~0.1 ms (p99 ~0.6 ms)
with the GIL released, compiles a schema in milliseconds, and refuses the JSON-schema keywords
it cannot enforce by name. xgrammar was measured too (scripts/bench_grammar.py, the table in
docs/structured-output.md): faster median masks, but it imports torch and transformers,
ignores `not`, `uniqueItems` and `if/then` silently and matches `pattern` as a whole string.

Its vocabulary is built from mlxlis's own tokenizer (each token's exact bytes, special tokens
marked, the model's stop ids as its end-of-sequence tokens), so GGUF models need nothing else.
The mask for token t+1 is computed on the CPU right after token t is read, while the device
runs the forward of step t+1 (the core queues it first). Once the grammar is complete only the
stop tokens are allowed, so the reply ends there ("stop"); cut by max_tokens first, it ends
"length".

`response_format` is the dict the OpenAI API takes, plus two extensions:
  {"type": "json_object"}
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
  {"type": "regex", "regex": "..."}
  {"type": "grammar", "grammar": "...", "syntax": "lark" | "gbnf"}   (lark by default)

Every constraint is compiled before anything generates, within bounds (schema_bounds.py: the
nesting a schema reaches through `$ref`, its size, its regexes' size, a value it can hold at
all), and its first tokens are tried (`probe`): it is enforced to the end or refused, naming
the field, never a crash or a reply that silently ignores it.
"""

from __future__ import annotations

import copy
import random
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxlis.generation.schema_bounds import ConstraintError, check_regex, check_schema
from mlxlis.prompt.reasoning import STYLES, ends_after_reasoning, starts_in_reasoning, tag_ids
from mlxlis.tokenizer import Tokenizer

import llguidance as llg
import llguidance.numpy as llnp
import mlx.core as mx
import numpy as np

FIELD = "response_format"
TYPES = ("json_object", "json_schema", "regex", "grammar")
NEG_INF = float("-inf")
# llguidance's own resource bounds at their defaults, its errors without the parser's state
# (verbose, a failure at a token wrote out the grammar and the parser's items)
LIMITS = llg.LLParserLimits(verbose_errors=False)
# tokens `probe` tries at compile time: the engine builds its lexer lazily, so a grammar it
# validates can still fail at the first token ((a{1000}){1000}: "too many expressions")
PROBE_STEPS = 8


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: token id -> bytes, the specials, and the
    model's own encoder (the engine tokenizes the text a grammar forces with it)."""

    def __init__(self, tok: Tokenizer, size: int, stops: Sequence[int], extra: Sequence[int]):
        special = set(tok.special_tokens.values()) | set(stops) | set(extra)
        self.tokens = [
            tok.token_bytes(i) if i < tok.vocab_size and i not in special else b""
            for i in range(size)
        ]
        self.special_token_ids = sorted(i for i in special if i < size)
        self.eos_token_id = min(stops) if stops else None
        self.bos_token_id = tok.bos_id
        self._tok = tok
        self._by_bytes = {b: i for i, b in enumerate(self.tokens) if b}

    def __call__(self, data: bytes) -> list[int]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: the longest token bytes, greedily
            return self._greedy(data)
        return self._tok.encode(text, special=False, add_bos=False, add_eos=False)

    def _greedy(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(16, len(data) - i), 0, -1):
                token = self._by_bytes.get(data[i : i + n])
                if token is not None:
                    break
            else:
                raise ConstraintError(f"byte {data[i]:#x} has no token", field=FIELD)
            out.append(token)
            i += n
        return out


_engines: weakref.WeakKeyDictionary[Tokenizer, dict] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def engine_tokenizer(
    tok: Tokenizer, size: int, stops: Sequence[int], special: Sequence[int] = ()
) -> llg.LLTokenizer:
    """The engine's vocabulary for `tok` with `size` logits, these stop ids and `special`
    tokens beside the tokenizer's own (text never produces them; a grammar names them by id);
    built once per kind: about 1 s for a 262k vocabulary."""
    key = (size, tuple(sorted(stops)), tuple(sorted(special)))
    with _lock:
        per = _engines.setdefault(tok, {})
        if key not in per:
            vocab = _Vocabulary(tok, size, sorted(stops), sorted(special))
            per[key] = llg.LLTokenizer(llg.TokenizerWrapper(vocab), eos_token=sorted(stops))
        return per[key]


def grammar(response_format: Any, field: str = FIELD) -> str:
    """The engine's grammar for a response_format dict; ConstraintError naming the field."""
    if not isinstance(response_format, dict):
        raise ConstraintError("must be an object with a `type`", field=field)
    kind = response_format.get("type")
    if kind == "json_object":
        return _json_schema({"type": "object"}, field)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            raise ConstraintError(
                "json_schema.schema: a JSON schema object is required",
                field=f"{field}.json_schema.schema",
            )
        return _json_schema(spec["schema"], f"{field}.json_schema.schema")
    if kind == "regex":
        rx = response_format.get("regex")
        if not isinstance(rx, str) or not rx:
            raise ConstraintError("regex: a non-empty string is required", field=f"{field}.regex")
        check_regex(rx, f"{field}.regex")
        return llg.LLMatcher.grammar_from_regex(rx)
    if kind == "grammar":
        text, syntax = response_format.get("grammar"), response_format.get("syntax", "lark")
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(
                "grammar: a non-empty string is required", field=f"{field}.grammar"
            )
        if syntax not in ("lark", "gbnf"):
            raise ConstraintError(
                f"syntax: 'lark' or 'gbnf', not {syntax!r}", field=f"{field}.syntax"
            )
        try:
            return llg.grammar_from(syntax, text)
        except Exception as e:  # noqa: BLE001 — the converter's own words
            raise ConstraintError(f"grammar: {e}", field=f"{field}.grammar") from None
    raise ConstraintError(f"type: one of {', '.join(TYPES)}, not {kind!r}", field=f"{field}.type")


# one line, ", " and ": " between items: the JSON people write on one line, and no run of
# whitespace a sampled reply could wander into until max_tokens
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_schema(schema: dict | bool, field: str) -> str:
    check_schema(schema, field)
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except Exception as e:  # noqa: BLE001
        raise ConstraintError(f"{e}", field=field) from None


def check(grammar_text: str, tok: llg.LLTokenizer, source: Any, field: str = FIELD) -> None:
    """ConstraintError for a grammar the engine refuses, naming the schema path of the
    keyword it names (llguidance's messages name the keyword, not where it is)."""
    error = llg.LLMatcher.validate_grammar(grammar_text, tok, limits=LIMITS)
    if not error:
        return
    if isinstance(source, dict) and source.get("type") == "json_schema":
        raise _refusal(error, source["json_schema"]["schema"], f"{field}.json_schema.schema")
    raise ConstraintError(_first_line(error), field=_where(source, field))


def check_json_schema(schema: Any, field: str) -> None:
    """ConstraintError naming `field` (and the place in it) for a JSON schema the engine
    cannot enforce or that is out of bounds (a tool's parameters, before they are embedded
    in a call's grammar)."""
    if not isinstance(schema, dict):
        raise ConstraintError("must be a JSON schema object", field=field)
    error = llg.LLMatcher.validate_grammar(_json_schema(schema, field), limits=LIMITS)
    if error:
        raise _refusal(error, schema, field)


def _refusal(error: str, schema: Any, path: str) -> ConstraintError:
    keys = re.findall(r'"([^"]+)"', error.split("\n", 1)[0]) if "keys" in error else []
    pointer = re.search(r"Pointer '([^']*)'", error)
    found = _find_key(schema, keys) if keys else None
    if found is not None:
        path += "".join(f".{p}" for p in found)
    elif pointer is not None:
        path += "".join(f".{p}" for p in pointer.group(1).strip("/").split("/") if p)
    return ConstraintError(_first_line(error), field=path)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0].replace(" <non-verbose/>", "")


def _where(source: Any, field: str) -> str:
    """The field of a response_format that holds its constraint."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "json_schema":
        return f"{field}.json_schema.schema"
    return f"{field}.{kind}" if kind in ("regex", "grammar") else field


def probe(matcher: llg.LLMatcher, tok: llg.LLTokenizer, stops: Sequence[int], field: str) -> None:
    """ConstraintError for a grammar that fails at its first tokens or allows none but a
    stop: PROBE_STEPS tokens it allows (seeded draws) consumed on a copy of `matcher`.
    What it catches reached a reply before as a 500 at the first token, or as an empty reply
    that "succeeded" (a grammar that accepts nothing allows only the stop token)."""
    m, vocab = matcher.deep_copy(), tok.vocab_size
    bitmask = llnp.allocate_token_bitmask(1, vocab)
    ends = [s for s in stops if s < vocab]
    draw = random.Random(0)
    for step in range(PROBE_STEPS):
        llnp.fill_next_token_bitmask(m, bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab]
        bits[ends] = 0
        text = np.flatnonzero(bits)
        if step == 0 and not len(text) and not m.is_accepting():
            raise ConstraintError("no text satisfies it: it allows only the stop", field=field)
        if m.is_error():
            raise ConstraintError(
                f"the engine fails on it: {_first_line(m.get_error())}", field=field
            )
        token = -1
        while len(text) and not m.validate_tokens([token := int(draw.choice(text))]):
            text, token = text[text != token], -1  # an over-allowed special (GrammarMask._mask)
        if token < 0:
            return  # complete: only a stop is left
        if not m.consume_token(token):
            raise ConstraintError(
                f"the engine fails on it at token {step + 1}: {_first_line(m.get_error())}",
                field=field,
            )


def _find_key(node: Any, keys: list[str], path: tuple = ()) -> tuple | None:
    """The path of the first occurrence of one of `keys` in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in keys:
                return (*path, k)
            if (hit := _find_key(v, keys, (*path, k))) is not None:
                return hit
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if (hit := _find_key(v, keys, (*path, i))) is not None:
                return hit
    return None


@dataclass(frozen=True)
class Reasoning:
    """A reasoning model's tags (single tokens) and where the reply starts: "inside" an open
    block (the prompt ends with `<think>`), "after" a closed one (thinking off), or at the
    "start" (the model may open one itself)."""

    open_id: int
    close_id: int
    state: str


def reasoning_of(tokenizer: Tokenizer, prompt: str | None) -> Reasoning | None:
    """The reasoning tags of `tokenizer` (the first style whose two tags are tokens) and the
    reply's start after `prompt`; None without a prompt or such tags."""
    if prompt is None:
        return None
    for open_tag, close_tag, _ in STYLES:
        if ids := tag_ids(tokenizer, (open_tag, close_tag)):
            by_tag = {tag: i for i, tag in ids.items()}
            state = (
                "inside"
                if starts_in_reasoning(prompt, open_tag)
                else "after"
                if ends_after_reasoning(prompt, close_tag)
                else "start"
            )
            return Reasoning(by_tag[open_tag], by_tag[close_tag], state)
    return None


class GrammarMask:
    """A logits processor: the tokens the grammar allows next, the others at -inf. It feeds
    the engine the reply's tokens (the history past the prompt, as long as the first call's).

    For a reasoning model the grammar starts after the reasoning block closes: a reply inside
    an open block is free until the close tag; at the start the model may also open a block
    (its open tag is allowed beside the grammar's first tokens)."""

    def __init__(
        self,
        tok: llg.LLTokenizer,
        grammar_text: str,
        vocab: int,
        reasoning: Reasoning | None = None,
        field: str = FIELD,
        specials: Sequence[int] = (),
        stops: Sequence[int] = (),
    ):
        self.matcher = llg.LLMatcher(tok, grammar_text, log_level=0, limits=LIMITS)
        self.specials = np.array(sorted(i for i in set(specials) if 0 <= i < vocab), dtype=np.int64)
        self.stops = frozenset(stops)  # specials and stops: checked one by one (_mask)
        if self.matcher.is_error():
            raise ConstraintError(_first_line(self.matcher.get_error()), field=field)
        self.vocab = vocab
        self.bitmask = llnp.allocate_token_bitmask(1, tok.vocab_size)
        self.reasoning = reasoning
        self.state = reasoning.state if reasoning is not None else "after"
        self.prompt: int | None = None  # history length at the first call
        self.start: int | None = None  # where in the history the grammar starts
        self.scanned = 0  # history searched for the close tag so far
        self.fed = 0  # tokens the matcher has consumed

    def allowed(self, history: Sequence[int]) -> np.ndarray | None:
        """(vocab,) bool: what the grammar allows after the reply so far; None while the
        reply is still reasoning (unconstrained)."""
        if self.prompt is None:
            self.prompt = self.scanned = len(history)
        if self.start is None:  # indices, not slices: this runs once per generated token
            r = self.reasoning
            if self.state == "start":  # the model may open a reasoning block first
                if len(history) == self.prompt:
                    mask = self._mask()
                    mask[r.open_id] = True
                    return mask
                self.state = "inside" if history[self.prompt] == r.open_id else "after"
            if self.state == "inside":
                while self.scanned < len(history) and history[self.scanned] != r.close_id:
                    self.scanned += 1
                if self.scanned == len(history):
                    return None
                self.start = self.scanned + 1
            else:
                self.start = self.prompt
        for token in history[self.start + self.fed :]:
            if not self.matcher.consume_token(token):
                raise ConstraintError(
                    f"token {token} broke the grammar: {self.matcher.get_error()}", field=FIELD
                )
            self.fed += 1
        return self._mask()

    def fork(self) -> GrammarMask:
        """A copy whose matcher consumes on its own (a drafter's proposals: the request's own
        mask moves on only with the tokens that are kept)."""
        twin = copy.copy(self)
        twin.matcher = self.matcher.deep_copy()
        twin.bitmask = self.bitmask.copy()
        return twin

    def _mask(self) -> np.ndarray:
        llnp.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        bits = np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")
        mask = bits[: self.vocab].astype(bool)
        # llguidance 1.9 lets every special token through where an optional piece precedes a
        # token it names (`"a" ("b")? <[id]>` after "a": all 22 of Qwen2.5's) and refuses the
        # wrong ones when they come: each allowed one is checked alone (~1 us)
        for token in self.specials[mask[self.specials]] if self.specials.size else ():
            if token in self.stops:  # a stop ends the reply where the grammar may end
                mask[token] = self.matcher.is_accepting()
            elif not self.matcher.validate_tokens([int(token)]):
                mask[token] = False
        return mask

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        allowed = self.allowed(history)
        if allowed is None:
            return logits
        return mx.where(mx.array(allowed)[None], logits, NEG_INF)  # (1, vocab)


def constraint(
    response_format: Any,
    tokenizer: Tokenizer,
    vocab: int,
    stops: Sequence[int],
    field: str = FIELD,
    prompt: str | None = None,
    special: Sequence[int] = (),
) -> GrammarMask:
    """The processor that enforces `response_format` (checked before anything generates);
    with the rendered `prompt`, a reasoning model's reasoning stays free."""
    if not stops:
        raise ConstraintError("a constrained reply needs a stop token to end on", field=field)
    text = grammar(response_format, field)
    tok = engine_tokenizer(tokenizer, vocab, stops, special)
    check(text, tok, response_format, field)
    where = _where(response_format, field)
    specials = [*tokenizer.special_tokens.values(), *stops, *special]
    mask = GrammarMask(tok, text, vocab, reasoning_of(tokenizer, prompt), where, specials, stops)
    probe(mask.matcher, tok, stops, where)
    return mask
