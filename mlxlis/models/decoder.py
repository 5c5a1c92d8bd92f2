"""The decoder-only transformer the Llama, Qwen2/3 and Gemma 1/2/3 families share.

One forward pass; what differs between the families is ModelConfig data and the attention kind
a family's block names (layers.py's common Attention unless said):
  Llama/Qwen2: pre-norm blocks, SwiGLU, RMSNorm x̂·w, tied or untied head, q/k/v bias (Qwen2).
  Qwen3:       + RMSNorm over head_dim on q and k before RoPE; Qwen3-MoE: + expert MLPs.
  Gemma 1:     GeGLU, x̂·(1 + w) RMSNorm, embedding × √hidden, float32 residual, tied head.
  Gemma 2:     + sandwich norms, attention-logit and final-logit softcaps,
               scale 1/√query_pre_attn_scalar, sliding-window layers.
  Gemma 3:     + q/k norms, a local RoPE base for sliding layers, usually no softcaps.
  Qwen3.5:     Gated DeltaNet layers (deltanet.py) between gated full-attention layers
               (GatedAttention, hybrid.py's block) with partial RoPE, x̂·(1 + w) norms;
               Qwen3.5-MoE: + a shared expert.
  Llama 4:     interleaved RoPE, chunked layers between NoPE full layers, L2 q/k norms, a
               position temperature on NoPE queries; its own attention kind and feed-forward
               blocks (llama4.py).
Sliding layers see keys in (p − window, p] (transformers' `kv_idx > q_idx - sliding_window`);
chunked layers those of p's chunk (`kv_idx // c == q_idx // c`); a model's ring layers (the
two kinds, each a ring of its window's positions) are all of one kind.
Module attribute names equal the Hugging Face tensor names, so a checkpoint binds by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxlis.cache import (
    CacheBatch,
    ChunkedKVCache,
    KVCache,
    KVFormat,
    RecurrentCache,
    RotatingKVCache,
    window_mask,
)
from mlxlis.models.attention import softcap
from mlxlis.models.config import ModelConfig
from mlxlis.models.deltanet import GatedDeltaNet
from mlxlis.models.experts import ExpertSource, SparseMoE
from mlxlis.models.layers import MLP, Attention, AttentionKind, Cache, Mask, norm
from mlxlis.models.multimodal import Inserts, with_blocks
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxlis.models.base import Family


class DecoderLayer(nn.Module):
    attention: AttentionKind = Attention  # a family's own kind (phi3.py, mistral3.py, hybrid.py)

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__()
        d = cfg.hidden_size
        self.linear = cfg.is_linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = self.attention(cfg, rope)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(layer) else MLP(cfg)
        self.input_layernorm = norm(cfg, d)
        self.post_attention_layernorm = norm(cfg, d)
        self.sandwich = cfg.norms.sandwich
        if self.sandwich:  # Gemma 2/3 also norm each sublayer's output
            self.pre_feedforward_layernorm = norm(cfg, d)
            self.post_feedforward_layernorm = norm(cfg, d)

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        if self.linear:
            h = h + self.linear_attn(self.input_layernorm(h), None, cache)
            return h + self.mlp(self.post_attention_layernorm(h))
        if not self.sandwich:
            h = h + self.self_attn(self.input_layernorm(h), mask, cache, positions)
            return h + self.mlp(self.post_attention_layernorm(h))
        attn = self.self_attn(self.input_layernorm(h), mask, cache, positions)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class DecoderModel(nn.Module):
    """The embedding, the blocks and the final norm; a pipeline stage holds only its share:
    layers outside `held` are None (so parameter names keep their layer numbers), the
    embedding where it embeds or (tied) projects, the norm where it heads."""

    def __init__(
        self,
        cfg: ModelConfig,
        ropes: list[Rope | None],
        held: range,
        embeds: bool,
        heads: bool,
        layer: type[nn.Module] = DecoderLayer,
    ):
        super().__init__()
        if embeds or (heads and cfg.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [layer(cfg, ropes[i], i) if i in held else None for i in range(held.stop)]
        if heads:
            self.norm = norm(cfg, cfg.hidden_size)


class Decoder(nn.Module):
    """inputs (B, T) token ids -> logits (B, T, vocab) in the compute dtype (T = 1 if last_only).

    A pipeline stage (`layers`, `embeds`, `heads`) holds a contiguous range of the blocks and
    runs its part of the pass: `embed` (the first stage), `run_layers`, `head` (the last);
    its caches are those of its own layers, in order."""

    layer = DecoderLayer  # a family's own block (llama4.py), built as layer(cfg, rope, index)
    verifies_in_batch = True  # verify_batch: the rows' caches through CacheBatch

    def __init__(
        self,
        cfg: ModelConfig,
        family: Family,
        rope_freq_factors: mx.array | None = None,
        *,
        layers: range | None = None,
        embeds: bool = True,
        heads: bool = True,
    ):
        super().__init__()
        self.config = cfg
        self._family = family  # underscores: plain data, not part of the parameter tree
        self._rope_freq_factors = rope_freq_factors  # GGUF rope_freqs: a buffer, not a parameter
        self._held = range(cfg.num_hidden_layers) if layers is None else layers
        self._embeds, self._heads = embeds, heads
        # one module, shared by layers; partial RoPE turns the first rotary_dim dims only
        a = cfg.attention
        dims, inter = a.rotary_dim or cfg.head_dim, a.rope_interleaved
        rope = Rope(dims, cfg.rope, rope_freq_factors, inter)
        local = Rope(cfg.head_dim, a.rope_local, None, inter) if a.rope_local else rope
        self._sliding = tuple(cfg.is_ring(i) for i in self._held)  # of the held layers
        ropes = [
            (local if cfg.is_sliding(i) else rope) if cfg.has_rope(i) else None
            for i in range(cfg.num_hidden_layers)
        ]
        self.model = DecoderModel(cfg, ropes, self._held, embeds, heads, self.layer)
        if heads and not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def held_layers(self) -> range:
        return self._held

    @property
    def heads(self) -> bool:
        return self._heads

    @property
    def rope_freq_factors(self) -> mx.array | None:
        return self._rope_freq_factors

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        cfg = self.config
        if kv is not None:
            kv.check(cfg.head_dim)
        return [self._cache(i, kv) for i in self._held]

    def _cache(self, i: int, kv: KVFormat | None) -> Cache:
        cfg = self.config
        if cfg.is_linear(i):
            return RecurrentCache()
        if cfg.is_chunked(i):
            return ChunkedKVCache(cfg.attention.chunk_size, kv)
        return RotatingKVCache(cfg.ring_window(i), kv) if cfg.is_sliding(i) else KVCache(kv)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names under ours: the family's renames applied, its dropped names gone."""
        out = {}
        for name, arr in weights.items():
            ours = self._family.hf.name(name)
            if ours is not None:
                out[ours] = arr
        return out

    def expert_stacks(self) -> dict[str, ExpertSource]:
        """Stacked expert parameters -> where Hugging Face checkpoints keep them (per-expert
        tensors or fused ones, see experts.py); empty for a dense model."""
        stacks: dict[str, ExpertSource] = {}
        for i, layer in enumerate(self.model.layers):
            if layer is not None and isinstance(layer.mlp, SparseMoE):
                stacks.update(layer.mlp.expert_stacks(f"model.layers.{i}.mlp"))
        return stacks

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """One token for each of B sequences (`tokens` (B,)), each with its own caches:
        (B, vocab) logits. The projections and MLPs run on the batch (the weights read once);
        attention and recurrences on each sequence's cache, as its lone step would."""
        inputs = tokens.astype(mx.int32)[:, None]  # (B, 1)
        per_layer = [CacheBatch([c[i] for c in caches]) for i in range(len(self._held))]
        return self(inputs, per_layer)[:, -1, :]

    def verify_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """T tokens for each of B sequences (`tokens` (B, T): a batched speculative
        verification), each with its own caches: (B, T, vocab) logits. The projections and
        MLPs run on the batch; attention and recurrences on each sequence's cache."""
        per_layer = [CacheBatch([c[i] for c in caches]) for i in range(len(self._held))]
        return self(tokens.astype(mx.int32), per_layer)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        last_only: bool = False,
        inserts: Inserts | None = None,
    ) -> mx.array:
        return self.head(self.hidden_states(inputs, cache, inserts), last_only)

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: Inserts | None = None
    ) -> mx.array:
        """(B, T) ids -> the last layer's output (B, T, hidden), before the final norm (what
        `head` takes; what a multi-token-prediction drafter reads). `inserts`: the images
        whose placeholder runs a (1, T) chunk holds (models/multimodal.py)."""
        if not inserts:
            return self.run_layers(self.embed(inputs), cache)
        h = inserts.place(self.embed(inserts.ids(inputs)))
        blocks = inserts.blocks(inputs.shape[1]) if inserts.bidirectional else None
        return self.run_layers(h, cache, blocks, inserts.positions)

    def embed(self, inputs: mx.array) -> mx.array:
        """(B, T) token ids -> (B, T, hidden), the residual stream's dtype (`hidden_dtype`)."""
        cfg = self.config
        h = self.model.embed_tokens(inputs)  # (B, T, hidden)
        if (
            cfg.norms.embed_scale
        ):  # √hidden is rounded to the compute dtype first, as transformers does
            h = h * mx.array(cfg.hidden_size**0.5, mx.float32).astype(h.dtype)
        if cfg.norms.residual_f32:
            # Gemma's residual stream outgrows float16's 65 504 (Gemma 3 270M reaches 1.04e5
            # within 300 tokens; a float16 residual turned all of its logits NaN, clipping adds
            # to ±65 504 as mlx-lm does left them off by up to 15.7). Sublayers read it through
            # the float32 RMSNorm and run in the compute dtype.
            h = h.astype(mx.float32)
        return h

    def hidden_dtype(self, dtype: mx.Dtype) -> mx.Dtype:
        """The residual stream's dtype for compute dtype `dtype` (what passes between stages)."""
        return mx.float32 if self.config.norms.residual_f32 else dtype

    def run_layers(
        self,
        h: mx.array,
        cache: list[Cache] | None = None,
        blocks: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        """The held blocks on the residual stream h (B, T, hidden); `cache`: one per held layer;
        `blocks` (T,): each position's image, -1 for text (one image's positions see each
        other both ways, multimodal.with_blocks); `positions` (T, rotary pairs): explicit
        RoPE positions (Qwen3.5's M-RoPE over an image)."""
        cfg = self.config
        t = h.shape[1]
        full_mask = "causal" if t > 1 else None  # aligned to the newest keys: works with a cache
        sliding_mask = None
        if any(self._sliding):
            i = self._sliding.index(True)
            if isinstance(cache[i] if cache is not None else None, CacheBatch):
                sliding_mask = None  # one new token per sequence sees its whole ring
            elif cache is not None:
                sliding_mask = cache[i].mask(t)
            elif t > 1 and cfg.is_chunked(self._held[i]):
                sliding_mask = window_mask(0, t, 0, t, None, cfg.attention.chunk_size)
            elif t > 1:
                sliding_mask = window_mask(0, t, 0, t, cfg.attention.sliding_window)
        if blocks is not None and t > 1:
            held = zip(self._held, self._sliding, strict=True)
            full = [j for j, (i, s) in enumerate(held) if not s and not cfg.is_linear(i)]
            if full:
                at = cache[full[0]].offset if cache is not None else 0
                full_mask = with_blocks(window_mask(at, t, 0, at + t, None), blocks, None)
            if sliding_mask is not None:
                sliding_mask = with_blocks(sliding_mask, blocks, cfg.attention.sliding_window)
        layers = self.model.layers
        for j, i in enumerate(self._held):
            mask = sliding_mask if self._sliding[j] else full_mask
            h = layers[i](h, mask, cache[j] if cache is not None else None, positions)
        return h

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        """Final norm and head: (B, T, hidden) -> logits (B, T, vocab) (T = 1 if last_only)."""
        cfg = self.config
        if last_only:  # prefill/decode need only the newest position's logits
            h = h[:, -1:, :]
        h = self.model.norm(h)
        if cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        if cfg.norms.final_logit_softcapping is not None:
            logits = softcap(logits, cfg.norms.final_logit_softcapping)
        return logits
