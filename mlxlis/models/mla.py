"""Multi-head latent attention (DeepSeek V2 / V3 / V3.2, Kimi K2): every head's keys and
values come from one shared latent per position, so the cache holds that latent, never the
expanded keys and values.

Per position x: a query (q_proj, or the low-rank q_a_proj → q_a_layernorm → q_b_proj) of
n_heads × (nope + rope) dims; kv_a_proj_with_mqa gives the latent c (kv_lora_rank, then
kv_a_layernorm) and one rope key k_pe (rope dims, shared by the heads). transformers expands
kv_b_proj(c) into each head's key nope part (W_uk c) and value (W_uv c); here the
up-projections are absorbed instead, as the algebra allows:
  q_nope · (W_uk c) = (W_ukᵀ q_nope) · c      the query moved into latent space (embed_q)
  Σ p · (W_uv c)   = W_uv (Σ p · c)           the output taken out of it (unembed_out)
so a score is (W_ukᵀ q_nope)·c + q_pe·k_pe and the attention output a mix of latents.

Prefill absorbs too (one path): it reads the cache as stored — quantized, with a dense tail,
or as a batch's stacked rows — with no (positions × n_heads × (nope + v)) expansion per
layer; the price is (kv_lora_rank + rope) per score instead of (nope + rope).

The cache is the shared KVCache with the latent as its "keys" (B, 1, S, kv_lora_rank) and the
rope key as its "values" (B, 1, S, rope): batching, the prefix and disk caches, rewinds and KV
quantization (each along its last axis) treat them as one KV head's keys and values.

The up-projections are held as the file holds them: transformers' kv_b_proj (n_heads·(nope +
v), kv_lora_rank), whose rows per head are W_uk then W_uv (sliced at each use, in its packed
form when quantized: its groups run along kv_lora_rank), or two per-head stacks (`split`:
mlx-lm's sanitized layout and llama.cpp's k_b / v_b) embed_q (n_heads, kv_lora_rank, nope) =
W_ukᵀ and unembed_out (n_heads, v, kv_lora_rank) = W_uv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.cache import CacheBatch, KVBatch, KVCache, KVFormat, window_mask
from mlxlis.cache.store import Stored, Tailed
from mlxlis.errors import ConfigError, MlxlisError
from mlxlis.loading.safetensors import read_header, weight_files
from mlxlis.models.attention import product
from mlxlis.models.config import ModelConfig, RopeConfig, yarn_keys, yarn_mscale
from mlxlis.models.layers import Cache, Mask, RMSNorm
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm eps, whatever rms_norm_eps says


@dataclass(frozen=True)
class LatentDims:
    """MLA's sizes and its softmax scale."""

    q_lora_rank: int | None  # None: one full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # 1/√(nope + rope), times yarn's mscale(factor, mscale_all_dim)²
    split: bool = False  # embed_q / unembed_out, not kv_b_proj
    mscale_all_dim: float = 0.0  # yarn's, as the config states it (what `scale` came from)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_bytes(self, heads: int, itemsize: int) -> tuple[int, int]:
        """Cache bytes per position and layer: (the latent and rope key held, the expanded
        keys and values of every head that transformers' attention reads)."""
        latent = (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize
        return latent, heads * (self.qk_head_dim + self.v_head_dim) * itemsize


class MultiLinear(nn.Module):
    """One matrix per head: weight (n_heads, out, in); x (..., n_heads, T, in) ->
    x @ wᵀ (n_heads, T, out), or x @ w with `transpose` False (x's last axis `out`)."""

    def __init__(self, in_dims: int, out_dims: int, heads: int):
        super().__init__()
        self.weight = mx.zeros((heads, out_dims, in_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        w = self.weight
        return x @ (w.swapaxes(-1, -2) if transpose else w)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        return QuantizedMultiLinear(self.weight, group_size, bits, mode)


class QuantizedMultiLinear(nn.Module):
    """MultiLinear with its weight quantized along `in` (mlx-lm's QuantizedMultiLinear: the
    same parameter names)."""

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=transpose,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


def join_kv_b(embed_q: mx.array, unembed_out: mx.array) -> mx.array:
    """embed_q (n_heads, kv_lora_rank, nope) and unembed_out (n_heads, v, kv_lora_rank) as
    kv_b_proj's weight (n_heads·(nope + v), kv_lora_rank)."""
    w = mx.concatenate([embed_q.swapaxes(1, 2), unembed_out], axis=1)  # (H, nope + v, r)
    return w.reshape(-1, w.shape[-1])


def latent_attend(
    q_lat: mx.array,
    q_pe: mx.array,
    latent: Stored | Tailed,
    k_pe: Stored | Tailed,
    scale: float,
    mask: Mask,
) -> mx.array:
    """q_lat (B, H, T, kv_lora_rank), q_pe (B, H, T, rope) over the latents (B, 1, S,
    kv_lora_rank) and rope keys (B, 1, S, rope), newest last when mask is "causal"; an array
    mask is boolean (T, S) or (B, 1, T, S), True = attend -> (B, H, T, kv_lora_rank)."""
    b, h, t, r = q_lat.shape
    s = latent.shape[2]
    sc = mx.array(scale, q_lat.dtype)
    # one latent "head" shared by all H query heads: (B, 1, H, T, ·) against (B, 1, S, ·)
    ql, qp = (q_lat * sc)[:, None], (q_pe * sc)[:, None]
    scores = product(ql, latent, True) + product(qp, k_pe, True)  # (B, 1, H, T, S)
    if isinstance(mask, str):
        mask = window_mask(s - t, t, 0, s, None) if t > 1 else None
    if mask is not None:
        if mask.ndim == 4:  # per sequence (B, 1, T, S): broadcast over the heads
            mask = mask[:, :, None]
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q_lat.dtype)
    return product(probs, latent, False).reshape(b, h, t, r)  # (B, H, T, kv_lora_rank)


class LatentAttention(nn.Module):
    """MLA over a latent KVCache (the module doc); the checkpoints' names."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None, dims: LatentDims):
        super().__init__()
        d, h, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention.bias
        self.n_heads, self.dims = h, dims
        qk, r = dims.qk_head_dim, dims.kv_lora_rank
        if dims.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, dims.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_EPS)
            self.q_b_proj = nn.Linear(dims.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, r + dims.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(r, LATENT_EPS)
        if dims.split:
            self.embed_q = MultiLinear(dims.qk_nope_head_dim, r, h)
            self.unembed_out = MultiLinear(r, dims.v_head_dim, h)
        else:
            self.kv_b_proj = nn.Linear(r, h * (dims.qk_nope_head_dim + dims.v_head_dim), False)
        self.o_proj = nn.Linear(h * dims.v_head_dim, d, bias=bias)
        self.rope = rope

    def query(self, x: mx.array) -> mx.array:
        """x (B, T, hidden) -> the queries (B, T, n_heads·(nope + rope))."""
        if "q_proj" in self:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        return self.forward(x, self.query(x), mask, cache)

    def forward(self, x: mx.array, q: mx.array, mask: Mask, cache: Cache | None) -> mx.array:
        """x (B, T, hidden) and its queries (`query`) over the cache -> (B, T, hidden)."""
        b, t, _ = x.shape
        dims = self.dims
        q = q.reshape(b, t, self.n_heads, dims.qk_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [dims.qk_nope_head_dim], axis=-1)  # (B, H, T, nope | rope)
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_pe = mx.split(kv, [dims.kv_lora_rank], axis=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, T, kv_lora_rank)
        k_pe = k_pe[:, None]  # (B, 1, T, rope)
        q_lat = self.up(q_nope, True)  # (B, H, T, kv_lora_rank): W_ukᵀ q_nope
        out = self.attend(q_lat, q_pe, latent, k_pe, mask, cache)  # (B, H, T, kv_lora_rank)
        out = self.up(out, False)  # (B, H, T, v): W_uv applied once to the mixed latents
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))

    def up(self, x: mx.array, keys: bool) -> mx.array:
        """x (B, H, T, nope) times each head's W_uk (`keys`: into latent space), or x (B, H,
        T, kv_lora_rank) times its W_uvᵀ (out of it)."""
        if "embed_q" in self:
            return self.embed_q(x) if keys else self.unembed_out(x)
        nope, m = self.dims.qk_nope_head_dim, self.kv_b_proj
        # each part (H·(nope + v), ·) -> (H, nope + v, ·), then a head's W_uk or W_uv rows
        rows = slice(None, nope) if keys else slice(nope, None)
        parts = [
            m[k].reshape(self.n_heads, -1, m[k].shape[-1])[:, rows]
            for k in ("weight", "scales", "biases")
            if k in m
        ]
        if len(parts) == 1:  # W_uk (H, nope, r): x @ W_uk; W_uv (H, v, r): x @ W_uvᵀ
            return x @ (parts[0] if keys else parts[0].swapaxes(-1, -2))
        return mx.quantized_matmul(
            x,
            parts[0],
            scales=parts[1],
            biases=parts[2] if len(parts) > 2 else None,
            transpose=not keys,
            group_size=m.group_size,
            bits=m.bits,
            mode=m.mode,
        )

    def attend(self, q_lat, q_pe, latent, k_pe, mask: Mask, cache: Cache | None) -> mx.array:
        """RoPE at each position, the new latents into the cache, attention over it."""
        t, scale = q_lat.shape[2], self.dims.scale
        if isinstance(cache, CacheBatch) and t == 1:  # one token per sequence, on its cache
            caches = cache.caches
            offsets = mx.array([c.offset + c.shift for c in caches])
            q_pe, k_pe = self._rope(q_pe, offsets), self._rope(k_pe, offsets)
            keys, values, mask = KVBatch.step_of(caches, latent, k_pe)
            return latent_attend(q_lat, q_pe, keys, values, scale, mask)
        if isinstance(cache, CacheBatch):  # a batched verification: each row on its cache
            rows = [
                self.attend(
                    q_lat[i : i + 1],
                    q_pe[i : i + 1],
                    latent[i : i + 1],
                    k_pe[i : i + 1],
                    "causal",
                    c,
                )
                for i, c in enumerate(cache.caches)
            ]
            return mx.concatenate(rows)
        offset = cache.offset + cache.shift if cache is not None else 0
        q_pe, k_pe = self._rope(q_pe, offset), self._rope(k_pe, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        return latent_attend(q_lat, q_pe, latent, k_pe, scale, mask)

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return x if self.rope is None else self.rope(x, offset)


def softmax_scale(qk: int, rope: RopeConfig, mscale_all_dim: object, path: str, fld: str) -> float:
    """transformers' yarn_apply_mscale: 1/√qk, times mscale(factor, mscale_all_dim)² when the
    RoPE is scaled and mscale_all_dim is nonzero."""
    if not isinstance(mscale_all_dim, (int, float)) or isinstance(mscale_all_dim, bool):
        raise ConfigError(f"expected a number, got {mscale_all_dim!r}"[:200], path=path, field=fld)
    scale = qk**-0.5
    if rope.type != "default" and mscale_all_dim:
        m = yarn_mscale(rope.factor, float(mscale_all_dim))
        scale = scale * m * m
    return scale


def stored_split(path: str) -> bool:
    """The folder of config.json `path` holds the up-projections split as embed_q /
    unembed_out (mlx-lm's sanitized layout: its conversions, and `convert` of them), by its
    tensor names; False for transformers' kv_b_proj, or no folder to read."""
    try:
        files = weight_files(Path(path).parent)
        return any(n.endswith("self_attn.embed_q.weight") for f in files for n in read_header(f))
    except MlxlisError:
        return False


def yarn_keys_of(rope: RopeConfig, m_all: float) -> dict[str, Any]:
    """yarn's keys with mscale_all_dim, and the mscale that gives its attention factor
    (mlx-lm reads those two, not attention_factor)."""
    if rope.factor <= 1:  # mscale(factor, ·) is 1 whatever mscale is
        return {**yarn_keys(rope), "mscale": 1.0, "mscale_all_dim": m_all}
    m = (rope.attention_factor * yarn_mscale(rope.factor, m_all) - 1) / (
        0.1 * math.log(rope.factor)
    )
    return {**yarn_keys(rope), "mscale": m, "mscale_all_dim": m_all}


def latent_caches(n: int, dims: LatentDims, kv: KVFormat | None) -> list[KVCache]:
    """n latent caches in KV format `kv` (None: dense), whose groups must divide the latent
    and the rope key (each quantized along its own last axis)."""
    if kv is not None:
        kv.check(dims.kv_lora_rank, " (kv_lora_rank, the cached latent)")
        kv.check(dims.qk_rope_head_dim, " (qk_rope_head_dim, the cached rope key)")
    return [KVCache(kv) for _ in range(n)]
