"""Llama-style decoder: Llama 2/3 (and Mistral) and Qwen2.

Module attribute names equal the Hugging Face tensor names, so a checkpoint binds by name.
Differences between the two families are ModelConfig fields (q/k/v bias, tying, RoPE).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..config import ModelConfig
from .activations import gated
from .attention import attend
from .rope import Rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=cfg.o_bias)
        self.rope = rope

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, T, head_dim)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset)
        k = self.rope(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
        self.act = gated("silu")

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, mask: str | mx.array | None, cache: KVCache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Model(nn.Module):
    """inputs (B, T) token ids -> logits (B, T, vocab) in the compute dtype (T = 1 if last_only)."""

    def __init__(self, cfg: ModelConfig, rope_freq_factors: mx.array | None = None):
        super().__init__()
        self.config = cfg
        self._rope_freq_factors = rope_freq_factors  # GGUF rope_freqs; a buffer, not a parameter
        rope = Rope(cfg.head_dim, cfg.rope, rope_freq_factors)  # one module, shared by layers
        self.model = LlamaModel(cfg, rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]

    def __call__(
        self, inputs: mx.array, cache: list[KVCache] | None = None, last_only: bool = False
    ) -> mx.array:
        h = self.model.embed_tokens(inputs)
        # (B, T, hidden); "causal" aligns to the newest keys, so chunked prefill works with a cache
        mask = "causal" if inputs.shape[1] > 1 else None
        for i, layer in enumerate(self.model.layers):
            h = layer(h, mask, cache[i] if cache is not None else None)
        if last_only:  # prefill/decode need only the newest position's logits
            h = h[:, -1:, :]
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)
