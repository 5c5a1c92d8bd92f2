"""Gemma 1, 2 and 3 (text) decoders: one forward pass, the differences are ModelConfig fields.

Module attribute names equal the Hugging Face tensor names, so a checkpoint binds by name.
  Gemma 1: pre-norm blocks, GeGLU, x̂·(1 + w) RMSNorm, embedding × √hidden, tied head.
  Gemma 2: + sandwich norms (post-attention / pre- and post-feed-forward), attention-logit and
           final-logit softcaps, scale 1/√query_pre_attn_scalar, sliding-window layers.
  Gemma 3: + q_norm / k_norm over head_dim, a local RoPE base for sliding layers, global RoPE
           with linear scaling for full layers, usually no softcaps.
Sliding layers see keys in (p − window, p] (transformers' `kv_idx > q_idx - sliding_window`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache, RotatingKVCache, window_mask
from ..config import ModelConfig
from .activations import gated
from .attention import attend, softcap
from .rope import Rope

Cache = KVCache | RotatingKVCache


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x̂·(1 + w), reduced and multiplied in float32, cast after the multiply
    (as transformers' GemmaRMSNorm; casting before the multiply, as plain RMSNorm does, or
    forming 1 + w in float16 changes about a third of the float16 outputs by one ulp)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        w = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), w, self.eps).astype(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.scale = cfg.attn_scale  # 1/√query_pre_attn_scalar (Gemma 2/3) or 1/√head_dim
        self.softcap = cfg.attn_logit_softcapping
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=cfg.o_bias)
        if cfg.family == "gemma3":
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: Cache | None) -> mx.array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, T, head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, self.scale, mask, self.softcap)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act = gated(cfg.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))  # GeGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.sandwich = cfg.family != "gemma"  # Gemma 2/3 also norm each sublayer's output
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def __call__(self, h: mx.array, mask: str | mx.array | None, cache: Cache | None) -> mx.array:
        # h is the float32 residual stream; the sublayers run in the compute dtype
        if not self.sandwich:
            h = h + self.self_attn(self.input_layernorm(h), mask, cache)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ropes: list[Rope]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, ropes[i]) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """inputs (B, T) token ids -> logits (B, T, vocab) in the compute dtype (T = 1 if last_only)."""

    def __init__(self, cfg: ModelConfig, rope_freq_factors: mx.array | None = None):
        super().__init__()
        self.config = cfg
        self._rope_freq_factors = rope_freq_factors  # GGUF rope_freqs; a buffer, not a parameter
        rope = Rope(cfg.head_dim, cfg.rope, rope_freq_factors)  # global (full-attention) layers
        local = Rope(cfg.head_dim, cfg.rope_local) if cfg.rope_local is not None else rope
        # underscore: plain data, not part of the parameter tree
        self._sliding = tuple(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers))
        self.model = GemmaModel(cfg, [local if s else rope for s in self._sliding])
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_cache(self) -> list[Cache]:
        w = self.config.sliding_window
        return [RotatingKVCache(w) if s else KVCache() for s in self._sliding]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Multimodal Gemma 3 checkpoints: keep the language model's tensors under our names
        (hub `language_model.model.*`, transformers-5 `model.language_model.*`), drop vision."""
        renames = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
        vision = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                  "model.multi_modal_projector.")
        out = {}
        for name, arr in weights.items():
            if name.startswith(vision):
                continue
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = arr
        return out

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None,
                 last_only: bool = False) -> mx.array:
        cfg = self.config
        t = inputs.shape[1]
        h = self.model.embed_tokens(inputs)
        # the normalizer √hidden is rounded to the compute dtype first, as transformers does
        h = h * mx.array(cfg.hidden_size**0.5, mx.float32).astype(h.dtype)
        # The residual stream is kept in float32 whatever the compute dtype: Gemma's outgrows
        # float16's 65 504 (Gemma 3 270M reaches 1.04e5 within 300 tokens; a float16 residual
        # turned all of its logits NaN, clipping adds to ±65 504 as mlx-lm does left them off by
        # up to 15.7). Sublayers read it through the float32 RMSNorm and run in the compute
        # dtype; the cost is one (B, T, hidden) float32 array.
        h = h.astype(mx.float32)
        full_mask = "causal" if t > 1 else None  # aligned to the newest keys: works with a cache
        sliding_mask = None
        if any(self._sliding):
            i = self._sliding.index(True)
            if cache is not None:
                sliding_mask = cache[i].mask(t)
            elif t > 1:
                sliding_mask = window_mask(0, t, 0, t, cfg.sliding_window)
        for i, layer in enumerate(self.model.layers):
            mask = sliding_mask if self._sliding[i] else full_mask
            h = layer(h, mask, cache[i] if cache is not None else None)
        if last_only:  # prefill/decode need only the newest position's logits
            h = h[:, -1:, :]
        h = self.model.norm(h)
        if cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        if cfg.final_logit_softcapping is not None:
            logits = softcap(logits, cfg.final_logit_softcapping)
        return logits
