"""The Mamba-2 mixer (state space duality), the recurrent layer of Granite 4.0 and Nemotron-H.

in_proj splits each position into a gate z (inner), the convolution's input xBC (inner + 2·G·N:
x by H heads of P dims, then B and C by G groups of N) and a raw step dt (one per head). xBC
runs through a causal depthwise convolution (kernel K, bias) and SiLU; then, per head h (its
group g = h // (H / G)), with dt_t = clip(softplus(dt_t + dt_bias), dt_limit) and A = −exp(A_log):

    S_t = exp(dt_t·A)·S_{t−1} + dt_t·x_t ⊗ B_t        (S: P × N)
    y_t = S_t·C_t + D·x_t

then a gated RMSNorm: the gate first, rmsnorm(y · silu(z)) per group of inner / G channels, × w
(transformers' GraniteMoeHybridRMSNormGated / Zamba2RMSNormGated, norm_before_gate=False), and
out_proj. Decoding runs that step; a prompt runs the chunked form (chunks of `chunk` tokens:
within a chunk, a causal (C·B)-weighted sum of decayed inputs; across chunks, the state carried
from one to the next), equal to the step form up to rounding.

State (a RecurrentCache): `conv_state` the last K − 1 inputs of the convolution (B, K − 1,
conv_dim), `recurrent` S (B, H, P, N) in float32. Like the Gated DeltaNet's it snapshots for
prefix reuse, keeps the state after each token of a verification (the step form, token by
token) for a speculative rewind, batches through CacheBatch (each row its own state) and goes to
the disk cache. Parameter names equal the Hugging Face names (`in_proj`, `conv1d`, `dt_bias`,
`A_log`, `D`, `norm`, `out_proj`); the kernel is torch's (conv_dim, 1, K). Beside the mixer:
its readers (config.json keys the family names, llama.cpp's ssm.* metadata), llama.cpp's
converter conventions undone (GGUF_CONVENTIONS) and its `inspect` description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlxlis import limits
from mlxlis.cache import CacheBatch, RecurrentCache
from mlxlis.errors import ConfigError
from mlxlis.limits import check_sizes
from mlxlis.models.base import Convention, GGUFMeta

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass(frozen=True)
class Mamba2Config:
    """The mixer's shape: H heads of P dims (inner = H·P), N state dims in G groups, a
    convolution of K taps, prompts scanned in chunks of `chunk` tokens, dt clipped to
    `dt_limit`, the gated norm's eps."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv_kernel: int
    chunk: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state

    def state_bytes(self) -> int:
        """One sequence's state in bytes: the conv inputs and S, in float32."""
        return 4 * ((self.conv_kernel - 1) * self.conv_dim + self.inner * self.state)


@mx.compile  # one fused kernel per decode step
def ssm_step(x, dt, a, b, c, d, state):
    """One token. x: (B, H, P); dt: (B, H) (after softplus); a, d: (H,); b, c: (B, H, N) (per
    head); state: (B, H, P, N). Returns (y (B, H, P), new state)."""
    decay = mx.exp(dt * a)[..., None, None]  # (B, H, 1, 1)
    state = state * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    y = (state @ c[..., None])[..., 0] + d[:, None] * x
    return y, state


def ssm_chunked(x, dt, a, b, c, d, state, chunk: int):
    """T tokens at once. x: (B, H, T, P); dt: (B, H, T); a, d: (H,); b, c: (B, H, T, N);
    state: (B, H, P, N). Returns (y (B, H, T, P), new state)."""
    bs, h, t, p = x.shape
    pad = (-t) % chunk
    if pad:  # dt = 0 past the end: no decay, no input, the state passes through unchanged
        x, b, c = (mx.pad(y, [(0, 0), (0, 0), (0, pad), (0, 0)]) for y in (x, b, c))
        dt = mx.pad(dt, [(0, 0), (0, 0), (0, pad)])
    n = (t + pad) // chunk
    xdt = (x * dt[..., None]).reshape(bs, h, n, chunk, p)  # (B, H, N, L, P)
    b, c = (y.reshape(bs, h, n, chunk, -1) for y in (b, c))  # (B, H, N, L, N_state)
    cum = mx.cumsum((dt * a[:, None]).reshape(bs, h, n, chunk), axis=-1)  # log decay from start
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    # decay from position j to i ≥ j of a chunk; exp only where j ≤ i (no overflow above)
    pair = mx.exp(mx.where(lower, cum[..., :, None] - cum[..., None, :], -mx.inf))
    within = (c @ b.swapaxes(-1, -2)) * pair  # (B, H, N, L, L)
    diag = within @ xdt  # the chunk's own inputs, (B, H, N, L, P)
    c_dec = c * mx.exp(cum)[..., None]  # reads the state as of the chunk start
    to_end = xdt * mx.exp(cum[..., -1:] - cum)[..., None]  # inputs decayed to the chunk end
    last = mx.exp(cum[..., -1])[..., None, None]  # (B, H, N, 1, 1)
    outs = []
    for i in range(n):  # the scan over chunks
        outs.append(diag[:, :, i] + c_dec[:, :, i] @ state.swapaxes(-1, -2))
        state = state * last[:, :, i] + to_end[:, :, i].swapaxes(-1, -2) @ b[:, :, i]
    y = mx.concatenate(outs, axis=2)[:, :, :t] + d[:, None, None] * x[:, :, :t]
    return y, state


class GroupGatedRMSNorm(nn.Module):
    """rmsnorm(y · silu(z)) over each of `groups` channel groups, × w, in float32."""

    def __init__(self, dims: int, groups: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.groups, self.eps = groups, eps

    def __call__(self, y: mx.array, z: mx.array) -> mx.array:
        f32 = mx.float32
        g = y.astype(f32) * nn.silu(z.astype(f32))  # the gate before the norm
        g = g.reshape(*g.shape[:-1], self.groups, -1)  # (..., G, inner / G)
        g = mx.fast.rms_norm(g, None, self.eps).reshape(y.shape)
        return (self.weight.astype(f32) * g).astype(y.dtype)


class Mamba2Mixer(nn.Module):
    """(B, T, hidden) -> (B, T, hidden) over a RecurrentCache (or CacheBatch, or none)."""

    def __init__(self, hidden: int, m: Mamba2Config):
        super().__init__()
        self.m = m
        self.in_proj = nn.Linear(hidden, m.inner + m.conv_dim + m.heads, bias=m.proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((m.conv_dim, 1, m.conv_kernel))  # torch's (C, 1, K)
        if m.conv_bias:
            self.conv1d.bias = mx.zeros((m.conv_dim,))
        self.dt_bias = mx.ones((m.heads,))
        self.A_log = mx.zeros((m.heads,))
        self.D = mx.ones((m.heads,))
        self.norm = GroupGatedRMSNorm(m.inner, m.groups, m.eps)
        self.out_proj = nn.Linear(m.inner, hidden, bias=m.proj_bias)

    def _conv(self, xp: mx.array) -> mx.array:
        """Causal depthwise convolution + SiLU. xp: (B, K − 1 + T, C) -> (B, T, C)."""
        k = self.m.conv_kernel
        t = xp.shape[1] - (k - 1)
        w = self.conv1d.weight[:, 0, :].astype(xp.dtype)  # (C, K)
        y = sum(xp[:, j : j + t] * w[:, j] for j in range(k))
        if "bias" in self.conv1d:
            y = y + self.conv1d.bias.astype(xp.dtype)
        return nn.silu(y)

    def __call__(self, x: mx.array, cache: RecurrentCache | CacheBatch | None) -> mx.array:
        if isinstance(cache, CacheBatch):  # sequences decoding together: their states stacked
            return self._batch(x, cache.caches)
        m, f32 = self.m, mx.float32
        bs, t, _ = x.shape
        z, xbc, dt = mx.split(self.in_proj(x), [m.inner, m.inner + m.conv_dim], axis=-1)
        before = cache.conv_state if cache is not None else None
        if before is None:
            before = mx.zeros((bs, m.conv_kernel - 1, m.conv_dim), xbc.dtype)
        xp = mx.concatenate([before.astype(xbc.dtype), xbc], axis=1)  # (B, K − 1 + T, C)
        xbc = self._conv(xp)
        gn = m.groups * m.state
        xs = xbc[..., : m.inner].reshape(bs, t, m.heads, m.head_dim).transpose(0, 2, 1, 3)
        rep = m.heads // m.groups  # heads per group: head h reads group h // rep
        b, c = (
            mx.repeat(y.reshape(bs, t, m.groups, m.state), rep, axis=2).transpose(0, 2, 1, 3)
            for y in (xbc[..., m.inner : m.inner + gn], xbc[..., m.inner + gn :])
        )  # (B, H, T, N) each
        xs, b, c = xs.astype(f32), b.astype(f32), c.astype(f32)
        dt = nn.softplus(dt.astype(f32) + self.dt_bias.astype(f32))
        # clipped in both forms (transformers clips its chunked scan only: alike for (0, ∞))
        dt = mx.clip(dt, *m.dt_limit).transpose(0, 2, 1)  # (B, H, T)
        a, d = -mx.exp(self.A_log.astype(f32)), self.D.astype(f32)
        state = cache.recurrent if cache is not None else None
        if state is None:
            state = mx.zeros((bs, m.heads, m.head_dim, m.state), f32)
        keep = cache.keep if isinstance(cache, RecurrentCache) else 0
        steps = []  # (offset, conv, state) after each token but the last, when `keep`
        if t == 1 or (keep and t <= keep + 1):  # a verification: token by token, as decoding
            outs = []
            for i in range(t):
                y, state = ssm_step(xs[:, :, i], dt[..., i], a, b[:, :, i], c[:, :, i], d, state)
                outs.append(y[:, :, None])
                if i < t - 1 and keep:
                    conv = mx.contiguous(xp[:, i + 1 : i + m.conv_kernel])  # its last K − 1
                    steps.append((cache.offset + i + 1, conv, state))
            y = outs[0] if t == 1 else mx.concatenate(outs, axis=2)
        else:
            y, state = ssm_chunked(xs, dt, a, b, c, d, state, m.chunk)
        if cache is not None:
            cache.conv_state = xp[:, -(m.conv_kernel - 1) :]
            cache.recurrent = state
            if isinstance(cache, RecurrentCache):
                cache.kept(steps)
            cache.offset += t
        y = y.transpose(0, 2, 1, 3).reshape(bs, t, m.inner)  # (B, T, inner)
        return self.out_proj(self.norm(y.astype(x.dtype), z))

    def _batch(self, x: mx.array, caches: list[RecurrentCache]) -> mx.array:
        """One token for each of B sequences (x: (B, 1, hidden)), each with its own state (T
        tokens each, a batched verification, or a fresh state: each row on its own)."""
        if x.shape[1] > 1 or any(c.recurrent is None for c in caches):
            return mx.concatenate([self(x[i : i + 1], c) for i, c in enumerate(caches)])
        both = RecurrentCache()
        both.conv_state = mx.concatenate([c.conv_state for c in caches])
        both.recurrent = mx.concatenate([c.recurrent for c in caches])
        out = self(x, both)
        for i, c in enumerate(caches):
            c.conv_state, c.recurrent = both.conv_state[i : i + 1], both.recurrent[i : i + 1]
            c.offset += 1
        return out


# the mixer's sizes, beside limits.SIZE_BOUNDS
BOUNDS = {
    "heads": limits.CONFIG_MAX_DIM,
    "head_dim": limits.CONFIG_MAX_DIM,
    "state": limits.CONFIG_MAX_DIM,
    "groups": limits.CONFIG_MAX_DIM,
    "conv_kernel": limits.CONFIG_MAX_DIM,
    "chunk": limits.CONFIG_MAX_CONTEXT,
}


def _limit(value: Any, key: str, path: str) -> float:
    """A number of a dt limit; transformers 5 saves infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
        value = float(value) if value in ("Infinity", "inf") else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"expected a number, got {value!r}"[:200], path=path, field=key)
    return float(value)


def checked(
    sizes: dict[str, tuple[str, Any]],
    eps: float,
    biases: tuple[bool, bool],
    dt_limit: tuple[Any, str],
    path: str,
) -> Mamba2Config:
    """The mixer from `sizes` (BOUNDS' names -> (key in the file, value)), each checked and
    errors naming the file's key; biases (conv, projections); dt_limit (value, its key)."""
    s = check_sizes(sizes, path, BOUNDS)
    if s["heads"] % s["groups"]:
        raise ConfigError(
            f"{s['groups']} groups do not divide {s['heads']} heads",
            path=path,
            field=sizes["groups"][0],
        )
    if s["conv_kernel"] < 2:  # a state of K − 1 inputs: none to carry
        raise ConfigError(
            "a kernel of 1 tap is not supported", path=path, field=sizes["conv_kernel"][0]
        )
    value, key = dt_limit
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"expected [low, high], got {value!r}"[:200], path=path, field=key)
    lo, hi = (_limit(v, key, path) for v in value)
    if not 0 <= lo <= hi:
        raise ConfigError(f"expected 0 ≤ low ≤ high, got {value!r}"[:200], path=path, field=key)
    return Mamba2Config(
        s["heads"],
        s["head_dim"],
        s["state"],
        s["groups"],
        s["conv_kernel"],
        s["chunk"],
        float(eps),
        bool(biases[0]),
        bool(biases[1]),
        (lo, hi),
    )


def from_gguf(m: GGUFMeta, eps: float, chunk: int) -> Mamba2Config:
    """llama.cpp's ssm.* keys (heads as time_step_rank, inner_size = heads · head_dim; no chunk
    size and no dt limit: llama.cpp's scan clips nothing) and the conv bias by its tensors."""
    heads, inner = m.get("ssm.time_step_rank"), m.get("ssm.inner_size")
    if not heads or inner % heads:
        raise ConfigError(
            f"inner size {inner} is not a multiple of {heads} heads",
            path=m.path,
            field=m.key("ssm.time_step_rank"),
        )
    sizes = {
        "heads": (m.key("ssm.time_step_rank"), heads),
        "head_dim": (m.key("ssm.inner_size"), inner // heads),
        "state": (m.key("ssm.state_size"), m.get("ssm.state_size")),
        "groups": (m.key("ssm.group_count"), m.get("ssm.group_count", 1)),
        "conv_kernel": (m.key("ssm.conv_kernel"), m.get("ssm.conv_kernel")),
        "chunk": ("chunk", chunk),
    }
    conv_bias = any(n.endswith("ssm_conv1d.bias") for n in m.shapes)
    proj_bias = any(n.endswith("ssm_in.bias") for n in m.shapes)
    return checked(sizes, eps, (conv_bias, proj_bias), ((0.0, math.inf), "dt_limit"), m.path)


def gguf_block(prefix: str) -> dict[str, str]:
    """llama.cpp's ssm_* tensor names -> ours under the mixer's module `prefix`."""
    return {
        "ssm_in": f"{prefix}.in_proj",
        "ssm_conv1d": f"{prefix}.conv1d",
        "ssm_dt.bias": f"{prefix}.dt_bias",
        "ssm_a.": f"{prefix}.A_log",
        "ssm_d.": f"{prefix}.D",
        "ssm_norm": f"{prefix}.norm",
        "ssm_out": f"{prefix}.out_proj",
    }


# llama.cpp's Mamba2Model stores A = −exp(A_log) as (H, 1): back to A_log (H,)
A_FROM_MINUS_EXP: Convention = (
    lambda name: name.endswith(".A_log"),
    lambda w, c, _: mx.log(-w.astype(mx.float32)).reshape(-1).astype(w.dtype),
)
# ... D as (H, 1), the gated norm's weight by group (G, inner / G): back to vectors (the
# reshape leaves the other, 1-D, norms as they are)
D_FLAT: Convention = (lambda name: name.endswith(".D"), lambda w, c, _: w.reshape(-1))
NORM_FLAT: Convention = (lambda name: name.endswith(".norm.weight"), lambda w, c, _: w.reshape(-1))
# ... and the conv kernel squeezed to (C, K): back to torch's (C, 1, K)
CONV_UNSQUEEZED: Convention = (
    lambda name: name.endswith("conv1d.weight"),
    lambda w, c, _: w.reshape(w.shape[0], 1, -1),
)
GGUF_CONVENTIONS = (A_FROM_MINUS_EXP, D_FLAT, NORM_FLAT, CONV_UNSQUEEZED)


def from_hf(
    cfg: dict, keys: dict[str, tuple[str, Any]], biases: tuple[str, str], eps: float, path: str
) -> Mamba2Config:
    """The mixer from config.json: `keys` maps BOUNDS' names to (the family's key, its
    default), `biases` names the conv and projection bias keys (defaults True, False); the dt
    limit is `time_step_limit` (default: none)."""
    sizes = {name: (key, cfg.get(key, default)) for name, (key, default) in keys.items()}
    flags = (cfg.get(biases[0], True), cfg.get(biases[1], False))
    for key, value in zip(biases, flags, strict=True):
        if not isinstance(value, bool):  # a string "false" must not read as true
            raise ConfigError(f"expected true or false, got {value!r}"[:200], path=path, field=key)
    limit = (cfg.get("time_step_limit", (0.0, math.inf)), "time_step_limit")
    return checked(sizes, eps, flags, limit, path)


def per_layer(m: GGUFMeta, key: str, n: int) -> list[int]:
    """A `{arch}.key` llama.cpp writes per layer (an array), or once for all n (0: absent)."""
    value = m.md.get(m.key(key), 0)
    return value.tolist() if isinstance(value, np.ndarray) else [value] * n


def gguf_attention(m: GGUFMeta, n: int) -> tuple[tuple[bool, ...], int]:
    """llama.cpp's per-layer head_count_kv of a hybrid: which layers attend (those stating KV
    heads, all of one count; the others 0) and that count (0: none)."""
    counts = per_layer(m, "attention.head_count_kv", n)
    if len(counts) != n or len({c for c in counts if c}) > 1:
        field = m.key("attention.head_count_kv")
        raise ConfigError(f"expected {n} counts, one nonzero value", path=m.path, field=field)
    return tuple(bool(c) for c in counts), max(counts)


# transformers' older layer names (its _LEGACY_LAYER_TYPE_REMAP)
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def layer_kinds(cfg: dict, keys: tuple[str, ...], kinds: tuple[str, ...], path: str) -> tuple:
    """The first of `keys` config.json has: a list of `kinds` (or their LEGACY names), as
    transformers reads it; None when it has none."""
    key = next((k for k in keys if cfg.get(k) is not None), None)
    if key is None:
        return None
    types = cfg[key]
    ok = isinstance(types, list) and types and all(isinstance(t, str) for t in types)
    if not ok or any(LEGACY.get(t, t) not in kinds for t in types):
        raise ConfigError(f"expected a list of {kinds}, got {types!r}"[:300], path=path, field=key)
    return tuple(LEGACY.get(t, t) for t in types)


def describe(m: Mamba2Config, layers: int) -> dict[str, Any]:
    """What `inspect` reports of the mixer in `layers` layers."""
    keys = ("heads", "head_dim", "state", "groups", "conv_kernel", "chunk")
    return {"layers": layers, **{k: getattr(m, k) for k in keys}, "state_bytes": m.state_bytes()}


def row(m: dict[str, Any], n: int) -> tuple[str, str]:
    """`describe`'s report as a text row, for a model of n layers."""
    return (
        "mamba2",
        f"Mamba-2 state space layers in {m['layers']} of {n}: {m['heads']} heads × "
        f"{m['head_dim']}, state {m['state']} in {m['groups']} group(s), conv of "
        f"{m['conv_kernel']}, prompts in chunks of {m['chunk']}; a state of "
        f"{m['state_bytes']} bytes each (conv inputs and S, float32)",
    )
