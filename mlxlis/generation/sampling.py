"""Sampling outside the model: logits in, one token id out.

Greedy for temperature 0; otherwise temperature, top-k, top-p and min-p filters, then a
categorical draw from an explicit PRNG key so a seed reproduces a run. Filters run on float32
logits and are compiled once per setting.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from mlxlis.errors import MlxlisError

import mlx.core as mx

NEG_INF = float("-inf")


def _seed(text: str) -> int | None:
    return None if text.strip().lower() in ("none", "random", "") else int(text)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# name -> (parse typed text, check a value, what a good value is): the one definition of every
# sampling parameter, used by the library, the CLI and the chat app's /params
FIELDS: dict[str, tuple[Callable[[str], object], Callable[[object], bool], str]] = {
    "max_tokens": (int, lambda v: _is_int(v) and v > 0, "an integer > 0"),
    "temperature": (float, lambda v: _is_num(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (float, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "top_k": (int, lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (float, lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1) (0 = off)"),
    "repetition_penalty": (float, lambda v: _is_num(v) and v > 0, "a number > 0 (1 = off)"),
    "repetition_context": (int, lambda v: _is_int(v) and v > 0, "an integer > 0"),
    "seed": (
        _seed,
        lambda v: v is None or (_is_int(v) and 0 <= v < 2**64),
        "an integer in [0, 2**64), or none",
    ),
}
ALIASES = {
    "temp": "temperature",
    "max": "max_tokens",
    "maxtokens": "max_tokens",
    "rep": "repetition_penalty",
    "repeat_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are picked and how many; the defaults here are the defaults everywhere."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None

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


@partial(mx.compile, shapeless=True)
def _top_p(logits: mx.array, top_p: mx.array) -> mx.array:
    # keep the smallest set of tokens whose probability mass reaches top_p
    probs = mx.softmax(logits, axis=-1, precise=True)
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, NEG_INF)


@partial(mx.compile, shapeless=True)
def _min_p(logits: mx.array, min_p: mx.array) -> mx.array:
    # drop tokens whose probability is below min_p × the top probability
    threshold = mx.max(logits, axis=-1, keepdims=True) + mx.log(min_p)
    return mx.where(logits >= threshold, logits, NEG_INF)


def _top_k(logits: mx.array, k: int) -> mx.array:
    if k >= logits.shape[-1]:
        return logits
    kth = mx.sort(logits, axis=-1)[..., -k][..., None]
    return mx.where(logits >= kth, logits, NEG_INF)


def make_filter(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A function (…, vocab) float32 logits -> the logits a draw is made from: scaled by
    1/temperature, then top-k, top-p and min-p (tokens they drop at -inf). Temperature 0 is
    greedy: no filter is defined for it."""
    params.validate()
    if params.temperature == 0:
        raise ValueError("greedy sampling has no distribution to filter")
    inv_t = 1.0 / params.temperature
    top_p = mx.array(params.top_p, mx.float32)
    min_p = mx.array(params.min_p, mx.float32)

    def filtered(logits: mx.array) -> mx.array:
        logits = logits * inv_t
        if params.top_k:
            logits = _top_k(logits, params.top_k)
        if params.top_p < 1.0:
            logits = _top_p(logits, top_p)
        if params.min_p > 0.0:
            logits = _min_p(logits, min_p)
        return logits

    return filtered


def make_key(params: SamplingParams, stream: int = 0) -> mx.array:
    """The PRNG key a run starts from: the seed's, else a fresh one. `stream` > 0: a key of
    its own for another consumer of the same seed (a drafter, the speculative verdict), so its
    draws are independent of the sampler's (split(key, n)[n − 1]: not on the sampler's chain
    of split(key)[0] keys and [1] subkeys)."""
    key = mx.random.key(params.seed if params.seed is not None else _fresh_seed())
    return key if stream == 0 else mx.random.split(key, stream + 2)[stream + 1]


def make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A function (1, vocab) float32 logits -> (1,) int32 token."""
    params.validate()
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    key = [make_key(params)]
    filtered = make_filter(params)

    def sample(logits: mx.array) -> mx.array:
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(filtered(logits), axis=-1, key=sub)

    return sample


def _fresh_seed() -> int:
    import secrets

    return secrets.randbits(31)
