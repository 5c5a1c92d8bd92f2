"""The gated short convolution, LFM2's recurrent mixer.

Per position, with in_proj splitting into three hidden-wide parts B, C and x:

    y_t = C_t ⊙ Σ_j w_j ⊙ (B ⊙ x)_{t − L + 1 + j}     (j = 0 .. L − 1, depthwise, causal)

then out_proj. The convolution sees the gated input B ⊙ x, so its state is the last L − 1 gated
inputs: a RecurrentCache's `conv_state` (its `recurrent` stays None), which snapshots for prefix
reuse, keeps the state after each verified token for a speculative rewind, batches through
CacheBatch and exports to the disk cache as the Gated DeltaNet's does. No activation follows the
convolution. Parameter names equal the Hugging Face names (`conv.in_proj`, `conv.conv`,
`conv.out_proj`); the kernel is (C, 1, L) as torch's depthwise Conv1d keeps it.
"""

from __future__ import annotations

from mlxlis.cache import CacheBatch, RecurrentCache

import mlx.core as mx
import mlx.nn as nn


class ShortConv(nn.Module):
    """(B, T, hidden) -> (B, T, hidden): the gated short convolution of kernel `kernel` (L)."""

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.kernel = kernel
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Module()
        self.conv.weight = mx.zeros((hidden, 1, kernel))  # torch's depthwise (C, 1, L)
        if bias:
            self.conv.bias = mx.zeros((hidden,))
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def __call__(self, x: mx.array, cache: RecurrentCache | CacheBatch | None) -> mx.array:
        if isinstance(cache, CacheBatch):  # sequences decoding together: their states stacked
            return self._batch(x, cache.caches)
        b_gate, c_gate, h = mx.split(self.in_proj(x), 3, axis=-1)  # (B, T, hidden) each
        xp = self._with_state(b_gate * h, cache)  # (B, L − 1 + T, hidden)
        return self.out_proj(c_gate * self._conv(xp))

    def _with_state(self, bx: mx.array, cache: RecurrentCache | None) -> mx.array:
        """The cached last L − 1 gated inputs, then bx (B, T, C): (B, L − 1 + T, C); the cache
        keeps the newest L − 1 (and, when a rewind is expected, those after each token but the
        last: `RecurrentCache.kept`)."""
        n = self.kernel - 1
        before = cache.conv_state if cache is not None else None
        if before is None:
            before = mx.zeros((bx.shape[0], n, bx.shape[2]), bx.dtype)
        xp = mx.concatenate([before.astype(bx.dtype), bx], axis=1)
        if cache is None:
            return xp
        t = bx.shape[1]
        steps = []  # (offset, conv state, no recurrent state) after token i
        for i in range(max(0, t - 1 - cache.keep), t - 1) if cache.keep else ():
            steps.append((cache.offset + i + 1, mx.contiguous(xp[:, i + 1 : i + 1 + n]), None))
        cache.conv_state = xp[:, -n:]
        cache.kept(steps)
        cache.offset += t
        return xp

    def _conv(self, xp: mx.array) -> mx.array:
        """Causal depthwise convolution. xp: (B, L − 1 + T, C) -> (B, T, C)."""
        t = xp.shape[1] - (self.kernel - 1)
        w = self.conv.weight[:, 0, :].astype(xp.dtype)  # (C, L)
        y = sum(xp[:, j : j + t] * w[:, j] for j in range(self.kernel))
        if "bias" in self.conv:
            y = y + self.conv.bias.astype(xp.dtype)
        return y

    def _batch(self, x: mx.array, caches: list[RecurrentCache]) -> mx.array:
        """One token for each of B sequences (x: (B, 1, hidden)), each with its own state (T
        tokens each, a batched verification, or a fresh state: each row on its own)."""
        if x.shape[1] > 1 or any(c.conv_state is None for c in caches):
            return mx.concatenate([self(x[i : i + 1], c) for i, c in enumerate(caches)])
        both = RecurrentCache()
        both.conv_state = mx.concatenate([c.conv_state for c in caches])
        out = self(x, both)
        for i, c in enumerate(caches):
            c.conv_state = both.conv_state[i : i + 1]
            c.offset += 1
        return out
