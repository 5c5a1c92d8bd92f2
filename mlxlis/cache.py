"""KV caches: a preallocated cache grown in steps, and a rotating one for sliding-window layers."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys/values of every past position, preallocated in blocks of `step` positions."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys/values: (B, n_kv_heads, T, head_dim)
        prev = self.offset
        t = keys.shape[2]
        if self.keys is None or prev + t > self.keys.shape[2]:
            b, h, _, d = keys.shape
            n_steps = (self.step + t - 1) // self.step
            k_new = mx.zeros((b, h, n_steps * self.step, d), keys.dtype)
            v_new = mx.zeros((b, h, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys[..., :prev, :], k_new], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], v_new], axis=2)
            else:
                self.keys, self.values = k_new, v_new
        self.offset += t
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (for reusing a common prefix); returns how many."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]
