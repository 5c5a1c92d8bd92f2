"""The sampler chain against llama.cpp's own implementation (llama-cpp-python 0.3.36's
libllama, through its C API): DRY with its
sequence breakers read from a real vocabulary (llama.cpp's Llama 3 BPE test vocabulary,
vocab-only), and the whole chain — penalties (repetition, frequency, presence), DRY,
top-n-sigma, top-k, typical-p, top-p, min-p, XTC (firing), temperature — on the same logits
and history, compared as the surviving tokens and their logits, float32 relative 1e-5."""

from __future__ import annotations

import ctypes

from mlxlis.generation.dry import Dry, dry_breakers
from mlxlis.generation.processors import Penalties, RepetitionPenalty
from mlxlis.generation.sampling import SamplingParams, _truncate
from mlxlis.generation.truncation import _xtc
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.tokenizer.tokenizer import Tokenizer

import llama_cpp as L
import mlx.core as mx
import numpy as np
import pytest
from conftest import llama_cpp_reference

TEXT = (
    "User: say a *b* c then go home\nUser: say a *b* c then go home now\nUser: say a *b* c then go"
)


@pytest.fixture(scope="module")
def vocab():
    """(llama.cpp's vocabulary, ours) of the same GGUF."""
    path = llama_cpp_reference("ggml-vocab-llama-bpe.gguf")
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    ours = Tokenizer.from_gguf(read_gguf(path).metadata, path)
    yield L.llama_model_get_vocab(model), ours
    L.llama_model_free(model)


def apply(chain: list, history: list[int], logits: np.ndarray) -> dict[int, float]:
    """llama.cpp's samplers applied in order after accepting `history`: the surviving ids
    and their logits."""
    n = len(logits)
    rows = np.zeros(n, [("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
    assert rows.itemsize == ctypes.sizeof(L.llama_token_data)
    rows["id"], rows["logit"] = np.arange(n), logits
    data = rows.ctypes.data_as(ctypes.POINTER(L.llama_token_data))
    cur = L.llama_token_data_array(data, n, -1, False)
    for s in chain:
        for t in history:
            L.llama_sampler_accept(s, t)
        L.llama_sampler_apply(s, ctypes.byref(cur))
        L.llama_sampler_free(s)
    out = np.ctypeslib.as_array(cur.data, shape=(cur.size,))
    return dict(zip(out["id"].tolist(), out["logit"].tolist(), strict=True))


def dry_init(vocab, breakers, mult, base, allowed, last_n):
    arr = (ctypes.c_char_p * len(breakers))(*[b.encode() for b in breakers])
    return L.llama_sampler_init_dry(vocab, mult, base, allowed, last_n, arr, len(breakers))


@pytest.mark.parametrize("breakers", [("\n", ":", '"', "*"), ("User:",), ()])
@pytest.mark.parametrize("allowed", [1, 2])
def test_dry_as_llama_cpp(vocab, breakers, allowed):
    """DRY over a repeating chat text: every logit as llama.cpp's DRY leaves it, breakers
    (one token, and "User:" spanning tokens) read from the vocabulary as llama.cpp reads
    them."""
    theirs, ours = vocab
    hist = ours.encode(TEXT, add_bos=False)
    logits = np.random.default_rng(0).normal(size=ours.vocab_size).astype(np.float32)
    ref = apply([dry_init(theirs, breakers, 0.8, 1.75, allowed, 64)], hist, logits)
    dry = Dry(0.8, 1.75, allowed, 64, dry_breakers(ours, breakers))
    got = np.array(dry(mx.array(logits[None]), hist))[0]
    want = np.array([ref[i] for i in range(len(logits))], np.float32)
    assert (want != logits).any()  # something was penalised
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_whole_chain_as_llama_cpp(vocab):
    """llama.cpp's default chain (common/sampling.cpp) with every sampler on, XTC firing
    (probability 1) and temperature 0.7: the same tokens survive, with the same logits."""
    theirs, ours = vocab
    hist = ours.encode(TEXT, add_bos=False)
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=ours.vocab_size) * 3).astype(np.float32)
    logits[hist[-8:]] += 9  # the history's tokens among the likely ones
    p = SamplingParams(
        temperature=0.7,
        repetition_penalty=1.2,
        repetition_context=64,
        frequency_penalty=0.3,
        presence_penalty=0.4,
        dry_multiplier=0.8,
        top_n_sigma=3.0,
        top_k=40,
        typical_p=0.95,
        top_p=0.95,
        min_p=0.02,
        xtc_probability=1.0,
        xtc_threshold=0.1,
    )
    chain = [
        L.llama_sampler_init_penalties(ours.vocab_size, 64, 1.2, 0.3, 0.4),
        dry_init(theirs, p.dry_sequence_breakers, 0.8, 1.75, 2, 64),
        L.llama_sampler_init_top_n_sigma(3.0),
        L.llama_sampler_init_top_k(40),
        L.llama_sampler_init_typical(0.95, 0),
        L.llama_sampler_init_top_p(0.95, 0),
        L.llama_sampler_init_min_p(0.02, 0),
        L.llama_sampler_init_xtc(1.0, 0.1, 0, 0),
        L.llama_sampler_init_temp(0.7),
    ]
    # every sampler sees the history (llama.cpp's chain accepts each token into each one;
    # only the penalties and DRY keep it)
    ref = apply(chain, hist, logits)
    x = mx.array(logits[None])
    x = RepetitionPenalty(1.2, 64)(x, hist)
    x = Penalties(0.4, 0.3, start=0)(x, hist)  # the reply is the whole history here
    x = Dry(0.8, 1.75, 2, 64, dry_breakers(ours, p.dry_sequence_breakers))(x, hist)
    x = _xtc(_truncate(p)(x), 0.1, mx.array(True)) / 0.7
    got = np.array(x)[0]
    kept = sorted(np.flatnonzero(np.isfinite(got)).tolist())
    assert kept == sorted(ref) and 2 <= len(kept) < 40
    np.testing.assert_allclose(got[kept], [ref[i] for i in kept], rtol=1e-5)
