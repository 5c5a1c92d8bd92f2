"""Gated DeltaNet, the linear-attention mixer of Qwen3.5's hybrid layers.

Per token t and value head h, with L2-normalised q_t, k_t (k_dim) and v_t (v_dim), a decay
g_t = −exp(A_log)·softplus(a_t + dt_bias) ≤ 0 and a write strength β_t = sigmoid(b_t), the
state S (k_dim × v_dim) evolves by the gated delta rule

    S ← exp(g_t)·S;   S ← S + k_t ⊗ β_t·(v_t − Sᵀk_t);   o_t = Sᵀ(q_t / √k_dim)

Decoding runs that one step; a prompt runs the chunked form (chunks of CHUNK tokens, one
triangular solve per chunk for the within-chunk updates, a scan over chunks for the state),
which equals the step form up to rounding. Before the rule: one projection to q|k|v, a short
causal depthwise convolution over it (its last kernel−1 inputs are state too) and SiLU; after:
an RMSNorm of each head's output gated by SiLU(z), then the output projection.
Parameter names equal the Hugging Face names (`linear_attn.in_proj_qkv`, `conv1d`, `A_log`, ...).
Qwen3-Next fuses the projections per key head (cfg.deltanet.fused): in_proj_qkvz holds, for each
key head, its q, its k, then its value heads' v and z; in_proj_ba its value heads' β then α.
"""

from __future__ import annotations

from mlxlis.cache import CacheBatch, RecurrentCache
from mlxlis.models.config import ModelConfig
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)
L2_EPS = 1e-6  # the L2 normalisation of q and k (transformers' l2norm, FLA)


def l2norm(x: mx.array) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


@mx.compile  # one fused kernel per decode step (about 10 small ops otherwise)
def delta_step(q, k, v, g, beta, state):
    """One token. q, k: (B, H, Dk) (q already scaled); v: (B, H, Dv); g, beta: (B, H);
    state: (B, H, Dk, Dv). Returns (o (B, H, Dv), new state)."""
    state = state * mx.exp(g)[..., None, None]
    kv = (state * k[..., None]).sum(axis=-2)  # Sᵀk: (B, H, Dv)
    delta = (v - kv) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(axis=-2), state


def delta_chunked(q, k, v, g, beta, state):
    """T tokens at once. q, k: (B, H, T, Dk) (q already scaled); v: (B, H, T, Dv);
    g, beta: (B, H, T); state: (B, H, Dk, Dv). Returns (o (B, H, T, Dv), new state)."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    if pad:  # zero k, v, β and g past the end: the padded steps change nothing
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
    n = (t + pad) // CHUNK
    q, k, v = (x.reshape(b, h, n, CHUNK, -1) for x in (q, k, v))  # (B, H, N, C, D)
    g, beta = g.reshape(b, h, n, CHUNK), beta.reshape(b, h, n, CHUNK)
    cum = mx.cumsum(g, axis=-1)  # log of the decay from the chunk start to each position
    lower = mx.tril(mx.ones((CHUNK, CHUNK), dtype=mx.bool_))
    # decay between positions j ≤ i of a chunk; exp only where j ≤ i (no overflow above)
    diff = mx.where(lower, cum[..., :, None] - cum[..., None, :], -mx.inf)
    pair = mx.exp(diff)  # (B, H, N, C, C)
    k_beta = k * beta[..., None]
    # the within-chunk delta updates as one unit lower-triangular system A x = rhs
    a = mx.where(mx.tril(lower, -1), (k_beta @ k.swapaxes(-1, -2)) * pair, 0.0)
    a = a + mx.eye(CHUNK, dtype=a.dtype)
    rhs = mx.concatenate([v * beta[..., None], k_beta * mx.exp(cum)[..., None]], axis=-1)
    sol = mx.linalg.solve_triangular(a, rhs, upper=False, stream=mx.cpu)
    u, w = sol[..., :dv], sol[..., dv:]  # new values; decayed keys reading the old state
    attn = (q @ k.swapaxes(-1, -2)) * pair  # within-chunk readout, causal
    q_dec = q * mx.exp(cum)[..., None]  # reads the state as of the chunk start
    k_dec = k * mx.exp(cum[..., -1:] - cum)[..., None]  # decayed to the chunk end
    last = mx.exp(cum[..., -1])[..., None, None]  # (B, H, N, 1, 1)
    outs = []
    for i in range(n):  # the scan over chunks
        v_new = u[:, :, i] - w[:, :, i] @ state  # (B, H, C, Dv)
        outs.append(q_dec[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * last[:, :, i] + k_dec[:, :, i].swapaxes(-1, -2) @ v_new
    o = mx.concatenate(outs, axis=2)[:, :, :t]
    return o, state


GATE_ACTS = {"silu": nn.silu, "sigmoid": mx.sigmoid}  # the output gate's (cfg.deltanet.gate_act)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x)·w · act(z), in float32, act SiLU (transformers' Qwen3_5RMSNormGated) or a
    sigmoid (Qwen4-Exp's output_gate_type)."""

    def __init__(self, dims: int, eps: float, act: str = "silu"):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))
        self._act = GATE_ACTS[act]

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        y = fused.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return (y * self._act(z.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        net = cfg.deltanet
        self.hk, self.hv = net.num_key_heads, net.num_value_heads
        self.dk, self.dv = net.key_head_dim, net.value_head_dim
        self.kernel = net.conv_kernel_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.fused = net.fused
        if "qkvz" in self.fused:
            self.in_proj_qkvz = nn.Linear(d, self.conv_dim + value_dim, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(d, value_dim, bias=False)
        if "ba" in self.fused:
            self.in_proj_ba = nn.Linear(d, 2 * self.hv, bias=False)
        else:
            self.in_proj_b = nn.Linear(d, self.hv, bias=False)
            self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((self.conv_dim, 1, self.kernel))  # HF (C, 1, kernel)
        self.dt_bias = mx.ones((self.hv,))
        self.A_log = mx.zeros((self.hv,))
        self.norm = GatedRMSNorm(self.dv, cfg.norms.eps, net.gate_act)
        self.out_proj = nn.Linear(value_dim, d, bias=False)

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x (B, T, hidden) -> qkv (B, T, 2·key_dim + value_dim) as [q | k | v], z (B, T, Hv,
        Dv), b and a (B, T, Hv); value heads grouped by key head (head g·r + j, r = Hv / Hk)."""
        b, t, _ = x.shape
        r = self.hv // self.hk
        if "qkvz" in self.fused:
            m = self.in_proj_qkvz(x).reshape(b, t, self.hk, -1)  # per key head: q, k, v, z
            dk, rv = self.dk, r * self.dv
            q, k, v, z = mx.split(m, [dk, 2 * dk, 2 * dk + rv], axis=-1)
            qkv = mx.concatenate([y.reshape(b, t, -1) for y in (q, k, v)], axis=-1)
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        if "ba" in self.fused:
            ba = self.in_proj_ba(x).reshape(b, t, self.hk, 2 * r)  # per key head: β, then α
            beta, a = ba[..., :r].reshape(b, t, -1), ba[..., r:].reshape(b, t, -1)
        else:
            beta, a = self.in_proj_b(x), self.in_proj_a(x)
        return qkv, z.reshape(b, t, self.hv, self.dv), beta, a

    def _conv_input(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        """The convolution's input: the cached last kernel−1 inputs, then x (B, T, C): (B,
        kernel−1+T, C); the cache keeps its newest kernel−1."""
        before = cache.conv_state if cache is not None else None
        if before is None:
            before = mx.zeros((x.shape[0], self.kernel - 1, x.shape[2]), x.dtype)
        xp = mx.concatenate([before.astype(x.dtype), x], axis=1)
        if cache is not None:
            cache.conv_state = xp[:, -(self.kernel - 1) :]
        return xp

    def _conv(self, xp: mx.array) -> mx.array:
        """Causal depthwise convolution + SiLU. xp: (B, kernel−1+T, C) -> (B, T, C)."""
        t = xp.shape[1] - (self.kernel - 1)
        w = self.conv1d.weight[:, 0, :].astype(xp.dtype)  # (C, kernel)
        y = sum(xp[:, j : j + t] * w[:, j] for j in range(self.kernel))
        return nn.silu(y)

    def __call__(self, x: mx.array, mask, cache: RecurrentCache | CacheBatch | None) -> mx.array:
        if isinstance(cache, CacheBatch):  # sequences decoding together: their states stacked
            return self._batch(x, cache.caches)
        b, t, _ = x.shape
        qkv, z, beta_in, a_in = self._project(x)
        xp = self._conv_input(qkv, cache)  # (B, kernel − 1 + T, C)
        qkv = self._conv(xp)  # (B, T, 2·key_dim + value_dim)
        kd = self.hk * self.dk
        q = qkv[..., :kd].reshape(b, t, self.hk, self.dk)
        k = qkv[..., kd : 2 * kd].reshape(b, t, self.hk, self.dk)
        v = qkv[..., 2 * kd :].reshape(b, t, self.hv, self.dv)
        if self.hv != self.hk:  # each q/k head serves hv / hk consecutive value heads
            q, k = (mx.repeat(y, self.hv // self.hk, axis=2) for y in (q, k))
        f32 = mx.float32
        # (B, H, T, D) in float32, q and k L2-normalised, q scaled by 1/√Dk
        q = l2norm(q.astype(f32)).transpose(0, 2, 1, 3) * (self.dk**-0.5)
        k = l2norm(k.astype(f32)).transpose(0, 2, 1, 3)
        v = v.astype(f32).transpose(0, 2, 1, 3)
        beta = mx.sigmoid(beta_in.astype(f32)).transpose(0, 2, 1)  # (B, H, T)
        a = a_in.astype(f32) + self.dt_bias.astype(f32)
        g = (-mx.exp(self.A_log.astype(f32)) * nn.softplus(a)).transpose(0, 2, 1)
        state = cache.recurrent if cache is not None else None
        if state is None:
            state = mx.zeros((b, self.hv, self.dk, self.dv), f32)
        keep = cache.keep if isinstance(cache, RecurrentCache) else 0
        steps = []  # (offset, conv, state) after each token but the last, when `keep`
        if t == 1 or (keep and t <= keep + 1):  # a verification: token by token, as decoding
            outs = []
            for i in range(t):
                o, state = delta_step(
                    q[:, :, i], k[:, :, i], v[:, :, i], g[..., i], beta[..., i], state
                )
                outs.append(o[:, :, None])
                if i < t - 1 and keep:
                    conv = mx.contiguous(xp[:, i + 1 : i + self.kernel])  # its last kernel−1
                    steps.append((cache.offset + i + 1, conv, state))
            o = outs[0] if t == 1 else mx.concatenate(outs, axis=2)
        else:
            o, state = delta_chunked(q, k, v, g, beta, state)
        if cache is not None:
            cache.recurrent = state
            if isinstance(cache, RecurrentCache):
                cache.kept(steps)
            cache.offset += t
        o = o.transpose(0, 2, 1, 3)  # (B, T, Hv, Dv)
        o = self.norm(o.astype(x.dtype), z).reshape(b, t, -1)
        return self.out_proj(o)

    def _batch(self, x: mx.array, caches: list[RecurrentCache]) -> mx.array:
        """One token for each of B sequences (x: (B, 1, hidden)), each with its own state (T
        tokens each, a batched verification: each row on its own)."""
        if x.shape[1] > 1 or any(c.recurrent is None for c in caches):
            return mx.concatenate([self(x[i : i + 1], None, c) for i, c in enumerate(caches)])
        both = RecurrentCache()
        both.conv_state = mx.concatenate([c.conv_state for c in caches])
        both.recurrent = mx.concatenate([c.recurrent for c in caches])
        out = self(x, None, both)
        for i, c in enumerate(caches):
            c.conv_state, c.recurrent = both.conv_state[i : i + 1], both.recurrent[i : i + 1]
            c.offset += 1
        return out
