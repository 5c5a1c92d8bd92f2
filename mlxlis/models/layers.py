"""The building blocks the decoder families share: norms, one Attention, the gated MLP.

Module attribute names equal the Hugging Face tensor names, so a checkpoint binds by name. Every
per-family difference is a ModelConfig field read here (bias, q/k norm, scale, softcap).
"""

from __future__ import annotations

from mlxlis.cache import CacheBatch, KVBatch, KVCache, RecurrentCache, RotatingKVCache
from mlxlis.models.activations import gated
from mlxlis.models.attention import attend
from mlxlis.models.config import ModelConfig
from mlxlis.models.rope import Rope
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

Cache = KVCache | RotatingKVCache | RecurrentCache | CacheBatch
Mask = str | mx.array | None


class RMSNorm(nn.Module):
    """x̂·w, as MLX's nn.RMSNorm (same parameter), through runtime/fused on the CPU."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return fused.rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x̂·(1 + w), reduced and multiplied in float32, cast after the multiply
    (as transformers' GemmaRMSNorm; casting before the multiply, as plain RMSNorm does, or
    forming 1 + w in float16 changes about a third of the float16 outputs by one ulp)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        w = 1.0 + self.weight.astype(mx.float32)
        return fused.rms_norm(x.astype(mx.float32), w, self.eps).astype(self.weight.dtype)


def norm(cfg: ModelConfig, dims: int) -> nn.Module:
    """The family's RMSNorm over `dims` (cfg.norms.kind: "rms" x̂·w, "rms_plus_one" x̂·(1 + w))."""
    if cfg.norms.kind == "rms_plus_one":
        return GemmaRMSNorm(dims, cfg.norms.eps)
    return RMSNorm(dims, eps=cfg.norms.eps)


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads; options from the config: q/k/v and o bias,
    q/k RMSNorm over head_dim before RoPE (Qwen3, Gemma 3) or without weight after it (Llama
    4), the scale (1/√head_dim or 1/√query_pre_attn_scalar), a logit softcap (Gemma 2), a
    sigmoid output gate carried by a doubled q_proj (Qwen3.5: per head, head_dim query values
    then head_dim gate values), a sink logit per head (gpt-oss). `rope` None: a NoPE layer
    (Llama 4, SmolLM3), whose queries Llama 4 scales by position (temperature, as
    Ministral 3 does on every layer). A
    sliding window or an attention chunk is the mask's and the cache's business, not this
    module's."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        a = cfg.attention
        self.scale = cfg.attn_scale
        self.softcap = a.logit_softcapping
        d, hd = cfg.hidden_size, cfg.head_dim
        self.gated = a.output_gate
        q_out = self.n_heads * hd * (2 if self.gated else 1)
        if a.fused_qkv:  # Phi-3 / Phi-4: one projection, q rows then k then v
            self.qkv_proj = nn.Linear(d, q_out + 2 * self.n_kv_heads * hd, bias=a.bias)
            self._split = (q_out, q_out + self.n_kv_heads * hd)
        else:
            self.q_proj = nn.Linear(d, q_out, bias=a.bias)
            self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
            self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=a.bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = norm(cfg, hd)
            self.k_norm = norm(cfg, hd)
        if a.sinks:  # gpt-oss: one softmax sink logit per head
            self.sinks = mx.zeros((self.n_heads,))
        self.rope = rope
        self._l2_eps = cfg.norms.eps if a.qk_l2_norm and rope is not None else None
        everywhere = rope is None or a.temperature_all
        self._temperature = a.temperature if everywhere else None
        self._temperature_offset = float(a.temperature_offset)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        """`positions` (T, rotary pairs): explicit RoPE positions of a prompt chunk (Rope.at),
        else each position's own (the cache's offset + shift onwards)."""
        b, t, _ = x.shape
        if "qkv_proj" in self:
            q, k, v = mx.split(self.qkv_proj(x), self._split, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, self.n_heads, -1)
        if self.gated:  # (B, T, n_heads, 2·head_dim): each head's query, then its gate
            q, gate = mx.split(q, 2, axis=-1)
        k = k.reshape(b, t, self.n_kv_heads, -1)
        v = v.reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # q: (B, T, n_heads, head_dim), k: (B, T, n_kv_heads, head_dim): heads last until RoPE
        # puts them first (one CPU node: the projections' layout in, the caches' out)
        # v: (B, n_kv_heads, T, head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(cache, CacheBatch) and t == 1:  # one token per sequence, on its cache
            out = self._attend_batch(q, k, v, cache.caches)
        elif isinstance(cache, CacheBatch):  # a batched verification: each row on its cache
            rows = [
                self._attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], row_mask(c, t), c)
                for i, c in enumerate(cache.caches)
            ]
            out = mx.concatenate(rows)
        else:
            out = self._attend(q, k, v, mask, cache, positions)
        # out: (B, T, n_heads·head_dim)
        if self.gated:
            out = out * mx.sigmoid(gate).reshape(b, t, -1)
        return self.o_proj(out)

    def _attend(self, q, k, v, mask: Mask, cache: Cache | None, positions=None) -> mx.array:
        """q, k heads last (B, T, heads, head_dim), v (B, n_kv_heads, T, head_dim) ->
        (B, T, n_heads·head_dim)."""
        offset = cache.offset + cache.shift if cache is not None else 0
        if self.rope is None:
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        elif positions is not None:
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
            q, k = self.rope.at(q, positions), self.rope.at(k, positions)
        else:
            q, k = self.rope(q, offset, heads_last=True), self.rope(k, offset, heads_last=True)
        # q: (B, n_heads, T, head_dim), k: (B, n_kv_heads, T, head_dim)
        if self._l2_eps is not None or self._temperature is not None:  # Llama 4, Ministral 3
            q, k = self._after_rope(q, k, offset + mx.arange(q.shape[2]))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self._attend_heads(q, k, v, mask, self.get("sinks"))

    def _attend_batch(self, q, k, v, caches: list) -> mx.array:
        """One new token per sequence (q, k heads last (B, 1, heads, head_dim), v (B, n_kv_heads,
        1, head_dim)): RoPE at each one's own position, then all attend at once over their
        caches stacked (KVBatch), each row masked to its own keys: (B, 1, n_heads·head_dim)."""
        offsets = mx.array([c.offset + c.shift for c in caches])
        if self.rope is not None:
            q, k = self.rope(q, offsets, heads_last=True), self.rope(k, offsets, heads_last=True)
        else:
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        if self._l2_eps is not None or self._temperature is not None:
            q, k = self._after_rope(q, k, offsets[:, None, None])
        keys, values, mask = KVBatch.step_of(caches, k, v)
        return self._attend_heads(q, keys, values, mask, self.get("sinks"))

    def _attend_heads(self, q, k, v, mask, sinks) -> mx.array:
        """(B, n_heads, T, head_dim) queries over the keys -> (B, T, n_heads·head_dim)."""
        return attend(q, k, v, self.scale, mask, self.softcap, sinks, heads_last=True)

    def _after_rope(self, q, k, positions: mx.array) -> tuple[mx.array, mx.array]:
        """Llama 4's L2 norm of q and k (RoPE layers), or the temperature on q (Llama 4's NoPE
        layers, Ministral 3's every layer): q · (1 + scale·log(1 + ⌊(p + offset) / floor⌋))
        at each position p (`positions` broadcasting over (B, heads, T), as T positions or
        one per sequence)."""
        if self._l2_eps is not None:
            q = fused.rms_norm(q, None, self._l2_eps)
            k = fused.rms_norm(k, None, self._l2_eps)
        if self._temperature is not None:
            floor, scale = self._temperature
            p = positions.astype(mx.float32)
            t = mx.log1p(mx.floor((p + self._temperature_offset) / floor)) * scale + 1.0
            q = (q * t[..., None]).astype(q.dtype)
        return q, k


def row_mask(cache: Cache, t: int) -> Mask:
    """The mask of `t` new tokens of one sequence on its own cache (a ring's from absolute
    positions, else causal aligned to the newest keys)."""
    return cache.mask(t) if isinstance(cache, RotatingKVCache) else "causal"


class MLP(nn.Module):
    """down(act(gate(x)) · up(x)): SwiGLU (Llama, Qwen) or GeGLU (Gemma) by cfg.mlp.hidden_act."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        d, f, mlp = cfg.hidden_size, hidden or cfg.mlp.intermediate_size, cfg.mlp
        if mlp.fused_gate_up:  # Phi-3 / Phi-4: one projection, the gate's rows first
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=mlp.bias)
        else:
            self.gate_proj = nn.Linear(d, f, bias=mlp.bias)
            self.up_proj = nn.Linear(d, f, bias=mlp.bias)
        self.down_proj = nn.Linear(f, d, bias=mlp.bias)
        self.act = gated(mlp.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            return self.down_proj(self.act(*mx.split(self.gate_up_proj(x), 2, axis=-1)))
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class PreNormBlock(nn.Module):
    """h += attn(norm(h)); h += ffn(norm(h)), the feed-forward under the checkpoint's name for
    it (`ffn_name`: Llama 4 calls it feed_forward) — a family's own block over its own MLP."""

    ffn_name = "mlp"

    def __init__(self, cfg: ModelConfig, rope: Rope | None, ffn: nn.Module):
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        setattr(self, self.ffn_name, ffn)
        self.input_layernorm = norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size)

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), mask, cache, positions)
        return h + self[self.ffn_name](self.post_attention_layernorm(h))
