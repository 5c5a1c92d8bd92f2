"""Gemma 3n (text): the network, Gemma 4's (gemma4_net.py) with what Gemma 3n adds: the residual
is `altup_num_inputs` streams (B, T, streams, hidden), of which one (the active) runs through
attention and the MLP each layer.

Per layer (transformers' Gemma3nTextDecoderLayer):
  predict   modalities = tanh(router(router_norm(active) / hidden)); every stream plus a mix of
            all of them by (streams × streams) coefficients the modalities give
  block     a = input_norm(active'); laurel = a + norm(right(left(a))) (LAuReL, rank r);
            x = (active' + post_attn_norm(attn(a)) + laurel) / √2; x += post_ffn_norm(mlp(...))
  correct   every stream += (1 + coefs(modalities of x)) · (x − active')
  per-layer the active stream × correct_output_scale -> gate -> act -> × per-layer input ->
            projection -> norm, added to streams 1.. (not 0)
The MLP's gate of the first layers is sparsified before the activation (Gaussian top-k:
relu(g − mean(g) − std(g)·Φ⁻¹(sparsity))). Into the stack: stream 0 is the scaled embedding,
stream k its altup_projections[k-1] rescaled to the embedding's RMS; out of it: streams 1..
through altup_unembed_projections rescaled to stream 0's RMS, the mean of all, the final norm.
Attention, KV sharing, per-layer inputs, RoPE per layer type, the caches: Gemma 4's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxlis.models.config import ModelConfig
from mlxlis.models.gemma4_net import (
    PLAIN_ACTS,
    Attention,
    Gemma4,
    Gemma4Model,
    RMSNorm,
    Structure,
)
from mlxlis.models.layers import Mask
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxlis.cache import KVCache, RotatingKVCache


@dataclass(frozen=True)
class AltUpStructure(Structure):
    """Gemma 4's Structure (full and sliding layers of one head shape, default RoPE) plus what
    Gemma 3n adds."""

    altup_num_inputs: int = 4
    altup_active_idx: int = 0
    altup_correct_scale: bool = True
    laurel_rank: int = 64
    # per layer: the MLP gate's cutoff in standard deviations above its mean, Φ⁻¹(sparsity)
    # (None: a dense layer)
    sparsity_std: tuple[float | None, ...] = ()
    altup_coef_clip: float | None = 120.0  # config only: transformers clips when training


def magnitude(x: mx.array) -> mx.array:
    """The RMS over the last axis (keepdims)."""
    return mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True))


def rescaled(x: mx.array, target: mx.array) -> mx.array:
    """x scaled to RMS `target` (its own RMS floored at √1e-5, as transformers clamps)."""
    return x * target / mx.sqrt(mx.maximum(mx.mean(x * x, axis=-1, keepdims=True), 1e-5))


class AltUp(nn.Module):
    """Predict and correct the streams around a layer (transformers' Gemma3nTextAltUp; the
    coefficient clip is training-only there and not applied here)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s, d = cfg.own(AltUpStructure), cfg.hidden_size
        self.n, self.active = s.altup_num_inputs, s.altup_active_idx
        self.inv_hidden = 1.0 / d
        self.correct_output_scale = mx.zeros((d,))
        self.correction_coefs = nn.Linear(self.n, self.n, bias=False)
        self.prediction_coefs = nn.Linear(self.n, self.n * self.n, bias=False)
        self.modality_router = nn.Linear(d, self.n, bias=False)
        self.router_norm = RMSNorm(d, cfg.norms.eps)

    def modalities(self, x: mx.array) -> mx.array:
        """(B, T, hidden) -> (B, T, streams), tanh in float32."""
        routed = self.modality_router(self.router_norm(x) * self.inv_hidden)
        return mx.tanh(routed.astype(mx.float32)).astype(x.dtype)

    def predict(self, h: mx.array) -> mx.array:
        """h (B, T, streams, hidden): stream i + Σ_j c[i, j] · stream j."""
        m = self.modalities(h[..., self.active, :])
        coefs = self.prediction_coefs(m).reshape(*m.shape[:-1], self.n, self.n)  # (B, T, i, j)
        return (h + coefs.astype(h.dtype) @ h).astype(h.dtype)

    def correct(self, predictions: mx.array, activated: mx.array) -> mx.array:
        """Every stream moved by (1 + its coefficient) × the layer's innovation on the active
        one; (B, T, streams, hidden)."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # (B, T, streams)
        innovation = activated - predictions[..., self.active, :]
        return (predictions + coefs[..., None] * innovation[..., None, :]).astype(activated.dtype)


class Laurel(nn.Module):
    """x + norm(right(left(x))): the learned augmented residual, rank `laurel_rank`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, r = cfg.hidden_size, cfg.own(AltUpStructure).laurel_rank
        self.linear_left = nn.Linear(d, r, bias=False)
        self.linear_right = nn.Linear(r, d, bias=False)
        self.post_laurel_norm = RMSNorm(d, cfg.norms.eps)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class SparseMLP(nn.Module):
    """down(act(gate(x)) · up(x)), the gate first cut to its values more than `std` standard
    deviations (population) above its mean, less that cutoff (transformers' _gaussian_topk)."""

    def __init__(self, cfg: ModelConfig, hidden: int, std: float | None):
        super().__init__()
        d = cfg.hidden_size
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act = PLAIN_ACTS[cfg.mlp.hidden_act]
        self.std = std

    def __call__(self, x: mx.array) -> mx.array:
        g = self.gate_proj(x)
        if self.std is not None:  # the moments in float32: a float16 sum of squares overflows
            g32 = g.astype(mx.float32)
            mean = mx.mean(g32, axis=-1, keepdims=True)
            cutoff = mean + mx.std(g32, axis=-1, keepdims=True) * self.std
            g = nn.relu(g - cutoff.astype(g.dtype))
        return self.down_proj(self.act(g) * self.up_proj(x))


class Gemma3nLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope):
        super().__init__()
        d, eps, s = cfg.hidden_size, cfg.norms.eps, cfg.own(AltUpStructure)
        self.active = s.altup_active_idx
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp = SparseMLP(cfg, s.intermediate_sizes[layer], s.sparsity_std[layer])
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_per_layer_input_norm",
        ):
            setattr(self, name, RMSNorm(d, eps))
        self.altup = AltUp(cfg)
        self.laurel = Laurel(cfg)
        self.per_layer_input_gate = nn.Linear(d, s.per_layer_dim, bias=False)
        self.per_layer_projection = nn.Linear(s.per_layer_dim, d, bias=False)
        self.act = PLAIN_ACTS[cfg.mlp.hidden_act]
        self.correct_scale = s.altup_correct_scale

    def __call__(
        self,
        h: mx.array,
        mask: Mask,
        cache: KVCache | RotatingKVCache | None,
        offset: int | mx.array,
        shared: tuple | None,
        per_layer: mx.array | None,
    ) -> tuple:
        """h (B, T, streams, hidden) -> the same, and what attention attended over."""
        predictions = self.altup.predict(h)
        active = predictions[..., self.active, :]  # (B, T, hidden)
        x = self.input_layernorm(active)
        laurel = self.laurel(x)
        a, kv = self.self_attn(x, mask, cache, offset, shared)
        x = (active + self.post_attention_layernorm(a) + laurel) * 2**-0.5
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[..., self.active, :]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        g = self.act(self.per_layer_input_gate(first)) * per_layer  # (B, T, per_layer_dim)
        g = self.post_per_layer_input_norm(self.per_layer_projection(g)).astype(corrected.dtype)
        rest = corrected[..., 1:, :] + g[..., None, :]  # streams 1.. (transformers: [1:])
        return mx.concatenate([corrected[..., :1, :], rest], axis=-2), kv


class Gemma3nModel(Gemma4Model):
    layer_class = Gemma3nLayer

    def __init__(self, cfg: ModelConfig, ropes: list[Rope]):
        super().__init__(cfg, ropes)
        d, n = cfg.hidden_size, cfg.own(AltUpStructure).altup_num_inputs
        self.altup_projections = [nn.Linear(d, d, bias=False) for _ in range(n - 1)]
        self.altup_unembed_projections = [nn.Linear(d, d, bias=False) for _ in range(n - 1)]


@dataclass(frozen=True)
class HardTokens:
    """A modality's own vocabulary: ids from `offset` on, `embed` (B, T) ids -> embeddings."""

    offset: int
    embed: Callable[[mx.array], mx.array]


class Gemma3n(Gemma4):
    """inputs (B, T) token ids -> logits (B, T, vocab); `hidden_states` gives the streams
    (B, T, streams, hidden) that `head` merges."""

    model_class = Gemma3nModel
    # ids from this one on are the audio vocabulary's, embedded by its embedder (unscaled), as
    # Gemma3nModel embeds them (its end-of-audio token); set where the audio tower is loaded
    hard_audio: HardTokens | None = None

    def embed(self, inputs: mx.array) -> mx.array:
        h = super().embed(inputs)
        if self.hard_audio is None:
            return h
        offset, embed = self.hard_audio.offset, self.hard_audio.embed
        heard = inputs >= offset
        hard = embed(mx.where(heard, inputs, offset)).astype(h.dtype)  # (B, T, hidden)
        return mx.where(heard[..., None], hard, h)

    def _expand(self, h: mx.array) -> mx.array:
        """The embedding (B, T, hidden) -> the streams (B, T, streams, hidden)."""
        target = magnitude(h)
        extra = [rescaled(p(h), target) for p in self.model.altup_projections]
        return mx.stack([h, *extra], axis=-2)

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        """Merge the streams (the mean of stream 0 and the others unembedded, each at stream
        0's RMS), then Gemma 4's final norm, head and softcap."""
        if last_only:
            h = h[:, -1:]
        first = h[..., 0, :]
        target = magnitude(first)
        rest = [
            rescaled(p(h[..., k + 1, :]), target)
            for k, p in enumerate(self.model.altup_unembed_projections)
        ]
        return super().head(mx.mean(mx.stack([first, *rest], axis=-2), axis=-2))
