"""Qwen4-Exp's own pieces below the network (qwen4_exp_net.py): its structure (the config
fields ModelConfig does not have), the per-stream norm, and PLE — hashed n-gram embeddings
gated into every residual stream, with a dilated depthwise convolution over them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from mlxlis.cache import RecurrentCache
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

F32 = mx.float32


@dataclass(frozen=True)
class Qwen4ExpStructure(FamilyConfig):
    hc_count: int
    hc_lowrank: int
    ple_layers: tuple[int, ...]  # zero-indexed, ascending
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    split_ngram_parts: int
    seed: int
    eos_token_id: int  # the n-gram context's filler and separator
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    def head_sizes(self, index: int) -> list[int]:
        """The prime table size of each n-gram head of the `index`-th PLE layer: the primes
        from ngram_vocab_size_base on, numbered across the layers' heads in order."""
        first, every = index * self.ngram_heads, len(self.ple_layers) * self.ngram_heads
        return list(_primes(self.ngram_vocab_size_base, every)[first : first + self.ngram_heads])

    def table_rows(self, index: int) -> int:
        """The `index`-th PLE layer's table: every head's rows, padded to the divisor."""
        d = self.make_ngram_vocab_size_divisible_by
        return -(-sum(self.head_sizes(index)) // d) * d


@lru_cache(maxsize=8)
def _primes(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes ≥ `start` (once per model: trial division near 2·10⁷)."""
    out, p = [], start - 1
    while len(out) < count:
        p += 1
        if _is_prime(p):
            out.append(p)
    return tuple(out)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % k for k in range(3, math.isqrt(n) + 1, 2))


_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def hash_multipliers(vocab: int, n: int, index: int, seed: int) -> list[int]:
    """The odd multipliers of the `index`-th PLE layer's n-gram hash, one per position in the
    n-gram (transformers' _build_layer_multipliers; checkpoints carry them too, and theirs are
    what is used): small enough that id·multiplier stays below 2⁶³."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(n)]


class StreamNorm(nn.Module):
    """x̂·(1 + w) over each stream's `group` dims of (…, streams·group), in float32."""

    def __init__(self, dims: int, group: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.group, self.eps = group, eps

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(F32).reshape(*x.shape[:-1], -1, self.group)  # (…, streams, group)
        y = fused.rms_norm(y, None, self.eps).reshape(x.shape)
        return (y * (1.0 + self.weight.astype(F32))).astype(x.dtype)


class NGramEmbedding(nn.Module):
    """Each position's hashed 2..ngram_size-gram ids, heads_per_ngram tables each, embedded
    and concatenated: (B, T) ids -> (B, T, ple_embed_dim). Tokens before an EOS do not reach
    past it (the EOS id stands in for them), nor positions before the first."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, index: int):
        super().__init__()
        sizes = s.head_sizes(index)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.n, self.per, self.eos = s.ngram_size, s.heads_per_ngram, s.eos_token_id
        self.ngram_embedding = nn.Embedding(s.table_rows(index), s.ple_embed_dim // len(sizes))
        m = hash_multipliers(cfg.vocab_size, s.ngram_size, index, s.seed)
        self.layer_multipliers = mx.array(m, mx.int64)
        self.ngram_heads_vocab_sizes = mx.array(sizes, mx.int64)
        self.ngram_heads_offsets = mx.array(offsets, mx.int64)

    def rows(self, history: mx.array, t: int) -> mx.array:
        """history (B, n−1+T): the n−1 ids before the T new ones, then those -> each new
        position's table rows (B, T, heads)."""
        hist = history.astype(mx.int64)
        length = hist.shape[1]
        pos = mx.arange(length)
        eos_at = mx.where(hist == self.eos, pos, -1)
        before = mx.concatenate(
            [mx.full((hist.shape[0], 1), -1), mx.cummax(eos_at, axis=1)[:, :-1]], 1
        )
        since = pos - (before + 1)  # positions since the last EOS before each one
        eos = mx.array(self.eos, mx.int64)
        shifted = [hist]
        for k in range(1, self.n):  # the token k back, where the context reaches it
            back = mx.concatenate(
                [mx.full((hist.shape[0], k), self.eos, mx.int64), hist[:, :-k]], 1
            )
            shifted.append(mx.where(since >= k, back, eos))
        m, sizes, offs = (
            self.layer_multipliers,
            self.ngram_heads_vocab_sizes,
            self.ngram_heads_offsets,
        )
        blocks = []
        for g in range(2, self.n + 1):
            mixed = shifted[0] * m[0]
            for k in range(1, g):
                mixed = mx.bitwise_xor(mixed, shifted[k] * m[k])
            heads = slice((g - 2) * self.per, (g - 1) * self.per)
            blocks.append(mixed[..., None] % sizes[heads] + offs[heads])  # (B, n−1+T, per)
        return mx.concatenate(blocks, axis=-1)[:, -t:]

    def __call__(self, history: mx.array, t: int) -> mx.array:
        e = self.ngram_embedding(self.rows(history, t).astype(mx.uint32))  # (B, T, heads, dim)
        return e.reshape(*e.shape[:2], -1)


class PLE(nn.Module):
    """Per-layer n-gram embeddings into every stream (transformers' Qwen4ExpTextPLELayer):
    value v = W_v·e shared, a key per stream k_s = norm(W_k·e)_s against the stream's normed
    state q_s; gate g_s = signed √|k_s·q_s / √d|; out_s = sigmoid(g_s)·v, plus SiLU of a
    causal depthwise convolution (kernel ple_conv_kernel_size, dilation ngram_size) over the
    normed outs. Its cache (a RecurrentCache): the convolution's last (kernel−1)·dilation
    inputs as `conv_state`, the last n−1 ids as `recurrent`."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, index: int):
        super().__init__()
        n, d, e = s.hc_count, cfg.hidden_size, s.ple_embed_dim
        self.n, self.d, self.context = n, d, s.ngram_size - 1
        self.eos = s.eos_token_id
        self.ple_embedding = NGramEmbedding(cfg, s, index)
        self.key_proj = nn.Linear(e, n * d, bias=False)
        self.value_proj = nn.Linear(e, d, bias=False)
        self.norm_key = StreamNorm(n * d, d, cfg.norms.eps)
        self.norm_query = StreamNorm(n * d, d, cfg.norms.eps)
        self.norm_conv = StreamNorm(n * d, d, cfg.norms.eps)
        self.kernel, self.dilation = s.ple_conv_kernel_size, s.ngram_size
        self.span = (self.kernel - 1) * self.dilation
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((n * d, 1, self.kernel))  # HF (C, 1, kernel)

    def __call__(self, h: mx.array, ids: mx.array, cache: RecurrentCache | None) -> mx.array:
        b, t, _ = h.shape
        ctx = cache.recurrent if cache is not None else None
        if ctx is None:
            ctx = mx.full((b, self.context), self.eos, mx.int64)
        history = mx.concatenate([ctx, ids.astype(mx.int64)], axis=1)  # (B, n−1+T)
        emb = self.ple_embedding(history, t)  # (B, T, ple_embed_dim)
        key = self.norm_key(self.key_proj(emb)).reshape(b, t, self.n, self.d)
        query = self.norm_query(h).reshape(b, t, self.n, self.d)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.d)  # (B, T, n, 1)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate) * self.value_proj(emb)[:, :, None, :]).reshape(b, t, -1)
        xp = self._conv_input(self.norm_conv(gated), cache)  # (B, span + T, n·d)
        w = self.conv1d.weight[:, 0, :].astype(xp.dtype)  # (C, kernel)
        y = sum(
            xp[:, j * self.dilation : j * self.dilation + t] * w[:, j] for j in range(self.kernel)
        )
        if cache is not None:
            steps = []  # a verification's states after each token but the last
            if cache.keep:
                for i in range(t - 1):
                    conv = mx.contiguous(xp[:, i + 1 : i + 1 + self.span])
                    steps.append(
                        (cache.offset + i + 1, conv, history[:, i + 1 : i + 1 + self.context])
                    )
            cache.conv_state = xp[:, -self.span :]
            cache.recurrent = history[:, -self.context :]
            cache.kept(steps)
            cache.offset += t
        return gated + nn.silu(y)

    def _conv_input(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        before = cache.conv_state if cache is not None else None
        if before is None:
            before = mx.zeros((x.shape[0], self.span, x.shape[2]), x.dtype)
        return mx.concatenate([before.astype(x.dtype), x], axis=1)
