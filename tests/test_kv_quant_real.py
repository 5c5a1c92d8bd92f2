"""Quantized KV caches on the three catalog models at 2 000+ tokens (`make test-all`): how far
their logits move from full-precision KV, and how long greedy decoding stays the same.

The prompt is 2 048 tokens of real code (the standard library's json decoder and encoder,
twice); the logits of its last 16 positions are compared, and 32 greedy tokens decoded after
it. Bounds are the measured figures (float32, this 2-core x86) with a quarter more room:

| model | 8-bit max abs(Δlogit) | 4-bit max abs(Δlogit) | 8-bit greedy |
|---|---|---|---|
| smollm2-135m | 0.26 | 4.7 (6.04 on a later OpenBLAS wheel) | 48 of 48 the same |
| gemma3-270m | 0.75 | 12.6 | 48 of 48 |
| qwen2.5-coder-0.5b | 1.01 | 14.4 | 48 of 48 |

The prompt ends on a block boundary, so its logits are read with an empty full-precision
tail (the plain scheme); the greedy tokens after it are read with the tail.
8-bit KV keeps every argmax of the 16 and the greedy tokens; 4-bit (groups of 64) moves
logits by a large fraction of their range (greedy agreed for only 4–22 tokens), which is why
it is the memory-for-quality end of the choice. Self-consistency against mlxlis's own
full-precision path; the scheme's parity with mlx-lm is in test_kv_quant.py.
"""

from __future__ import annotations

import inspect
import json.decoder
import json.encoder

import mlxlis
from mlxlis.cache import KVFormat
from mlxlis.generation.steps import prefill

import mlx.core as mx
import numpy as np
import pytest
from conftest import need_pulled

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.extended]
TEXT = (inspect.getsource(json.decoder) + inspect.getsource(json.encoder)) * 2
BOUNDS = {  # model: (8-bit, 4-bit) max abs(Δlogit), measured × 1.25
    "smollm2-135m": (0.33, 7.6),  # 4-bit: 4.7, then 6.04 with scipy-openblas32 0.3.34.481.3
    "gemma3-270m": (0.94, 15.7),
    "qwen2.5-coder-0.5b": (1.27, 18.0),
}
GREEDY = 32


def run(model, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """Logits of the last 16 positions, and GREEDY tokens decoded after them."""
    caches = model.make_cache()
    mx.eval(prefill(model.net, ids[:-16], caches))
    logits = model.net(mx.array([ids[-16:]]), cache=caches)[0]
    out, token = [], int(logits[-1].argmax())
    for _ in range(GREEDY):
        out.append(token)
        token = int(model.net(mx.array([[token]]), cache=caches)[0, -1].argmax())
    return np.array(logits.astype(mx.float32)), out


@pytest.mark.parametrize("name", list(BOUNDS))
def test_quantized_kv_at_2048_tokens_against_full_precision(name):
    need_pulled(name)
    model = mlxlis.load(name, "float32")
    ids = model.tokenizer.encode(TEXT)[:2048]
    assert len(ids) == 2048
    dense, greedy = run(model, ids)
    for fmt, bound in zip((KVFormat(8, 64), KVFormat(4, 64)), BOUNDS[name], strict=True):
        model.set_kv_format(fmt)
        try:
            logits, tokens = run(model, ids)
        finally:
            model.set_kv_format(None)
        assert 0 < np.abs(logits - dense).max() < bound, fmt
        if fmt.bits == 8:
            assert (logits.argmax(-1) == dense.argmax(-1)).all()
            assert tokens == greedy
