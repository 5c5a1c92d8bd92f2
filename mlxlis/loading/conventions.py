"""Undo what converters folded into the weights, as named pure functions.

Which functions apply is data: CONVENTIONS[(family, format)]. The file format says whether a
convention was applied; tensor values are never used to guess it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..config import ModelConfig


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


# A convention: (applies to this module tensor name?, transform(tensor, cfg, part)).
# `part` is "weight" | "scales" | "biases" | "bias" (the array being transformed).
Convention = tuple[Callable[[str], bool], Callable[[mx.array, ModelConfig, str], mx.array]]


def _is_q(name: str) -> bool:
    return ".self_attn.q_proj." in name


def _is_k(name: str) -> bool:
    return ".self_attn.k_proj." in name


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


UNPERMUTE_Q: Convention = (_is_q, lambda w, c, _: unpermute_rows(w, c.num_attention_heads))
UNPERMUTE_K: Convention = (_is_k, lambda w, c, _: unpermute_rows(w, c.num_key_value_heads))
NORM_MINUS_ONE: Convention = (_is_norm, lambda w, c, _: gemma_norm_minus_one(w))

CONVENTIONS: dict[tuple[str, str], tuple[Convention, ...]] = {
    ("llama", "gguf"): (UNPERMUTE_Q, UNPERMUTE_K),  # llama.cpp permutes Q/K for llama only
    ("qwen2", "gguf"): (),
    ("gemma", "gguf"): (NORM_MINUS_ONE,),
    ("gemma2", "gguf"): (NORM_MINUS_ONE,),
    ("gemma3", "gguf"): (NORM_MINUS_ONE,),  # q_norm / k_norm included
}


def undo(name: str, arr: mx.array, cfg: ModelConfig, fmt: str, part: str) -> mx.array:
    """Apply every convention of (family, format) that matches module tensor `name`."""
    for applies, fn in CONVENTIONS.get((cfg.family, fmt), ()):
        if applies(name):
            arr = fn(arr, cfg, part)
    return arr
