"""Sampling outside the model: logits in, one token id out.

The chain, in the order llama.cpp's sampler chain runs it (common/sampling.cpp, its default
`samplers`), stated here once for every surface:

  logit bias → penalties (repetition, presence, frequency) → DRY      the processors
  → top-n-sigma → top-k → typical-p → top-p → min-p → XTC → temperature → the draw

The first three are logits processors (processors.py: they read the history); the rest run
here on float32 logits. Temperature 0 is greedy (argmax after the chain: XTC, when it fires,
can still move it). Mirostat v2 replaces the plain draw (llama.cpp runs it after temperature
alone; here the truncation samplers a request also sets apply before it, never ignored).
Each draw takes a key split from one PRNG key, so a seed reproduces a run; XTC's coin takes a
key of its own split from the draw's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from mlxlis.errors import MlxlisError
from mlxlis.generation.truncation import (  # noqa: F401 — the filters' names, as before
    NEG_INF,
    Mirostat,
    _min_p,
    _top_k,
    _top_n_sigma,
    _top_p,
    _typical,
    _xtc,
)

import mlx.core as mx

DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default sequence breakers


def _seed(text: str) -> int | None:
    return None if text.strip().lower() in ("none", "random", "") else int(text)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bias(text: str) -> tuple[tuple[int, float], ...]:
    """ "15339:-100,1234:5" -> ((1234, 5.0), (15339, -100.0))."""
    pairs = [item.split(":") for item in text.replace(" ", "").split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(text)
    return tuple(sorted((int(i), float(b)) for i, b in pairs))


def _is_bias(v: object) -> bool:
    return (
        isinstance(v, tuple)
        and all(
            isinstance(p, tuple)
            and len(p) == 2
            and _is_int(p[0])
            and p[0] >= 0
            and _is_num(p[1])
            and -100 <= p[1] <= 100
            for p in v
        )
        and len({p[0] for p in v}) == len(v)  # one bias a token
    )


def _breakers(text: str) -> tuple[str, ...]:
    """A JSON list of strings: '["\\n", ":"]'."""
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(text)
    return tuple(value)


def _is_breakers(v: object) -> bool:
    return isinstance(v, tuple) and all(isinstance(s, str) and s for s in v)


# name -> (parse typed text, check a value, what a good value is): the one definition of every
# sampling parameter, used by the library, the CLI and the chat app's /params
FIELDS: dict[str, tuple[Callable[[str], object], Callable[[object], bool], str]] = {
    "max_tokens": (int, lambda v: _is_int(v) and v > 0, "an integer > 0"),
    "temperature": (float, lambda v: _is_num(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (float, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "top_k": (int, lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (float, lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1) (0 = off)"),
    "typical_p": (float, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "top_n_sigma": (float, lambda v: _is_num(v) and v >= 0, "a number >= 0 (0 = off)"),
    "repetition_penalty": (float, lambda v: _is_num(v) and v > 0, "a number > 0 (1 = off)"),
    "repetition_context": (int, lambda v: _is_int(v) and v > 0, "an integer > 0"),
    "presence_penalty": (
        float,
        lambda v: _is_num(v) and -2 <= v <= 2,
        "a number in [-2, 2] (0 = off)",
    ),
    "frequency_penalty": (
        float,
        lambda v: _is_num(v) and -2 <= v <= 2,
        "a number in [-2, 2] (0 = off)",
    ),
    "logit_bias": (
        _bias,
        _is_bias,
        "token id:bias pairs, one a token, biases in [-100, 100] (15339:-100,…)",
    ),
    "dry_multiplier": (float, lambda v: _is_num(v) and v >= 0, "a number >= 0 (0 = off)"),
    "dry_base": (float, lambda v: _is_num(v) and v >= 1, "a number >= 1"),
    "dry_allowed_length": (int, lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "dry_penalty_last_n": (
        int,
        lambda v: _is_int(v) and v >= -1,
        "an integer >= -1 (-1 = the whole history, 0 = off)",
    ),
    "dry_sequence_breakers": (_breakers, _is_breakers, 'a JSON list of strings (["\\n", ":"])'),
    "xtc_probability": (float, lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "xtc_threshold": (float, lambda v: _is_num(v) and 0 <= v <= 0.5, "a number in [0, 0.5]"),
    "mirostat": (
        int,
        lambda v: _is_int(v) and v in (0, 2),
        "0 (off) or 2 (mirostat v2; v1 is not implemented)",
    ),
    "mirostat_tau": (float, lambda v: _is_num(v) and v > 0, "a number > 0"),
    "mirostat_eta": (float, lambda v: _is_num(v) and v > 0, "a number > 0"),
    "seed": (
        _seed,
        lambda v: v is None or (_is_int(v) and 0 <= v < 2**64),
        "an integer in [0, 2**64), or none",
    ),
}
# other names for the fields: the chat app's short ones, and llama.cpp's / Ollama's
ALIASES = {
    "temp": "temperature",
    "max": "max_tokens",
    "maxtokens": "max_tokens",
    "rep": "repetition_penalty",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repetition_context",
    "typ_p": "typical_p",
    "presence": "presence_penalty",
    "frequency": "frequency_penalty",
}


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are picked and how many; the defaults here are the defaults everywhere (each
    sampler off; DRY's and XTC's shape values and mirostat's tau and eta as llama.cpp's)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    top_n_sigma: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    presence_penalty: float = 0.0  # OpenAI's: over the generated tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None

    def __post_init__(self) -> None:
        # a mapping {id: bias} (JSON's string ids too) and a list of breakers, as tuples
        bias = self.logit_bias
        if isinstance(bias, dict):
            try:
                pairs = tuple(sorted((int(k), v) for k, v in bias.items()))
            except (TypeError, ValueError):
                pairs = bias  # type: ignore[assignment]  # refused by validate, named
            object.__setattr__(self, "logit_bias", pairs)
        if isinstance(self.dry_sequence_breakers, list):
            object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))

    def validate(self) -> SamplingParams:
        """Self, or a SamplingError naming the first bad field."""
        for name, (_, check, what) in FIELDS.items():
            value = getattr(self, name)
            if not check(value):
                raise SamplingError(f"must be {what}, not {value!r}", field=name)
        return self

    def replace(self, **changes: object) -> SamplingParams:
        """A validated copy with `changes` (names as the fields, or their ALIASES)."""
        changes = {canonical(k): v for k, v in changes.items()}
        return dataclasses.replace(self, **changes).validate()

    def with_text(self, assignments: str) -> SamplingParams:
        """Apply "top_p=0.9 max_tokens=200" as typed by a user: all or nothing."""
        changes: dict[str, object] = {}
        for item in assignments.split():
            key, eq, raw = item.partition("=")
            if not eq:
                raise SamplingError(
                    f"expected name=value, got {item!r} (e.g. top_p=0.9)", field="sampling"
                )
            name = canonical(key)
            changes[name] = parse_value(name, raw)
        return self.replace(**changes)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class SamplingError(MlxlisError):
    """A sampling parameter out of its range, of the wrong type or unknown."""


def canonical(name: str) -> str:
    """The field name for a typed name or alias; SamplingError if there is none."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in FIELDS:
        raise SamplingError(f"unknown sampling parameter (known: {', '.join(FIELDS)})", field=name)
    return key


def parse_value(name: str, raw: str) -> object:
    """One typed value, parsed and checked against its field."""
    name = canonical(name)
    parse, check, what = FIELDS[name]
    try:
        value = parse(raw)
    except ValueError:
        raise SamplingError(f"must be {what}, not {raw!r}", field=name) from None
    if not check(value):
        raise SamplingError(f"must be {what}, not {raw!r}", field=name)
    return value


def _truncate(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """top-n-sigma, top-k, typical-p, top-p and min-p, in the chain's order."""
    top_p = mx.array(params.top_p, mx.float32)
    min_p = mx.array(params.min_p, mx.float32)

    def truncated(logits: mx.array) -> mx.array:
        if params.top_n_sigma > 0:
            logits = _top_n_sigma(logits, params.top_n_sigma)
        if params.top_k:
            logits = _top_k(logits, params.top_k)
        if params.typical_p < 1.0:
            logits = _typical(logits, params.typical_p)
        if params.top_p < 1.0:
            logits = _top_p(logits, top_p)
        if params.min_p > 0.0:
            logits = _min_p(logits, min_p)
        return logits

    return truncated


def draws_of_its_own(params: SamplingParams) -> str | None:
    """The sampler that makes random choices besides the draw (XTC's coin, mirostat's
    state): its distribution is no fixed filter of the logits, so a speculative ratio test
    cannot hold it. None: there is none."""
    if params.xtc_probability > 0:
        return "xtc_probability"
    if params.mirostat:
        return "mirostat"
    return None


def make_filter(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A function (…, vocab) float32 logits -> the logits a draw is made from: the chain's
    truncation samplers (tokens they drop at -inf), then scaled by 1/temperature. Temperature
    0 is greedy: no filter is defined for it; nor is one for XTC or mirostat (draws_of_its_own)."""
    params.validate()
    if params.temperature == 0:
        raise ValueError("greedy sampling has no distribution to filter")
    if (name := draws_of_its_own(params)) is not None:
        raise SamplingError("not with speculative decoding (it makes draws of its own)", field=name)
    inv_t = 1.0 / params.temperature
    truncated = _truncate(params)
    return lambda logits: truncated(logits) * inv_t


def make_key(params: SamplingParams, stream: int = 0) -> mx.array:
    """The PRNG key a run starts from: the seed's, else a fresh one. `stream` > 0: a key of
    its own for another consumer of the same seed (a drafter, the speculative verdict), so its
    draws are independent of the sampler's (split(key, n)[n − 1]: not on the sampler's chain
    of split(key)[0] keys and [1] subkeys)."""
    key = mx.random.key(params.seed if params.seed is not None else _fresh_seed())
    return key if stream == 0 else mx.random.split(key, stream + 2)[stream + 1]


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A function (1, vocab) float32 logits -> (1,) int32 token: the chain from top-n-sigma
    on (the module docstring)."""
    params.validate()
    xtc = params.xtc_probability > 0
    if params.temperature == 0 and not xtc:
        return lambda logits: mx.argmax(logits, axis=-1)
    key = [make_key(params)]
    truncated = _truncate(params)
    inv_t = 1.0 / params.temperature if params.temperature else 0.0
    mirostat = Mirostat(params.mirostat_tau, params.mirostat_eta) if params.mirostat else None

    def sample(logits: mx.array) -> mx.array:
        key[0], sub = mx.random.split(key[0])
        logits = truncated(logits)
        if xtc:
            coin, sub = mx.random.split(sub)
            fire = mx.random.uniform(key=coin) < params.xtc_probability
            logits = _xtc(logits, params.xtc_threshold, fire)
        if params.temperature == 0:
            return mx.argmax(logits, axis=-1)
        logits = logits * inv_t
        if mirostat is not None:
            return mirostat(logits, sub)
        return mx.random.categorical(logits, axis=-1, key=sub)

    return sample


def _fresh_seed() -> int:
    import secrets

    return secrets.randbits(31)
