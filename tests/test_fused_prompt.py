"""The attention of a prompt's chunk as one CPU node (runtime/kernels/src/fused_flash.cpp:
query blocks against key blocks, an online softmax, all cores) against independent
references: float64 numpy attention within a float32 rounding bound, MLX's own
mx.fast.scaled_dot_product_attention on the same inputs, and transformers' logits for tiny
Llama and Qwen2 checkpoints fed a prompt in chunks over their cache.

Inputs take the forms a prefill gives them: a chunk of T > 16 queries (several query blocks,
the last one partial) against a cache's longer keys, strided slices of its buffer, grouped
heads (one KV head's query heads together, split past 8), head widths that are and are not
multiples of 64, causal masks aligned to the newest keys, boolean sliding-window and per-row
masks (blocks a window hides skipped).
"""

from __future__ import annotations

import mlxlis
from mlxlis.runtime import fused, kernels, nodes

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import trajectory
from test_fused import U, attend_ref, f64

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"kernels not built: {kernels.why()}")
rng = np.random.default_rng(11)


def window_keep(t: int, s: int, window: int) -> np.ndarray:
    """(T, S): query i (at position s - t + i) sees the `window` newest keys up to its own."""
    pos = s - t + np.arange(t)[:, None]
    j = np.arange(s)
    return (j <= pos) & (j > pos - window)


CASES = [
    # b, h, hkv, t, s, d, dv, mask
    (1, 14, 2, 100, 300, 64, 64, "causal"),  # Qwen2.5-0.5B's heads: 7 query heads a KV head
    (2, 6, 2, 17, 17, 64, 64, "causal"),  # just past the few-query kernel, no cache
    (1, 16, 1, 40, 130, 128, 128, "causal"),  # 16 query heads of one KV head: two items
    (1, 4, 4, 70, 200, 80, 80, "causal"),  # 80 wide: 64 columns in registers, 16 one by one
    (1, 9, 3, 50, 250, 64, 64, "window"),  # a window of 20: early key blocks skipped
    (3, 6, 2, 33, 90, 32, 32, "rows"),  # each row its own keys, as a batched prompt
    (1, 4, 2, 48, 48, 64, 64, None),  # bidirectional (an encoder's)
]


@pytest.mark.parametrize("b,h,hkv,t,s,d,dv,mask", CASES)
def test_prompt_attention(b, h, hkv, t, s, d, dv, mask):
    """Within a float32 bound of float64 attention and of MLX's fused attention, and no further
    from float64 than 4x MLX's own distance (measured: 0.8x to 1.2x); the heads-last layout
    holds the same bits."""
    kbuf = mx.array(rng.standard_normal((b, hkv, s + 37, d)).astype(np.float32))
    vbuf = mx.array(rng.standard_normal((b, hkv, s + 37, dv)).astype(np.float32))
    k, v = kbuf[:, :, :s], vbuf[:, :, :s]  # a cache's keys: a strided slice of its buffer
    q = mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32) * 2)
    keep = np.ones((b, 1, t, s), bool)
    if mask == "causal":
        keep &= window_keep(t, s, s)
        arg = "causal"
    elif mask == "window":
        keep &= window_keep(t, s, 20)
        arg = mx.array(keep[0, 0])
    elif mask == "rows":
        lens = np.array([s, 40, 75])[:b]
        keep &= window_keep(t, s, s) & (np.arange(s) >= s - lens[:, None])[:, None, None, :]
        arg = mx.array(keep)
    else:
        arg = None
    scale = d**-0.5
    got = fused.attend(q, k, v, scale, arg)
    assert got is not None and got.shape == (b, h, t, dv)
    ref, smax = attend_ref(f64(q), f64(k), f64(v), scale, keep)
    # a score's error ≤ d·u·smax moves its probability by that relative amount; the online
    # softmax's rescaling adds a rounding per key block (s / 64) and the values' sums 64 +
    # s / 64 terms, each within u of the largest |v|
    vmax = np.abs(f64(v)).max()
    bound = (4 * d * U * max(smax, 1.0) + 4 * (64 + s // 64 + s // 64) * U) * vmax
    assert np.abs(f64(got) - ref).max() <= bound
    mine = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=arg)
    assert np.abs(f64(got) - f64(mine)).max() <= 2 * bound
    assert np.abs(f64(got) - ref).max() <= 4 * np.abs(f64(mine) - ref).max()
    flat = fused.attend(q, k, v, scale, arg, heads_last=True)
    assert np.array_equal(f64(flat), f64(got.transpose(0, 2, 1, 3).reshape(b, t, -1)))


def test_prompts_off_leaves_them_to_mlx(monkeypatch):
    """nodes.PROMPTS off: more than MAX_QUERIES queries are not taken (MLX's products run
    them); a few still are."""
    monkeypatch.setattr(nodes, "PROMPTS", False)
    q = mx.zeros((1, 2, nodes.MAX_QUERIES + 1, 8))
    assert fused.attend(q, q, q, 1.0, "causal") is None
    assert fused.attend(q[:, :, :4], q, q, 1.0, "causal") is not None


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_chunked_prompt_matches_transformers(tiny, name, monkeypatch):
    """A 300-token prompt fed in chunks of 100 through the cache (each chunk's attention the
    blocked node: recorded) gives transformers' fp32 logits within 3e-5, the bound of the
    full-forward parity tests."""
    folder, ref = tiny(name)
    model = mlxlis.load(folder, "float32")
    ids = trajectory(300, vocab=model.config.vocab_size)
    taken = []
    real = nodes.attend

    def spy(q, *args, **kw):
        out = real(q, *args, **kw)
        taken.append((q.shape[2], out is not None))
        return out

    monkeypatch.setattr(nodes, "attend", spy)
    cache = model.make_cache()
    ours = np.concatenate(
        [np.array(model.net(mx.array([ids[s : s + 100]]), cache=cache)[0]) for s in (0, 100, 200)]
    )
    assert taken and all(t == 100 and done for t, done in taken)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(ours - theirs).max() < 3e-5
    assert np.abs(theirs).max() > 1.0
