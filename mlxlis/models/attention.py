"""Scaled dot-product attention shared by the families: GQA without repeating K/V, an optional
logit softcap (Gemma 2), the softmax in float32.

Two ways, same mathematics:
  fused    mx.fast.scaled_dot_product_attention (no cap) — Metal and CUDA, or when
           mlxlis.runtime.fastmath is off.
  explicit scores = q·kᵀ, mask, softmax, ·v — on the CPU with mlxlis.runtime.fastmath on (MLX's CPU
           exp, used by its softmax, was half of a SmolLM2 prefill there), and for softcaps.
           A causal chunk is split into query blocks that skip the keys after the block, so
           the masked upper triangle is never exponentiated (~40% fewer scores at 512 tokens).
"""

from __future__ import annotations

from mlxlis.cache import window_mask
from mlxlis.runtime import fastmath

import mlx.core as mx

QUERY_BLOCK = 128  # causal query block (measured 64–128 best at 512 tokens; 128: fewer ops)


def softcap(x: mx.array, cap: float) -> mx.array:
    """Gemma 2's logit cap: tanh(x / c)·c."""
    return mx.tanh(x / cap) * cap


def attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: str | mx.array | None,
    cap: float | None = None,
) -> mx.array:
    """q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, S, head_dim), newest keys last when
    mask is "causal" (aligned to the newest keys, so chunks after a cache work); an array mask
    is boolean (T, S), or (B, 1, T, S) per sequence, True = attend. Returns
    (B, n_heads, T, head_dim)."""
    fast = fastmath.enabled()
    if cap is None and not fast:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    t, s = q.shape[2], k.shape[2]
    if isinstance(mask, str) and fast and t > QUERY_BLOCK:
        outs = []
        for b0 in range(0, t, QUERY_BLOCK):
            b1 = min(t, b0 + QUERY_BLOCK)
            end = s - t + b1  # the last key any query of this block sees
            outs.append(
                _explicit(q[:, :, b0:b1], k[:, :, :end], v[:, :, :end], scale, mask, cap, fast)
            )
        return mx.concatenate(outs, axis=2)
    return _explicit(q, k, v, scale, mask, cap, fast)


def _explicit(q, k, v, scale, mask, cap, fast) -> mx.array:
    b, h, t, hd = q.shape
    n_kv, s = k.shape[1], k.shape[2]
    q = q.reshape(b, n_kv, h // n_kv, t, hd)  # (B, n_kv_heads, group, T, head_dim)
    kt = k[:, :, None].swapaxes(-1, -2)
    if cap is None:  # scale q, the smaller operand, as the fused kernel does
        scores = (q * mx.array(scale, q.dtype)) @ kt  # (B, n_kv, group, T, S)
    else:  # Gemma 2 as transformers: scale the scores, then tanh(s / c)·c, then mask, softmax
        scores = softcap((q @ kt) * scale, cap)
    if isinstance(mask, str):  # "causal", aligned to the newest keys as the fused kernel does
        mask = window_mask(s - t, t, 0, s, None) if t > 1 else None
    if mask is not None:
        if mask.ndim == 4:  # per sequence (B, 1, T, S): broadcast over the KV groups
            mask = mask[:, :, None]
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    if fast:
        probs = fastmath.softmax(scores).astype(v.dtype)
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs @ v[:, :, None]  # (B, n_kv, group, T, head_dim)
    return out.reshape(b, h, t, hd)
