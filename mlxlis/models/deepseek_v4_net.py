"""DeepSeek V4's attention and experts (deepseek_v4.py's blocks): shared-KV attention over a
sliding window plus compressed entries, its compressors and lightning indexer, and the
hash- or score-routed experts. Names are the checkpoints' (DeepSeek's own, as transformers'
save_pretrained writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxlis.cache import CacheBatch, JointCache, KVCache, window_mask
from mlxlis.cache.compressed import EntryCache
from mlxlis.loading.binding import Float32Parameters
from mlxlis.models.config import FamilyConfig, ModelConfig, RopeConfig
from mlxlis.models.deepseek_v32 import top_keys
from mlxlis.models.experts import SwitchGLU
from mlxlis.models.hyper_connections import combine, mixes
from mlxlis.models.layers import Cache
from mlxlis.models.rope import yarn_inv_freq

import mlx.core as mx
import mlx.nn as nn

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True)
class V4Dims:
    """The sizes and options the blocks read (deepseek_v4.py's config holds one)."""

    head_dim: int
    rope_dims: int  # the trailing dims of each head that RoPE turns
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rates: tuple[tuple[str, int], ...]  # (layer type, compression rate)
    index_heads: int
    index_head_dim: int
    index_topk: int
    swiglu_limit: float
    routed_scaling_factor: float
    eps: float

    def rate(self, kind: str) -> int:
        return dict(self.rates)[kind]


def rope_tail(x: mx.array, pos: mx.array, inv_freq: mx.array, sign: float = 1.0) -> mx.array:
    """Interleaved RoPE on the trailing 2·len(inv_freq) dims of x (..., T, D) at positions pos
    (T,); sign -1 turns back (the conjugate rotation)."""
    r = 2 * inv_freq.shape[0]
    angles = pos.astype(mx.float32)[:, None] * inv_freq  # (T, r/2)
    cos, sin = mx.cos(angles), sign * mx.sin(angles)
    nope, rope = x[..., :-r], x[..., -r:].astype(mx.float32)
    pairs = rope.reshape(*rope.shape[:-1], r // 2, 2)  # (..., T, r/2, 2): (even, odd)
    a, b = pairs[..., 0], pairs[..., 1]
    turned = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rope.shape)
    return mx.concatenate([nope, turned.astype(x.dtype)], axis=-1)


def _windows(x: mx.array, w0: int, w1: int, m: int) -> mx.array:
    """Positions [w0·m, w1·m) of x (B, L, c) as windows (B, w1 - w0, m, c)."""
    return x[:, w0 * m : w1 * m].reshape(x.shape[0], w1 - w0, m, x.shape[-1])


class Compressor(nn.Module, Float32Parameters):
    """One entry per closed window of `rate` positions: a softmax-gated sum (per channel, over
    the window's slots, gate + the slot's learnt bias `ape`) of the projected wkv, RMSNormed,
    RoPE at the window's first position. `overlap` (CSA): 2·dims channels per position; an
    entry mixes the previous window's first half with its own window's second half (2·rate
    slots; the first window's previous half empty)."""

    float32 = ("ape",)

    def __init__(self, hidden: int, dims: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * dims if overlap else dims
        self.dims, self.rate, self.overlap = dims, rate, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = mx.zeros((rate, width))
        self.norm = nn.RMSNorm(dims, eps=eps)

    def __call__(
        self, x: mx.array, raw: KVCache | None, entries: EntryCache | None, inv_freq: mx.array
    ) -> mx.array:
        """x (B, T, hidden), the raw projections' and entries' caches -> every entry closed so
        far (B, windows, dims)."""
        b, t, _ = x.shape
        kv, gate = self.wkv(x), self.wgate(x)  # (B, T, width)
        start = raw.offset if raw is not None else 0
        if raw is not None:  # the raw projections of every position (open windows reread)
            k, g = raw.update_and_fetch(kv[:, None], gate[:, None])
            kv, gate = k[:, 0], g[:, 0]
        m = self.rate
        w0, w1 = start // m, (start + t) // m
        new = (
            self.compress(kv, gate, w0, w1, inv_freq)
            if w1 > w0
            else mx.zeros((b, 0, self.dims), x.dtype)
        )
        return new if entries is None else entries.append(new, t)

    def compress(
        self, kv: mx.array, gate: mx.array, w0: int, w1: int, inv_freq: mx.array
    ) -> mx.array:
        """The entries of windows [w0, w1) from the raw projections kv, gate (B, L, width) of
        positions from 0 -> (B, w1 - w0, dims)."""
        m, d = self.rate, self.dims
        cur_kv = _windows(kv, w0, w1, m)
        cur_g = _windows(gate, w0, w1, m) + self.ape  # (B, n, m, width)
        if self.overlap:
            b = kv.shape[0]
            pad = mx.zeros((b, m, kv.shape[-1]), kv.dtype)  # the first window's previous half
            prev_kv = _windows(mx.concatenate([pad, kv], axis=1), w0, w1, m)
            prev_g = _windows(mx.concatenate([pad - mx.inf, gate], axis=1), w0, w1, m) + self.ape
            cur_kv = mx.concatenate([prev_kv[..., :d], cur_kv[..., d:]], axis=2)  # (B, n, 2m, d)
            cur_g = mx.concatenate([prev_g[..., :d], cur_g[..., d:]], axis=2)
        weights = mx.softmax(cur_g.astype(mx.float32), axis=2).astype(kv.dtype)
        entries = self.norm((cur_kv * weights).sum(axis=2))  # (B, n, dims)
        return rope_tail(entries, mx.arange(w0, w1) * m, inv_freq)


class Indexer(nn.Module, Float32Parameters):
    """The lightning indexer over its own compressed entries (CSA): a key's score for a query
    is Σ_h w_h · relu(q_h·k) / √head_dim, w = weights_proj(x) / √heads; each query keeps its
    topk best entries closed before it (ties: the earlier entries)."""

    def __init__(self, cfg: ModelConfig, d: V4Dims):
        super().__init__()
        self.d = d
        self.wq_b = nn.Linear(d.q_lora_rank, d.index_heads * d.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, d.index_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, d.index_head_dim, d.rate(CSA), True, d.eps)

    def __call__(self, x, q_res, pos, caches, inv_freq) -> mx.array:
        """-> the entries each query attends (B, 1, T, windows) bool."""
        b, t, _ = x.shape
        n, hd = self.d.index_heads, self.d.index_head_dim
        keys = self.compressor(x, *caches, inv_freq)  # (B, W, hd)
        q = self.wq_b(q_res).reshape(b, t, n, hd).transpose(0, 2, 1, 3)  # (B, n, T, hd)
        q = rope_tail(q, pos, inv_freq)
        f32 = mx.float32
        scores = mx.maximum(q.astype(f32) @ keys.astype(f32)[:, None].swapaxes(-1, -2), 0)
        w = self.weights_proj(x).astype(f32) * n**-0.5  # (B, T, n)
        index = (w.transpose(0, 2, 1)[..., None] * scores).sum(axis=1) * hd**-0.5  # (B, T, W)
        closed = mx.arange(keys.shape[1])[None] < ((pos + 1) // self.d.rate(CSA))[:, None]  # (T, W)
        index = mx.where(closed, index, -mx.inf)
        return (top_keys(index, self.d.index_topk) & closed)[:, None]


class V4Attention(nn.Module, Float32Parameters):
    """Shared-KV attention (one normalised wkv head read as keys and values) over the last
    `window` positions and, in CSA / HCA layers, the compressed entries (HCA: every closed
    one; CSA: those the indexer picks); a learnt sink per head in the softmax; the output's
    RoPE dims turned back to the query's position; a grouped low-rank output (wo_a per group
    of heads, then wo_b)."""

    float32 = ("attn_sink",)

    def __init__(self, cfg: ModelConfig, d: V4Dims, kind: str):
        super().__init__()
        h, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.d, self.kind, self.n_heads = d, kind, h
        self.wq_a = nn.Linear(hidden, d.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(d.q_lora_rank, eps=d.eps)
        self.wq_b = nn.Linear(d.q_lora_rank, h * d.head_dim, bias=False)
        self.wkv = nn.Linear(hidden, d.head_dim, bias=False)
        self.norm = nn.RMSNorm(d.head_dim, eps=d.eps)
        self.wo_a = nn.Linear(h * d.head_dim // d.o_groups, d.o_groups * d.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(d.o_groups * d.o_lora_rank, hidden, bias=False)
        self.attn_sink = mx.zeros((h,))
        if kind != SLIDING:
            self.compressor = Compressor(hidden, d.head_dim, d.rate(kind), kind == CSA, d.eps)
        if kind == CSA:
            self.indexer = Indexer(cfg, d)

    def __call__(self, x: mx.array, cache, inv_freq: mx.array) -> mx.array:
        if isinstance(cache, CacheBatch):  # each sequence on its own caches
            return mx.concatenate(
                [self(x[i : i + 1], c, inv_freq) for i, c in enumerate(cache.caches)]
            )
        b, t, _ = x.shape
        d, h = self.d, self.n_heads
        parts = cache.parts if isinstance(cache, JointCache) else (None,) * 5
        ring = parts[0]
        start = ring.offset if ring is not None else 0
        pos = start + mx.arange(t)
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).reshape(b, t, h, d.head_dim).transpose(0, 2, 1, 3)  # (B, H, T, D)
        q = q * mx.rsqrt(mx.square(q).mean(axis=-1, keepdims=True) + d.eps)  # no weight
        q = rope_tail(q, pos, inv_freq)
        kv = rope_tail(self.norm(self.wkv(x))[:, None], pos, inv_freq)  # (B, 1, T, D)
        if ring is None:
            mask = window_mask(0, t, 0, t, d.window)  # (T, T)
        else:  # the ring's mask is read before its update; K = V: no values kept
            mask = ring.mask(t)  # (T, held + T), None: one query sees every held key
            kv, _ = ring.update_and_fetch(kv, mx.zeros((b, 1, t, 0), kv.dtype))
        if mask is None:
            mask = mx.ones((t, kv.shape[2]), mx.bool_)
        mask = mx.broadcast_to(mask, (b, 1, t, kv.shape[2]))
        if self.kind != SLIDING:
            entries = self.compressor(x, parts[1], parts[2], inv_freq)  # (B, W, D)
            if self.kind == CSA:
                chosen = self.indexer(x, q_res, pos, parts[3:5], inv_freq)  # (B, 1, T, W)
            else:
                closed = mx.arange(entries.shape[1])[None] < ((pos + 1) // d.rate(HCA))[:, None]
                chosen = mx.broadcast_to(closed, (b, 1, t, entries.shape[1]))
            kv = mx.concatenate([kv, entries[:, None].astype(kv.dtype)], axis=2)
            mask = mx.concatenate([mask, chosen], axis=-1)
        scores = (q * d.head_dim**-0.5) @ kv.swapaxes(-1, -2)  # (B, H, T, S)
        scores = mx.where(mask, scores, -mx.inf).astype(mx.float32)
        sink = mx.broadcast_to(self.attn_sink.astype(mx.float32)[None, :, None, None], (b, h, t, 1))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        out = probs.astype(kv.dtype) @ kv  # (B, H, T, D)
        out = rope_tail(out, pos, inv_freq, -1.0)
        g = d.o_groups
        out = out.transpose(0, 2, 1, 3).reshape(b, t, g, -1)  # (B, T, G, H·D / G)
        w = self.wo_a.weight.reshape(g, d.o_lora_rank, -1)  # (G, R, H·D / G)
        y = (out[..., None, :] @ w.swapaxes(-1, -2))[..., 0, :]  # (B, T, G, R)
        return self.wo_b(y.reshape(b, t, -1))


def clamped_silu(limit: float):
    """silu(min(gate, limit)) · clip(up, ±limit): V4's experts and shared expert."""

    def act(gate: mx.array, up: mx.array) -> mx.array:
        return nn.silu(mx.minimum(gate, limit)) * mx.clip(up, -limit, limit)

    return act


class SharedExpert(nn.Module):
    """w2(act(w1(x)) · w3(x))."""

    def __init__(self, hidden: int, width: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)
        self.w2 = nn.Linear(width, hidden, bias=False)
        self.w3 = nn.Linear(hidden, width, bias=False)
        self.act = clamped_silu(limit)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class V4Gate(nn.Module, Float32Parameters):
    """sqrt(softplus(x·Wᵀ)) scores in float32; the experts by the token's row of the frozen
    table tid2eid (hash layers) or the top k of score + bias (the bias sways the choice, not
    the weights); the chosen scores renormalised, times routed_scaling_factor."""

    float32 = ("weight", "bias")

    def __init__(self, cfg: ModelConfig, hashed: bool, scale: float):
        super().__init__()
        moe = cfg.moe
        self.weight = mx.zeros((moe.num_experts, cfg.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((cfg.vocab_size, moe.num_experts_per_tok), mx.int64)
        else:
            self.bias = mx.zeros((moe.num_experts,))
        self.k, self.scale = moe.num_experts_per_tok, scale

    def __call__(self, x: mx.array, ids: mx.array) -> tuple[mx.array, mx.array]:
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # (B, T, E)
        scores = mx.sqrt(mx.logaddexp(logits, 0.0))  # sqrt(softplus)
        if "tid2eid" in self:
            inds = self.tid2eid[ids].astype(mx.int32)  # (B, T, k)
        else:
            choice = scores + self.bias.astype(mx.float32)
            inds = mx.argpartition(-choice, kth=self.k - 1, axis=-1)[..., : self.k]
        w = mx.take_along_axis(scores, inds, axis=-1)
        return inds, w / (w.sum(axis=-1, keepdims=True) + 1e-20) * self.scale


class V4MoE(nn.Module):
    """The routed experts (stacked under switch_mlp: w1 gate, w3 up, w2 down) plus the shared
    expert."""

    def __init__(self, cfg: ModelConfig, d: V4Dims, hashed: bool):
        super().__init__()
        self.gate = V4Gate(cfg, hashed, d.routed_scaling_factor)
        self.switch_mlp = SwitchGLU(cfg, act=clamped_silu(d.swiglu_limit))
        self.shared_experts = SharedExpert(
            cfg.hidden_size, cfg.moe.intermediate_size, d.swiglu_limit
        )

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        inds, weights = self.gate(x, ids)
        y = self.switch_mlp(x, inds)  # (B, T, k, hidden)
        y = (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)
        return y + self.shared_experts(x)


@dataclass(frozen=True)
class DeepseekV4Config(FamilyConfig):
    dims: V4Dims
    kinds: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    hashed: tuple[bool, ...]  # per layer: routed by the token table
    hc_mult: int
    hc_iters: int
    hc_eps: float
    compress_rope: RopeConfig


def _inv_freq(rope: RopeConfig, dims: int) -> mx.array:
    if rope.type == "yarn":
        return yarn_inv_freq(rope, dims)
    return 1.0 / rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


class DeepseekV4Layer(nn.Module, Float32Parameters):
    """attn and ffn, each between a hyper-connection's collapse and spread."""

    float32 = tuple(f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale"))

    def __init__(self, cfg: ModelConfig, rope: Any, layer: int):
        super().__init__()
        own = cfg.own(DeepseekV4Config)
        n, d = own.hc_mult, cfg.hidden_size
        self.own, self.kind = own, own.kinds[layer]
        self.attn = V4Attention(cfg, own.dims, self.kind)
        self.ffn = V4MoE(cfg, own.dims, own.hashed[layer])
        self.attn_norm = nn.RMSNorm(d, eps=cfg.norms.eps)
        self.ffn_norm = nn.RMSNorm(d, eps=cfg.norms.eps)
        for s in ("attn", "ffn"):
            setattr(self, f"hc_{s}_fn", mx.zeros(((2 + n) * n, n * d)))
            setattr(self, f"hc_{s}_base", mx.zeros(((2 + n) * n,)))
            setattr(self, f"hc_{s}_scale", mx.zeros((3,)))
        rope_d = own.dims.rope_dims
        main = cfg.rope if self.kind == SLIDING else own.compress_rope
        self._inv_freq = _inv_freq(main, rope_d)

    def _mix(self, s: str, h: mx.array):
        own = self.own
        w = (self[f"hc_{s}_fn"], self[f"hc_{s}_base"], self[f"hc_{s}_scale"])
        return mixes(h, *w, own.hc_iters, own.hc_eps, own.dims.eps)

    def __call__(self, h: mx.array, ids: mx.array, cache: Cache | None) -> mx.array:
        post, comb, x = self._mix("attn", h)
        h = combine(post, comb, self.attn(self.attn_norm(x), cache, self._inv_freq), h)
        post, comb, x = self._mix("ffn", h)
        return combine(post, comb, self.ffn(self.ffn_norm(x), ids), h)


class HyperHead(nn.Module, Float32Parameters):
    float32 = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, n: int, d: int):
        super().__init__()
        self.hc_fn, self.hc_base, self.hc_scale = (
            mx.zeros((n, n * d)),
            mx.zeros((n,)),
            mx.zeros((1,)),
        )
