"""Scaled dot-product attention shared by the families: GQA without repeating K/V, an optional
logit softcap (Gemma 2), optional per-head sinks (gpt-oss: a logit each head's softmax also
normalises over, whose share of the probability goes to no value), the softmax in float32.

Three ways, same mathematics:
  kernel   runtime/nodes.py's one CPU node, for float32 queries (a decode step, a
           speculative verification; a prompt's chunk in blocks of queries and keys, on all
           cores) over dense keys, without cap or sinks.
  fused    mx.fast.scaled_dot_product_attention (no cap) — Metal and CUDA, or when the
           backend's fast_math is off (runtime/backend.py).
  explicit scores = q·kᵀ, mask, softmax, ·v — on the CPU with fastmath's softmax (MLX's CPU
           exp, used by its softmax, was half of a SmolLM2 prefill there), and for softcaps.
           A causal chunk is split into query blocks that skip the keys after the block, so
           the masked upper triangle is never exponentiated (~40% fewer scores at 512 tokens).
Quantized keys and values (cache/store.py's QArray) always take the explicit way (MLX's fused
attention takes no quantized operands), each product an `mx.quantized_matmul` on the packed
parts, so no full-precision copy of the cache is made. One exception, on the CPU only: a chunk
of queries (a prompt being read) multiplies one layer's keys and values dequantized, a copy
that lives for that layer's chunk, because there MLX's quantized products are its own loops
while dense ones go to BLAS (runtime/blas.py): SmolLM2's 512-token prefill took 4.5 s with
the packed products and 1.9 s so (1.9 s with dense caches); a single query keeps the packed
form (as fast as dequantizing, with no copy). A cache's full-precision tail (store.Tailed)
is its newest keys: their scores are concatenated after the quantized ones, and the
probabilities split between the two products.
"""

from __future__ import annotations

from mlxlis.cache import window_mask
from mlxlis.cache.store import QArray, Stored, Tailed
from mlxlis.runtime import backend, fused
from mlxlis.runtime.device import on_cpu

import mlx.core as mx

QUERY_BLOCK = 128  # causal query block (measured 64–128 best at 512 tokens; 128: fewer ops)


def softcap(x: mx.array, cap: float) -> mx.array:
    """Gemma 2's logit cap: tanh(x / c)·c."""
    return mx.tanh(x / cap) * cap


def attend(
    q: mx.array,
    k: Stored,
    v: Stored,
    scale: float,
    mask: str | mx.array | None,
    cap: float | None = None,
    sinks: mx.array | None = None,
    heads_last: bool = False,
) -> mx.array:
    """q: (B, n_heads, T, head_dim); k, v: (B, n_kv_heads, S, head_dim), newest keys last when
    mask is "causal" (aligned to the newest keys, so chunks after a cache work); an array mask
    is boolean (T, S), or (B, 1, T, S) per sequence, True = attend; sinks (n_heads,) logits.
    Returns (B, n_heads, T, head_dim), or (B, T, n_heads·head_dim) if `heads_last` (the output
    projection's input)."""
    packed = isinstance(k, (QArray, Tailed))
    if cap is None and sinks is None and not packed:
        out = fused.attend(q, k, v, scale, mask, heads_last)  # one CPU node for a few queries
        if out is not None:
            return out
    out = _attend(q, k, v, scale, mask, cap, sinks, packed)
    if heads_last:
        b, _, t, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(b, t, -1)
    return out


def _attend(
    q: mx.array,
    k: Stored,
    v: Stored,
    scale: float,
    mask: str | mx.array | None,
    cap: float | None,
    sinks: mx.array | None,
    packed: bool,
) -> mx.array:
    """`attend` by MLX's operations: (B, n_heads, T, head_dim)."""
    fast = backend.current().fast_math and on_cpu()  # its softmax is fastmath's (see above)
    if packed and q.shape[2] > 1 and on_cpu():
        k, v = k.dequantize(), v.dequantize()  # this layer's, for this chunk (see above)
        packed = False
    if cap is None and not fast and not packed:
        return mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=None if sinks is None else sinks.astype(q.dtype)
        )
    t, s = q.shape[2], k.shape[2]
    if isinstance(mask, str) and fast and t > QUERY_BLOCK:
        outs = []
        for b0 in range(0, t, QUERY_BLOCK):
            b1 = min(t, b0 + QUERY_BLOCK)
            end = s - t + b1  # the last key any query of this block sees
            outs.append(
                _explicit(
                    q[:, :, b0:b1], k[:, :, :end], v[:, :, :end], scale, mask, cap, fast, sinks
                )
            )
        return mx.concatenate(outs, axis=2)
    return _explicit(q, k, v, scale, mask, cap, fast, sinks)


def _explicit(q, k, v, scale, mask, cap, fast, sinks=None) -> mx.array:
    b, h, t, hd = q.shape
    n_kv, s = k.shape[1], k.shape[2]
    q = q.reshape(b, n_kv, h // n_kv, t, hd)  # (B, n_kv_heads, group, T, head_dim)
    if cap is None:  # scale q, the smaller operand, as the fused kernel does
        scores = product(q * mx.array(scale, q.dtype), k, True)  # (B, n_kv, group, T, S)
    else:  # Gemma 2 as transformers: scale the scores, then tanh(s / c)·c, then mask, softmax
        scores = softcap(product(q, k, True) * scale, cap)
    if isinstance(mask, str):  # "causal", aligned to the newest keys as the fused kernel does
        mask = window_mask(s - t, t, 0, s, None) if t > 1 else None
    if mask is not None:
        if mask.ndim == 4:  # per sequence (B, 1, T, S): broadcast over the KV groups
            mask = mask[:, :, None]
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    if sinks is not None:  # one more logit per head and query, dropped after the softmax
        sink = sinks.astype(scores.dtype).reshape(n_kv, h // n_kv, 1, 1)
        scores = mx.concatenate([scores, mx.broadcast_to(sink, (*scores.shape[:-1], 1))], -1)
    probs = backend.current().softmax(scores)
    if fast:  # fastmath's is float32
        probs = probs.astype(v.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    out = product(probs, v, False)  # (B, n_kv, group, T, head_dim)
    return out.reshape(b, h, t, hd)


def product(x: mx.array, kv: Stored | Tailed, keys: bool) -> mx.array:
    """x (B, n_kv, group, T, ·) times one KV head's keys transposed (`keys`) or its values,
    broadcast over the group; quantized operands multiply in their packed form, a tailed one
    in its two parts (scores side by side; probabilities split at the tail)."""
    if isinstance(kv, Tailed):
        if keys:
            return mx.concatenate([product(x, kv.head, True), product(x, kv.tail, True)], -1)
        n = kv.head.shape[2]
        return product(x[..., :n], kv.head, False) + product(x[..., n:], kv.tail, False)
    if isinstance(kv, QArray):
        f = kv.fmt
        parts = [p[:, :, None] for p in kv.parts]
        return mx.quantized_matmul(x, *parts, transpose=keys, group_size=f.group_size, bits=f.bits)
    kv = kv[:, :, None]
    return x @ (kv.swapaxes(-1, -2) if keys else kv)
