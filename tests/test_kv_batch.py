"""KVBatch (mlxlis/cache/batch.py): the caches of sequences decoding together, stacked for one
masked attention per step.

Proves, against each cache's own one-token step (update_and_fetch, then attention over exactly
its keys, the path every lone decode takes): the stacked step's attention output per row,
for KV caches of different lengths (one growing past the batch's 256-slot capacity) and
sliding-window rings still filling and already wrapped; that the caches' keys, values and
counters read back afterwards (the batch dissolving) are exactly a lone run's; that a lone step,
a trim and a change of the batch's members each take the rows back first; and that the batch's
buffers are freed once every row is back. Self-consistency with the per-sequence path, whose
parity with transformers is in the families' tests.
"""

from __future__ import annotations

import copy

from mlxlis.cache import KVBatch, KVCache, RotatingKVCache
from mlxlis.models.attention import attend

import mlx.core as mx
import numpy as np
import pytest

KV, GROUP, D = 2, 3, 16
rng = np.random.default_rng(0)


def rand(*shape: int) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def filled(cache, n: int):
    """`cache` after a prompt of n positions (random keys/values)."""
    if n:
        cache.update_and_fetch(rand(1, KV, n, D), rand(1, KV, n, D))
    return cache


def lone_step(cache, q, k, v) -> mx.array:
    keys, values = cache.update_and_fetch(k, v)
    return attend(q, keys, values, D**-0.5, None)


def batch_step(caches, q, k, v) -> mx.array:
    keys, values, mask = KVBatch.step_of(caches, k, v)
    return attend(q, keys, values, D**-0.5, mask)


def check_steps(caches: list, twins: list, steps: int) -> None:
    for _ in range(steps):
        b = len(caches)
        q, k, v = rand(b, KV * GROUP, 1, D), rand(b, KV, 1, D), rand(b, KV, 1, D)
        got = batch_step(caches, q, k, v)
        want = mx.concatenate(
            [lone_step(t, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i, t in enumerate(twins)]
        )
        # the same scores; the masked softmax sums over the padded row (zeros for the masked
        # slots), which may round its last bit differently from the unpadded one
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def same_contents(c, twin) -> None:
    """Counters equal and the valid slots bit for bit (keys read back through the batch)."""
    assert (c.offset, c.held) == (twin.offset, twin.held)
    n = c.held
    assert np.array_equal(np.array(c.keys[..., :n, :]), np.array(twin.keys[..., :n, :]))
    assert np.array_equal(np.array(c.values[..., :n, :]), np.array(twin.values[..., :n, :]))


@pytest.mark.parametrize("kind", ["kv", "ring"])
def test_stacked_steps_equal_each_lone_step(kind):
    if kind == "kv":  # 254 + 4 steps crosses the 256-slot capacity; 300 starts past it
        caches = [filled(KVCache(), n) for n in (5, 254, 300, 1)]
    else:  # window 8: still filling (3, 7) and wrapped (20: the next slot is mid-ring)
        caches = [filled(RotatingKVCache(8), n) for n in (3, 7, 20, 8)]
    twins = copy.deepcopy(caches)
    check_steps(caches, twins, 6)
    batch = caches[0]._batch
    assert batch is not None and all(c._batch is batch for c in caches)
    for c, t in zip(caches, twins, strict=True):
        same_contents(c, t)  # the first read dissolves the batch
    assert batch.keys is None and all(c._batch is None for c in caches)
    check_steps(caches, twins, 2)  # stacked again from the handed-back rows


def test_lone_step_trim_and_new_members_take_the_rows_back():
    caches = [filled(KVCache(), n) for n in (4, 9, 17)]
    twins = copy.deepcopy(caches)
    check_steps(caches, twins, 3)
    # a lone step on one of them: every row goes back first, then it steps on its own
    q, k, v = rand(1, KV * GROUP, 1, D), rand(1, KV, 1, D), rand(1, KV, 1, D)
    np.testing.assert_array_equal(
        np.array(lone_step(caches[1], q, k, v)), np.array(lone_step(twins[1], q, k, v))
    )
    assert all(c._batch is None for c in caches)
    check_steps(caches, twins, 2)
    # a trim (a prefix reused) forgets positions of the handed-back row
    assert caches[2].trim(5) == twins[2].trim(5) == 5
    assert caches[2]._batch is None
    # other members, another order: a new batch; the old rows are handed back first
    check_steps([caches[2], caches[0]], [twins[2], twins[0]], 3)
    for c, t in zip(caches, twins, strict=True):
        same_contents(c, t)


def test_rows_handed_back_free_the_stacked_buffers():
    """Once the rows are back, nothing holds the stacked (B, kv, cap, D) buffers: each cache's
    row is a copy made at once, not a lazy one that would keep the whole stack alive while the
    cache sits unevaluated (in the prefix cache)."""
    caches = [filled(KVCache(), n) for n in (100, 200)]
    mx.eval([c.state for c in caches])
    q, k, v = rand(2, KV * GROUP, 1, D), rand(2, KV, 1, D), rand(2, KV, 1, D)
    mx.eval(batch_step(caches, q, k, v))
    del q, k, v
    before = mx.get_active_memory()  # the caches' 2 x 256 slots stacked, keys and values
    caches[0]._settle()  # hands every row back, as reading a state for the prefix cache does
    rows = sum(a.nbytes for c in caches for a in (c._keys, c._values))  # 101 + 201 slots
    assert rows < before
    stacked = 2 * 2 * KV * 256 * D * 4
    # freed: the stack, less the rows copied out (and a few small arrays of the step's, such
    # as its mask: far less than the stack, which a lazy copy would have kept whole)
    assert mx.get_active_memory() <= before - stacked + rows + stacked // 4
