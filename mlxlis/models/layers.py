"""The building blocks the decoder families share: norms, the common Attention and the kinds
more than one family composes (gated, tempered, whole-projection q/k norms), the gated MLP and
one without a gate, the pre- and post-norm blocks.

Module attribute names equal the Hugging Face tensor names, so a checkpoint binds by name. The
options many families share are ModelConfig fields read here (bias, q/k norm, scale, softcap);
a family's own attention kind lives with the family (phi3.py, gpt_oss.py, llama4.py).
"""

from __future__ import annotations

from collections.abc import Callable

from mlxlis.cache import CacheBatch, KVBatch, KVCache, RecurrentCache, RotatingKVCache
from mlxlis.models.activations import gated
from mlxlis.models.attention import attend
from mlxlis.models.config import ModelConfig
from mlxlis.models.quantized import products
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
    """Multi-head attention with grouped K/V heads, the kind most families share; options from
    the config: q/k/v and o bias, q/k RMSNorm over head_dim before RoPE (Qwen3, Gemma 3), the
    scale (1/√head_dim or 1/√query_pre_attn_scalar), a logit softcap (Gemma 2). `rope` None: a
    NoPE layer (Llama 4, SmolLM3). A sliding window or an attention chunk is the mask's and the
    cache's business, not this module's.

    A family's own kind overrides one step: `projections` and `project` (the q|k|v
    projections: Phi-3's fused one), `after_rope` (Llama 4's L2 norm, TemperedAttention),
    `attend_heads` (the softmax: gpt-oss's sinks), or wraps `__call__` around `attend` (the
    gated output of GatedAttention)."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        a = cfg.attention
        self.scale = cfg.attn_scale
        self.softcap = a.logit_softcapping
        d, hd = cfg.hidden_size, cfg.head_dim
        self.projections(d, self.n_heads * hd, self.n_kv_heads * hd, a.bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = norm(cfg, hd)
            self.k_norm = norm(cfg, hd)
        self.rope = rope

    def projections(self, d: int, q_out: int, kv_out: int, bias: bool) -> None:
        """The q, k and v projections of `d` inputs: q_out query rows, kv_out key and value rows."""
        self.q_proj = nn.Linear(d, q_out, bias=bias)
        self.k_proj = nn.Linear(d, kv_out, bias=bias)
        self.v_proj = nn.Linear(d, kv_out, bias=bias)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        """`positions` (T, rotary pairs): explicit RoPE positions of a prompt chunk (Rope.at),
        else each position's own (the cache's offset + shift onwards)."""
        q, k, v = self.project(x)
        return self.o_proj(self.attend(q, k, v, mask, cache, positions))

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x (B, T, hidden) -> q, k, v by heads (`heads`)."""
        return self.heads(*products(x, (self.q_proj, self.k_proj, self.v_proj)))

    def heads(self, q, k, v) -> tuple[mx.array, mx.array, mx.array]:
        """The projections (B, T, heads·width) by heads: q (B, T, n_heads, width), k (B, T,
        n_kv_heads, head_dim) heads last until RoPE puts them first (one CPU node: the
        projections' layout in, the caches' out), v (B, n_kv_heads, T, head_dim)."""
        b, t, _ = q.shape
        q = q.reshape(b, t, self.n_heads, -1)
        k = k.reshape(b, t, self.n_kv_heads, -1)
        v = v.reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v

    def attend(self, q, k, v, mask: Mask, cache: Cache | None, positions=None) -> mx.array:
        """q (B, T, n_heads, head_dim), k (B, T, n_kv_heads, head_dim), v (B, n_kv_heads, T,
        head_dim) over the cache -> (B, T, n_heads·head_dim)."""
        q, k = self.norm_heads(q, k)
        t = q.shape[1]
        if isinstance(cache, CacheBatch) and t == 1:  # one token per sequence, on its cache
            return self._attend_batch(q, k, v, cache.caches)
        if isinstance(cache, CacheBatch):  # a batched verification: each row on its cache
            rows = [
                self._attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], row_mask(c, t), c)
                for i, c in enumerate(cache.caches)
            ]
            return mx.concatenate(rows)
        return self._attend(q, k, v, mask, cache, positions)

    def norm_heads(self, q, k) -> tuple[mx.array, mx.array]:
        """q (B, T, n_heads, head_dim) and k by heads, before RoPE: each head RMSNormed over
        head_dim where the config says (q_norm, k_norm), else as they are."""
        if "q_norm" in self:
            return self.q_norm(q), self.k_norm(k)
        return q, k

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
        q, k = self.after_rope(q, k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        return self.attend_heads(q, k, v, mask)

    def _attend_batch(self, q, k, v, caches: list) -> mx.array:
        """One new token per sequence (q, k heads last (B, 1, heads, head_dim), v (B, n_kv_heads,
        1, head_dim)): RoPE at each one's own position, then all attend at once over their
        caches stacked (KVBatch), each row masked to its own keys: (B, 1, n_heads·head_dim)."""
        offsets = mx.array([c.offset + c.shift for c in caches])
        if self.rope is not None:
            q, k = self.rope(q, offsets, heads_last=True), self.rope(k, offsets, heads_last=True)
        else:
            q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        q, k = self.after_rope(q, k, offsets[:, None, None])
        keys, values, mask = KVBatch.step_of(caches, k, v)
        return self.attend_heads(q, keys, values, mask)

    def after_rope(self, q, k, offset) -> tuple[mx.array, mx.array]:
        """q (B, n_heads, T, head_dim) and k (B, n_kv_heads, T, head_dim) after RoPE, at the
        positions offset + 0..T-1 (`offset` an int), or one new token per sequence at its
        own (`offset` (B, 1, 1), each sequence's position): as they are here."""
        return q, k

    def attend_heads(self, q, k, v, mask: Mask) -> mx.array:
        """(B, n_heads, T, head_dim) queries over the keys -> (B, T, n_heads·head_dim)."""
        return attend(q, k, v, self.scale, mask, self.softcap, None, heads_last=True)


class GatedAttention(Attention):
    """Qwen3.5's and Qwen3-Next's attention (Qwen4-Exp's under its indexer): a sigmoid output
    gate carried by a doubled q_proj (per head, head_dim query values then head_dim gate
    values), out · sigmoid(gate) before o_proj."""

    def projections(self, d: int, q_out: int, kv_out: int, bias: bool) -> None:
        super().projections(d, 2 * q_out, kv_out, bias)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        b, t, _ = x.shape
        q, k, v = self.project(x)
        # q: (B, T, n_heads, 2·head_dim): each head's query, then its gate
        q, gate = mx.split(q, 2, axis=-1)
        out = self.attend(q, k, v, mask, cache, positions)  # (B, T, n_heads·head_dim)
        out = out * mx.sigmoid(gate).reshape(b, t, -1)
        return self.o_proj(out)


class WholeQKNormAttention(Attention):
    """q and k RMSNormed over the whole projection (every head at once: one weight of
    n_heads·head_dim, one of n_kv_heads·head_dim) before they are split into heads and turned
    by RoPE (OLMo 2 / OLMo 3), instead of per head over head_dim."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__(cfg, rope)
        hd = cfg.head_dim
        self.q_norm = norm(cfg, self.n_heads * hd)
        self.k_norm = norm(cfg, self.n_kv_heads * hd)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        # the norms see (B, T, heads·head_dim): the statistics span all heads
        return self.heads(self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x))

    def norm_heads(self, q, k) -> tuple[mx.array, mx.array]:
        return q, k  # normed whole in `project`


class TemperedAttention(Attention):
    """Queries scaled by their position after RoPE (Ministral 3's llama_4_scaling_beta, on
    every layer; Llama 4's NoPE layers, llama4.py): q · (1 + scale·log(1 + ⌊(p + offset) /
    floor⌋)) at position p, attention.temperature (floor, scale) and temperature_offset (1:
    Llama 4, 0: Ministral 3); none where the config has no temperature."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        super().__init__(cfg, rope)
        self._temperature = cfg.attention.temperature
        self._temperature_offset = float(cfg.attention.temperature_offset)

    def after_rope(self, q, k, offset) -> tuple[mx.array, mx.array]:
        if self._temperature is None:
            return q, k
        floor, scale = self._temperature
        # p broadcasting over (B, heads, T): T positions, or one per sequence when batched
        p = offset if isinstance(offset, mx.array) else offset + mx.arange(q.shape[2])
        p = p.astype(mx.float32)
        t = mx.log1p(mx.floor((p + self._temperature_offset) / floor)) * scale + 1.0
        return (q * t[..., None]).astype(q.dtype), k


# an attention kind: its class, or a family's choice of one by the config (phi3.py)
AttentionKind = Callable[[ModelConfig, Rope | None], Attention]


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
        return self.down_proj(self.act(*products(x, (self.gate_proj, self.up_proj))))


class UpDownMLP(nn.Module):
    """down(act(up(x))), no gate (Nemotron-H's relu² MLPs)."""

    def __init__(self, d: int, f: int, bias: bool, act: Callable[[mx.array], mx.array]):
        super().__init__()
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.up_proj(x)))


class PreNormBlock(nn.Module):
    """h += attn(norm(h)); h += ffn(norm(h)), the feed-forward under the checkpoint's name for
    it (`ffn_name`: Llama 4 calls it feed_forward) — a family's own block over its own MLP."""

    ffn_name = "mlp"
    attention: AttentionKind = Attention  # the family's own kind (gpt_oss.py, llama4.py)

    def __init__(self, cfg: ModelConfig, rope: Rope | None, ffn: nn.Module):
        super().__init__()
        self.self_attn = self.attention(cfg, rope)
        setattr(self, self.ffn_name, ffn)
        self.input_layernorm = norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size)

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), mask, cache, positions)
        return h + self[self.ffn_name](self.post_attention_layernorm(h))


class PostNormBlock(nn.Module):
    """h += norm(attn(h)); h += norm(ffn(h)): each sublayer's output normed inside the residual
    and its input left as it is (OLMo 2 / OLMo 3; Gemma's sandwich norms both sides) — a
    family's own block over its own attention kind and MLP."""

    attention: AttentionKind = Attention

    def __init__(self, cfg: ModelConfig, rope: Rope | None, ffn: nn.Module):
        super().__init__()
        self.self_attn = self.attention(cfg, rope)
        self.mlp = ffn
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = norm(cfg, cfg.hidden_size)

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        h = h + self.post_attention_layernorm(self.self_attn(h, mask, cache, positions))
        return h + self.post_feedforward_layernorm(self.mlp(h))
