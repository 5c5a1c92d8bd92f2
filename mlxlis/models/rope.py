"""Rotary position embedding shared by every family: default, linear, llama3, yarn and longrope
scaling."""

from __future__ import annotations

import math

from mlxlis.errors import ConfigError
from mlxlis.models.config import RopeConfig
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn


def rope_periods(rope: RopeConfig, dims: int, long: bool = False) -> mx.array | None:
    """Per-pair wavelengths (1 / inv_freq) for mx.fast.rope's `freqs`, or None for plain RoPE
    (`long`: longrope's past the original context)."""
    if rope.type == "longrope":  # transformers' _compute_longrope_parameters
        factors = mx.array(rope.long_factor if long else rope.short_factor, mx.float32)
        return factors * rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    if rope.type == "yarn":
        return 1.0 / yarn_inv_freq(rope, dims)
    if rope.type != "llama3":
        return None
    periods = rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelens = 2 * math.pi * periods
    # long wavelengths are slowed by `factor`; the band between is interpolated smoothly
    periods = mx.where(wavelens > low_wavelen, periods * rope.factor, periods)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (rope.original_max_position_embeddings / wavelens - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = periods / ((1 - smooth) / rope.factor + smooth)
    return mx.where(is_medium, smoothed, periods)


def yarn_inv_freq(rope: RopeConfig, dims: int) -> mx.array:
    """transformers' _compute_yarn_parameters: each pair's frequency between the original
    (extrapolated, fast pairs) and the one slowed by `factor` (interpolated, slow pairs),
    along a linear ramp over the pairs whose rotations in the original context lie between
    beta_fast and beta_slow."""

    def pair(rotations: float) -> float:  # the pair turning `rotations` times in the context
        ctx = rope.original_max_position_embeddings
        return dims * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair(rope.beta_fast), pair(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos = rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # 1: the pair keeps its original frequency
    return (1.0 / (rope.factor * pos)) * ramp + (1.0 / pos) * extrapolated


class Rope(nn.Module):
    """RoPE in the rotate-half (non-interleaved) layout that HF checkpoints use, or with
    `interleaved` on adjacent pairs (2i, 2i+1) (Llama 4's complex rotation)."""

    def __init__(
        self,
        dims: int,
        rope: RopeConfig,
        freq_factors: mx.array | None = None,
        interleaved: bool = False,
    ):
        super().__init__()
        self.dims = dims
        self.interleaved = interleaved
        self.base: float | None = rope.theta
        self.scale = 1.0 / rope.factor if rope.type == "linear" else 1.0
        # q and k by yarn's / longrope's attention factor
        self.mscale = rope.attention_factor if rope.type in ("yarn", "longrope") else 1.0
        periods = rope_periods(rope, dims)
        # longrope: the long factors' periods, for a pass that reaches past `_within` positions
        self._long, self._within = None, 0
        if rope.type == "longrope":
            self._long = rope_periods(rope, dims, long=True)
            self._within = rope.original_max_position_embeddings
            mx.eval(self._long)
        if freq_factors is not None:  # GGUF rope_freqs: llama.cpp divides each inv_freq by it
            if periods is None:
                periods = rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
            periods = periods * freq_factors.astype(mx.float32)
        if periods is not None:
            mx.eval(periods)  # now, on the loading thread's stream: another thread may run it
        self._periods = periods  # underscore: a buffer, not a loadable parameter
        if periods is not None:
            self.base = None

    def at(self, x: mx.array, pos: mx.array) -> mx.array:
        """x (B, heads, T, head_dim) turned at explicit positions `pos` (T, dims / 2): each
        pair of each position its own (Qwen3.5's M-RoPE interleaves three position streams
        over the pairs); cos and sin in float32, then x's dtype, as transformers."""
        if self._periods is not None:
            long = self._long is not None and int(mx.max(pos)) + 1 > self._within
            inv = 1.0 / (self._long if long else self._periods)
        else:
            inv = 1.0 / (self.base ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims))
        ang = pos.astype(mx.float32) * self.scale * inv  # (T, dims / 2)
        r = self._scaled(x)[..., : self.dims]
        if self.interleaved:  # pairs (2i, 2i+1): rotate each as a complex number
            cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
            pairs = r.reshape(*r.shape[:-1], -1, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            r = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(r.shape)
            return r if self.dims == x.shape[-1] else mx.concatenate([r, x[..., self.dims :]], -1)
        ang = mx.concatenate([ang, ang], axis=-1)
        cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
        a, b = mx.split(r, 2, axis=-1)
        r = r * cos + mx.concatenate([-b, a], axis=-1) * sin
        return r if self.dims == x.shape[-1] else mx.concatenate([r, x[..., self.dims :]], -1)

    def _scaled(self, x: mx.array) -> mx.array:
        """x with its rotary dims times yarn's attention factor (transformers scales cos and
        sin by it: the same product, rotation being linear)."""
        if self.mscale == 1.0:
            return x
        r = x[..., : self.dims] * mx.array(self.mscale, x.dtype)
        return r if self.dims == x.shape[-1] else mx.concatenate([r, x[..., self.dims :]], -1)

    def __call__(
        self, x: mx.array, offset: int | mx.array = 0, heads_last: bool = False
    ) -> mx.array:
        """x (B, heads, T, head_dim) turned from position `offset` (one per row, (B,), in a
        batch); `heads_last`: x is (B, T, heads, head_dim), the result still (B, heads, T,
        head_dim). Longrope: the long factors for a pass reaching past the original context, as
        transformers picks them per forward (each row its own, in a batch)."""
        if self._long is None:  # (yarn's factor scales head_dim, the last axis either way)
            return self._rope(x, offset, self._periods, heads_last)
        if heads_last:
            x = x.transpose(0, 2, 1, 3)
        t = x.shape[-2]
        if not isinstance(offset, mx.array):
            long = offset + t > self._within
            return self._rope(x, offset, self._long if long else self._periods)
        past = (offset + t > self._within).reshape(-1, 1, 1, 1)
        return mx.where(
            past, self._rope(x, offset, self._long), self._rope(x, offset, self._periods)
        )

    def _rope(
        self,
        x: mx.array,
        offset: int | mx.array,
        periods: mx.array | None,
        heads_last: bool = False,
    ) -> mx.array:
        return fused.rope(
            self._scaled(x),
            self.dims,
            traditional=self.interleaved,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=periods,
            heads_last=heads_last,
        )


# llama3 scalings published checkpoints use: (factor, low_freq_factor, high_freq_factor,
# original_max_position_embeddings) — Llama 3.1/3.3, 3.2, Llama 4 Scout
LLAMA3_KNOWN = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 1.0, 8192))


def llama3_factors(rope: RopeConfig, dims: int) -> list[float]:
    """The per-pair factors llama.cpp's converter stores as rope_freqs for llama3 scaling
    (LlamaModel.generate_extra_tensors: 1, `factor`, or the smooth band between)."""
    out = []
    low = rope.original_max_position_embeddings / rope.low_freq_factor
    high = rope.original_max_position_embeddings / rope.high_freq_factor
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * rope.theta ** (i / dims)
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(rope.factor)
        else:
            s = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            out.append(1 / ((1 - s) / rope.factor + s))
    return out


def llama3_from_factors(theta: float, dims: int, factors: list[float]) -> RopeConfig | None:
    """The llama3 RoPE scaling whose stored factors these are, among the published ones (so
    a GGUF's rope_freqs is config again, which `convert` can write); None when none is."""
    for factor, low, high, orig in LLAMA3_KNOWN:
        rope = RopeConfig(theta, "llama3", factor, low, high, orig)
        want = llama3_factors(rope, dims)
        if len(want) == len(factors) and all(
            math.isclose(a, b, rel_tol=1e-5) for a, b in zip(want, factors, strict=True)
        ):
            return rope
    return None


def proportional_rope(
    dims: int, theta: float, rotated: int | None, factor: float, factors: mx.array | None, path: str
) -> Rope:
    """Proportional RoPE (transformers): only the first `rotated` pairs of each half turn, at
    frequencies over all `dims`; the rest get an infinite wavelength. A GGUF states the same
    as `rope_freqs` factors (1 turned, 1e30 not), read as llama.cpp reads them."""
    if factors is not None and factors.size != dims // 2:
        raise ConfigError(
            f"{factors.size} values for {dims} rotary dims", path=path, field="rope_freqs.weight"
        )
    if factors is None and rotated is not None and rotated < dims // 2:
        factors = mx.concatenate([mx.ones((rotated,)), mx.full((dims // 2 - rotated,), mx.inf)])
    rope = RopeConfig(theta=theta, type="linear", factor=factor)  # positions ÷ factor
    return Rope(dims, rope if factor != 1 else RopeConfig(theta=theta), factors)
