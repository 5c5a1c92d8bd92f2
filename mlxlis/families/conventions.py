"""What converters fold into the weights, undone by named pure functions.

Which ones apply is data: each family's `Family.gguf_conventions` (safetensors checkpoints are
in the Hugging Face convention already). The file format says whether a convention was
applied; tensor values are never used to guess it.
"""

from __future__ import annotations

import mlx.core as mx

from .base import Convention


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's `LlamaModel.permute` of attn_q/attn_k rows (its interleaved RoPE layout).

    permute: rows (n_heads, 2, half, ...) -> (n_heads, half, 2, ...); this is its inverse. Rows
    are independent in MLX's quantized layout, so it applies to packed codes, scales and biases.
    """
    rows = w.shape[0]
    rest = w.shape[1:]
    # (n_heads, half, 2, ...) -> (n_heads, 2, half, ...)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gemma_norm_minus_one(w: mx.array) -> mx.array:
    """Undo llama.cpp's +1 on Gemma norm weights (Gemma computes x̂·(1 + w))."""
    return w.astype(mx.float32) - 1.0


def _is_q(name: str) -> bool:
    return ".self_attn.q_proj." in name


def _is_k(name: str) -> bool:
    return ".self_attn.k_proj." in name


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


UNPERMUTE_Q: Convention = (_is_q, lambda w, c, _: unpermute_rows(w, c.num_attention_heads))
UNPERMUTE_K: Convention = (_is_k, lambda w, c, _: unpermute_rows(w, c.num_key_value_heads))
NORM_MINUS_ONE: Convention = (_is_norm, lambda w, c, _: gemma_norm_minus_one(w))


def _is_zero_centred_norm(name: str) -> bool:
    return name.endswith("norm.weight") and ".linear_attn.norm." not in name


# Qwen3.5: llama.cpp and mlx-lm add 1 to the zero-centred norms, not to DeltaNet's gated norm
ZERO_CENTRED_NORM_MINUS_ONE: Convention = (
    _is_zero_centred_norm,
    lambda w, c, _: gemma_norm_minus_one(w),
)
