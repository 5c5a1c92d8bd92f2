"""Manifold-constrained hyper-connections (mHC; DeepSeek V4): the residual is N parallel
streams (B, T, N, hidden). Before a sublayer, a one-layer perceptron over the N streams
(flattened, RMS-normalised without a weight) gives three mixes: `pre` (N) collapses the
streams into the sublayer's input, `post` (N) spreads its output back over them, and `comb`
(N × N) mixes the streams into the new residual, made doubly stochastic by Sinkhorn-Knopp:
    out_n = post_n · f(Σ_m pre_m · h_m) + Σ_m comb_mn · h_m
The final head collapses the streams with a `pre` of its own. Everything runs in float32
(transformers keeps these weights there)."""

from __future__ import annotations

import mlx.core as mx


def _flat_norm(h: mx.array, eps: float) -> mx.array:
    """(B, T, N, hidden) -> (B, T, N·hidden) float32, RMS-normalised (no weight)."""
    b, t = h.shape[:2]
    x = h.reshape(b, t, -1).astype(mx.float32)  # (B, T, N·hidden)
    return x * mx.rsqrt(mx.square(x).mean(axis=-1, keepdims=True) + eps)


def mixes(
    h: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """The streams h (B, T, N, hidden) and a sublayer's fn ((2 + N)·N, N·hidden), base
    ((2 + N)·N), scale (3) -> (post (B, T, N), comb (B, T, N, N) doubly stochastic, the
    collapsed input (B, T, hidden))."""
    n = h.shape[2]
    w = _flat_norm(h, norm_eps) @ fn.astype(mx.float32).T  # (B, T, (2 + N)·N)
    base = base.astype(mx.float32)
    scale = scale.astype(mx.float32)
    pre = mx.sigmoid(w[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * mx.sigmoid(w[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = w[..., 2 * n :] * scale[2] + base[2 * n :]
    comb = mx.softmax(logits.reshape(*w.shape[:-1], n, n), axis=-1) + eps  # (B, T, N, N)
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn-Knopp: rows, then columns, to sum 1
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    collapsed = (pre[..., None] * h).sum(axis=2).astype(h.dtype)
    return post, comb, collapsed


def combine(post: mx.array, comb: mx.array, out: mx.array, h: mx.array) -> mx.array:
    """The new streams: post (B, T, N) spreading the sublayer's output out (B, T, hidden),
    plus the old streams h (B, T, N, hidden) mixed by combᵀ (stream m feeds stream n by
    comb[m, n])."""
    dt = h.dtype
    mixed = comb.astype(dt).swapaxes(-1, -2) @ h  # (B, T, N, hidden)
    return post.astype(dt)[..., None] * out[:, :, None, :] + mixed


def collapse(
    h: mx.array, fn: mx.array, base: mx.array, scale: mx.array, eps: float, norm_eps: float
) -> mx.array:
    """The head's collapse: h (B, T, N, hidden), fn (N, N·hidden), base (N), scale (1) ->
    (B, T, hidden)."""
    w = _flat_norm(h, norm_eps) @ fn.astype(mx.float32).T  # (B, T, N)
    pre = mx.sigmoid(w * scale.astype(mx.float32) + base.astype(mx.float32)) + eps
    return (pre[..., None] * h).sum(axis=2).astype(h.dtype)
