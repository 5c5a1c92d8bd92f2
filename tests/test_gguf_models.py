"""The real catalog GGUF models against transformers' own GGUF loader (reference parity).

For each model: our logits (quantized blocks kept as MLX affine arrays, fp32 activations) vs
transformers' (its GGUF loader dequantizes with gguf-py; fp32) on one ~24-token prompt; our
tokenizer's ids vs transformers' GGUF tokenizer; dense (dequantize=True) vs quantized logits
(self-consistency: the same weights, so equal up to fp32 summation order); the tied head of
SmolLM2 / Gemma 3 is one array, Qwen2.5's file has its own output.weight; Gemma 3's vocabulary
size comes from token_embd's shape. transformers is slow to load GGUF (13 s SmolLM2, ~50 s
Qwen, ~75 s Gemma 3 with its tokenizer), so tests/hf_references.py builds each reference once
per session, in a background process started at collection (conftest.py): its saved tokenizer
(shared with test_tokenizer) and its logits.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import mlxlis
from mlxlis.loading import catalog
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.models import REGISTRY

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import hf_gguf_tokenizer_dir, hf_logits, real_quantized
from hf_references import PROMPT
from mlx.utils import tree_flatten

pytestmark = pytest.mark.real

REAL = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
SAMPLE = (
    "Hello, world! The quick brown fox jumps over 13 lazy dogs in 2024.\n"
    "def add(a, b):\n    return a + b  # sum\n"
    "Émile a vu un cœur brûlé. 日本語のテキスト。 Привет, мир! 🙂🚀 naïve café   spaces"
)


@dataclass
class Real:
    name: str
    path: Path
    model: object  # mlxlis Model, quantized, fp32
    ids: list[int]
    ours: np.ndarray  # its logits for `ids` (MLX's CPU quantized matmul is slow: computed once)
    theirs: np.ndarray  # transformers' logits for `ids`
    their_tokens: list[int]  # transformers' ids for SAMPLE (no special tokens)


# qwen2.5-coder-0.5b's and gemma3-270m's reference runs take 16 s and 20 s on 2 cores:
# `make test-all` (make test keeps SmolLM2's; Gemma 3's GGUF conventions are proved on the
# tiny GGUFs against gguf-py and transformers, test_gguf_tiny.py)
@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.extended) if n != REAL[0] else n for n in REAL],
)
def real(request) -> Real:
    name = request.param
    if not catalog.is_pulled(name):
        pytest.skip(f"{name} not pulled (make models)")
    if catalog.CATALOG[name].family not in REGISTRY:
        pytest.skip(f"family {catalog.CATALOG[name].family} is not implemented yet")
    from transformers import AutoTokenizer

    model = real_quantized(name)
    ids, theirs = hf_logits(name)  # transformers' GGUF loader, built in the background
    assert model.tokenizer.encode(PROMPT) == ids
    ours = np.array(model.logits(ids))
    tok = AutoTokenizer.from_pretrained(hf_gguf_tokenizer_dir(name))  # built from the GGUF
    their_tokens = tok(SAMPLE, add_special_tokens=False)["input_ids"]
    return Real(name, catalog.model_path(name), model, ids, ours, theirs, their_tokens)


def test_logits_match_transformers_gguf_loader(real: Real):
    """Reference parity, fp32: max |Δ| < 3e-5 × max |logit| over a ~24-token prompt, and the
    same argmax at every position. Measured: SmolLM2 7.0e-5 (1.2e-4 on another x86 machine),
    Qwen2.5 6.6e-5, Gemma 3 6.5e-5 absolute, on logit scales of 36, 22 and 28: at most 3.4e-6
    of the scale, so the bound is about 9x."""
    assert 16 <= len(real.ids) <= 40
    ours = real.ours
    assert ours.shape == real.theirs.shape
    scale = np.abs(real.theirs).max()
    delta = np.abs(ours - real.theirs).max()
    print(f"{real.name}: max |Δ| {delta:.3g} on logit scale {scale:.3g} ({len(real.ids)} tokens)")
    assert delta < 3e-5 * scale, f"{real.name}: max |Δ| = {delta:.3g}, scale {scale:.3g}"
    assert (ours.argmax(-1) == real.theirs.argmax(-1)).all()


@pytest.mark.extended  # `make test-all` (7 s): tiny GGUF tests check both forms on transformers
def test_dequantized_equals_quantized(real: Real):
    """Self-consistency: dequantize=True holds the same weights dense, so the logits agree to
    fp32 summation order (max |Δ| < 3e-5 × max |logit|; measured 5.6e-5 to 7.0e-5 absolute,
    at most 2.6e-6 of the scale)."""
    quantized = real.ours
    dense = mlxlis.load(real.name, "float32", dequantize=True)
    assert "dense" in dense.quant_summary
    assert not any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, m in dense.net.named_modules()
    )
    got = np.array(dense.logits(real.ids))
    del dense
    gc.collect()
    delta = np.abs(got - quantized).max()
    print(f"{real.name}: dense vs quantized max |Δ| {delta:.3g}")
    assert delta < 3e-5 * np.abs(quantized).max(), f"max |Δ| = {delta:.3g}"
    assert (got.argmax(-1) == quantized.argmax(-1)).all()


def test_tokenizer_ids_match_transformers(real: Real):
    """Reference parity: our GGUF tokenizer's ids for a mixed sample (code, accents, CJK,
    Cyrillic, emoji, digits, runs of spaces) equal transformers' GGUF tokenizer's."""
    ours = real.model.tokenizer.encode(SAMPLE, add_bos=False, add_eos=False)
    assert ours == real.their_tokens


def test_head_is_tied_exactly_when_the_file_has_no_output(real: Real):
    """llama.cpp omits output.weight when tied: then the head is the embedding itself (one
    array, used through as_linear, no lm_head), else the file's own output.weight is bound."""
    with read_gguf(real.path) as f:
        has_output = "output.weight" in f.tensors
    net = real.model.net
    names = {k for k, _ in tree_flatten(net.parameters())}
    assert real.model.config.tie_word_embeddings == (not has_output)
    assert has_output == (real.name == "qwen2.5-coder-0.5b")
    if has_output:
        assert "lm_head" in net and "lm_head.weight" in names
        assert net.lm_head.weight is not net.model.embed_tokens.weight
        return
    assert "lm_head" not in net and not any(n.startswith("lm_head") for n in names)
    emb = net.model.embed_tokens
    calls = []
    as_linear = emb.as_linear

    def counting(x: mx.array) -> mx.array:
        calls.append(x.shape)
        return as_linear(x)

    emb.as_linear = counting  # an instance attribute shadows the method for this call
    try:
        logits = real.model.logits(real.ids[:4])
    finally:
        del emb.as_linear
    assert len(calls) == 1 and logits.shape[-1] == real.model.config.vocab_size


def test_vocab_size_is_token_embd_rows(real: Real):
    """The embedding's row count is the vocabulary (Gemma 3's converter trims the rows to the
    real vocabulary, so the tensor, not metadata, is the truth)."""
    with read_gguf(real.path) as f:
        rows = f.tensors["token_embd.weight"].shape[0]
        n_tokens = len(f.metadata["tokenizer.ggml.tokens"])
    assert real.model.config.vocab_size == rows == real.theirs.shape[-1]
    if real.name == "gemma3-270m":
        assert rows == n_tokens == 262144
