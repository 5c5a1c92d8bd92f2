"""What converters fold into the weights, undone by named pure functions.

Which ones apply is data: each family's `Family.gguf.conventions` (safetensors checkpoints are
in the Hugging Face convention already). The file format says whether a convention was
applied; tensor values are never used to guess it.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxlis.models.base import Convention

import mlx.core as mx


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
# the same permute of a block whose attention is its `mixer` (Nemotron-H; no RoPE there, but
# llama.cpp's converter permutes all the same)
MIXER_UNPERMUTE_Q: Convention = (
    lambda n: ".mixer.q_proj." in n,
    lambda w, c, _: unpermute_rows(w, c.num_attention_heads),
)
MIXER_UNPERMUTE_K: Convention = (
    lambda n: ".mixer.k_proj." in n,
    lambda w, c, _: unpermute_rows(w, c.num_key_value_heads),
)
# conventions that reorder a weight's rows alone: they apply as they are to a LoRA's B (out, r),
# since rows(B·A) = rows(B)·A (llama.cpp's converter permutes lora_b so: LoraTorchTensor.permute)
ROW_ONLY: tuple[Convention, ...] = (UNPERMUTE_Q, UNPERMUTE_K)


def is_zero_centred_norm(name: str) -> bool:
    return name.endswith("norm.weight") and ".linear_attn.norm." not in name


# Qwen3.5: llama.cpp and mlx-lm add 1 to the zero-centred norms, not to DeltaNet's gated norm
ZERO_CENTRED_NORM_MINUS_ONE: Convention = (
    is_zero_centred_norm,
    lambda w, c, _: gemma_norm_minus_one(w),
)


# --- Qwen3.5 in llama.cpp's layout (conversion/qwen.py, _LinearAttentionVReorderBase and
# Qwen3NextModel.modify_tensors). llama.cpp pairs value head h with q/k head h mod Kh (tiled);
# transformers pairs it with h div (Vh/Kh) (grouped). The converter so reorders every V-head
# axis from [Kh, Vh/Kh] to [Vh/Kh, Kh]; undone below by the inverse swap. Rows of MLX's
# quantized layout are independent and a head's columns are whole groups, so each reorder
# applies to packed codes, scales and biases alike.


def untile_heads(w: mx.array, kh: int, vh: int, axis: int) -> mx.array:
    """Along `axis` (Vh heads of equal width): [Vh/Kh, Kh, width] -> [Kh, Vh/Kh, width]."""
    if kh == vh:
        return w
    if w.shape[axis] % vh:  # a head's columns are not whole quantization groups
        from mlxlis.errors import UnsupportedError

        raise UnsupportedError(
            f"{vh} value heads do not split {w.shape[axis]} quantized columns evenly; "
            "load this file with dequantize=True (--dequantize)",
            field="ssm_out",
        )
    w = mx.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    width = w.shape[0] // vh
    w = w.reshape(vh // kh, kh, width, *rest).swapaxes(0, 1).reshape(vh * width, *rest)
    return mx.moveaxis(w, 0, axis)


def _v_rows_of_qkv(w: mx.array, c, part: str) -> mx.array:
    """in_proj_qkv / conv1d: rows [Q | K | V]; only the V rows are reordered."""
    net = c.deltanet
    kd = net.num_key_heads * net.key_head_dim
    v = untile_heads(w[2 * kd :], net.num_key_heads, net.num_value_heads, 0)
    return mx.concatenate([w[: 2 * kd], v], axis=0)


def _ends(*suffixes: str) -> Callable[[str], bool]:
    return lambda name: name.endswith(suffixes)


def _heads(axis: int):
    return lambda w, c, _: untile_heads(
        w, c.deltanet.num_key_heads, c.deltanet.num_value_heads, axis
    )


# conv1d is stored squeezed, (C, kernel): back to transformers' (C, 1, kernel)
_CONV_UNSQUEEZED: Convention = (
    _ends("linear_attn.conv1d.weight"),
    lambda w, c, _: w.reshape(w.shape[0], 1, -1),
)
# the converter stores A = −exp(A_log)
_A_LOG: Convention = (_ends("linear_attn.A_log"), lambda w, c, _: mx.log(-w.astype(mx.float32)))

QWEN35_GGUF: tuple[Convention, ...] = (
    _CONV_UNSQUEEZED,
    (
        _ends(
            "linear_attn.in_proj_qkv.weight",
            "linear_attn.in_proj_qkv.scales",
            "linear_attn.in_proj_qkv.biases",
            "linear_attn.conv1d.weight",
        ),
        _v_rows_of_qkv,
    ),
    (
        _ends(
            *(
                f"linear_attn.{n}.{p}"
                for n in ("in_proj_z", "in_proj_a", "in_proj_b")
                for p in ("weight", "scales", "biases")
            )
        ),
        _heads(0),
    ),
    (_ends("linear_attn.A_log", "linear_attn.dt_bias"), _heads(0)),
    (
        _ends(
            "linear_attn.out_proj.weight",
            "linear_attn.out_proj.scales",
            "linear_attn.out_proj.biases",
        ),
        _heads(-1),
    ),
    _A_LOG,
    ZERO_CENTRED_NORM_MINUS_ONE,  # llama.cpp adds 1 to the zero-centred norms
)
# Qwen3-Next in llama.cpp's layout: its value heads stay grouped as transformers has them
QWEN3NEXT_GGUF: tuple[Convention, ...] = (_CONV_UNSQUEEZED, _A_LOG, ZERO_CENTRED_NORM_MINUS_ONE)
