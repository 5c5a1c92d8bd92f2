"""Pooling as data: how a padded batch of hidden states becomes one vector per row, then the
Dense projections, normalisation and Matryoshka truncation a checkpoint asks for.

`Pooling.from_st` reads sentence-transformers' 1_Pooling/config.json in both its spellings
(6.x: "pooling_mode"; earlier: one "pooling_mode_*_tokens" flag per mode); a mode this module
does not implement, or a setting it cannot honour, is refused naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxlis.errors import ConfigError, MlxlisError, UnsupportedError

import mlx.core as mx

MODES = ("cls", "mean", "max", "lasttoken", "mean_sqrt_len_tokens")
# sentence-transformers' earlier flags, each naming one mode
_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def _first(h: mx.array, mask: mx.array) -> mx.array:
    return h[:, 0]  # rows are right-padded: the first token is a real one


def _masked_sum(h: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    m = mask[..., None].astype(h.dtype)  # (B, T, 1)
    # the count is clamped as sentence-transformers does (an all-pad row gives 0, not NaN)
    return (h * m).sum(axis=1), mx.maximum(m.sum(axis=1), 1e-9)


def _mean(h: mx.array, mask: mx.array) -> mx.array:
    total, count = _masked_sum(h, mask)
    return total / count


def _mean_sqrt(h: mx.array, mask: mx.array) -> mx.array:
    total, count = _masked_sum(h, mask)
    return total / mx.sqrt(count)


def _max(h: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask[..., None] > 0, h, -mx.inf).max(axis=1)


def _last(h: mx.array, mask: mx.array) -> mx.array:
    last = mask.astype(mx.int32).sum(axis=1) - 1  # (B,) the last real token of each row
    return mx.take_along_axis(h, mx.maximum(last, 0)[:, None, None], axis=1)[:, 0]


POOLERS: dict[str, Callable[[mx.array, mx.array], mx.array]] = {
    "cls": _first,
    "mean": _mean,
    "max": _max,
    "lasttoken": _last,
    "mean_sqrt_len_tokens": _mean_sqrt,
}


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers Dense module: y = act(W x + b), act "tanh" or "identity"."""

    weight: mx.array  # (out, in)
    bias: mx.array | None
    activation: str = "identity"

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return mx.tanh(y) if self.activation == "tanh" else y


@dataclass(frozen=True)
class Pooling:
    """The modes (their vectors concatenated in this order, as sentence-transformers does),
    then the Dense projections, then L2 normalisation when `normalize`."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    dense: tuple[Dense, ...] = field(default=(), compare=False)

    @classmethod
    def from_st(cls, config: dict, path: Path | str) -> Pooling:
        """From 1_Pooling/config.json's dict (`path` names it in errors)."""
        if not isinstance(config, dict):
            raise ConfigError("expected a JSON object", path=path)
        mode = config.get("pooling_mode")
        if mode is None:
            modes = tuple(m for k, m in _FLAGS.items() if config.get(k))
            where = next((k for k in _FLAGS if config.get(k)), "pooling_mode_mean_tokens")
        else:
            modes = (mode,) if isinstance(mode, str) else tuple(mode)
            where = "pooling_mode"
        if not modes:
            raise ConfigError("no pooling mode is set", path=path, field="pooling_mode")
        for m in modes:
            if m not in MODES:
                raise UnsupportedError(
                    f"pooling mode {m!r} is not implemented (known: {', '.join(MODES)})",
                    path=path,
                    field=where,
                )
        if config.get("include_prompt", True) is False:
            raise UnsupportedError(
                "pooling that leaves the prompt's tokens out is not implemented",
                path=path,
                field="include_prompt",
            )
        return cls(modes=modes)

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        """(B, T, hidden) hidden states, (B, T) mask -> (B, d) float32 vectors."""
        h = h.astype(mx.float32)
        parts = [POOLERS[m](h, mask) for m in self.modes]
        v = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        for dense in self.dense:
            v = dense(v)
        return l2_normalize(v) if self.normalize else v


def l2_normalize(v: mx.array) -> mx.array:
    """Rows to unit length (a zero row stays zero: the norm is clamped as torch's normalize)."""
    norm = mx.sqrt((v * v).sum(axis=-1, keepdims=True))
    return v / mx.maximum(norm, 1e-12)


def matryoshka(v: mx.array, dimensions: int | None, normalized: bool) -> mx.array:
    """The first `dimensions` values of each row (a Matryoshka model's shorter embedding),
    renormalised to unit length when the full vectors were: a truncated unit vector is not
    one. None: `v` as it is."""
    if dimensions is None:
        return v
    d = v.shape[-1]
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= d:
        raise MlxlisError(f"dimensions must be an integer from 1 to {d}", field="dimensions")
    v = v[:, :dimensions]
    return l2_normalize(v) if normalized else v


def dense_activation(name: object, path: Path | str) -> str:
    """A Dense module's activation_function (a torch class path) as ours, or refused."""
    known = {
        "torch.nn.modules.activation.Tanh": "tanh",
        "torch.nn.modules.linear.Identity": "identity",
        None: "identity",
    }
    if name not in known:
        raise UnsupportedError(
            f"Dense activation {name!r} is not implemented (Tanh, Identity)",
            path=path,
            field="activation_function",
        )
    return known[name]
