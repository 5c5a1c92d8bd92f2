"""ModernBERT embeddings and reranking against sentence-transformers on transformers'
ModernBertModel / ModernBertForSequenceClassification: tiny random encoders (3 heads, global /
local / local / global layers, a local window of ±4 positions, much shorter than the inputs)
saved as sentence-transformers / CrossEncoder folders by that library. Each vector within
cosine 1 − 1e-6 and max |Δ| 1e-5 of `SentenceTransformer.encode` in float32; scores within 1e-5
of `CrossEncoder.predict`."""

from __future__ import annotations

import mlxlis

import numpy as np
import pytest
from encoders import cross_encoder_folder, sentence_folder
from test_embed_bert import close

MAX_SEQ = 64
TEXTS = [
    "hello world",
    "the query is short",
    "a long passage about local embedding models on apple silicon and the retrieval of text, "
    "long enough that the local window of the small layers bites many times over",
    "x",
    "search the local server for a sentence about vectors and short text models",
]


BIASES = dict(attention_bias=True, mlp_bias=True, norm_bias=True, global_attn_every_n_layers=2)


@pytest.mark.parametrize(
    ("modes", "kw"), [("mean", {}), ("cls", {}), ("mean", BIASES)], ids=["mean", "cls", "biases"]
)
def test_embed_matches_sentence_transformers_and_batches_equal_each_alone(tmp_path, modes, kw):
    """The global and local layers (each with its own RoPE base), GeGLU, the pre-norm blocks
    and the final norm as transformers computes them (also with the biases a config may ask
    and another global / local pattern), pooled and normalised as sentence-transformers does;
    a batch of mixed lengths gives each row what the row alone gives, both against
    sentence-transformers."""
    st = sentence_folder(tmp_path / "st", "modernbert", modes, max_seq=MAX_SEQ, **kw)
    model = mlxlis.load(tmp_path / "st")
    assert model.task == "embed" and model.config.family == "modernbert"
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert max(lengths) > 50 and min(lengths) < 5  # longer than the ±4 window, mixed
    ref = st.encode(TEXTS, convert_to_numpy=True)
    close(np.array(model.embed(TEXTS)), ref)
    for text, row in zip(TEXTS, ref, strict=True):
        close(np.array(model.embed([text])), row[None])


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_rerank_matches_cross_encoder_predict(tmp_path, pooling):
    """ModernBertForSequenceClassification's head (the first token or the mean over the real
    tokens, dense -> gelu -> LayerNorm -> classifier), through CrossEncoder's sigmoid."""
    ce = cross_encoder_folder(
        tmp_path / "ce", "modernbert", max_seq=MAX_SEQ, classifier_pooling=pooling
    )
    model = mlxlis.load(tmp_path / "ce")
    assert model.task == "rerank"
    query = "search the local server"
    ref = ce.predict([(query, d) for d in TEXTS])
    np.testing.assert_allclose(model.rerank(query, TEXTS), ref, atol=1e-5, rtol=0)


def test_plain_hugging_face_folder_pools_as_sentence_transformers_wraps_it(tmp_path):
    """A ModernBERT folder without modules.json: mean pooling, no normalisation, as
    SentenceTransformer(folder) builds it."""
    from sentence_transformers import SentenceTransformer

    sentence_folder(tmp_path / "st", "modernbert", "cls", max_seq=MAX_SEQ, seed=3)
    raw = tmp_path / "st-raw"
    assert not (raw / "modules.json").exists()
    ref = SentenceTransformer(str(raw), device="cpu").encode(TEXTS, convert_to_numpy=True)
    close(np.array(mlxlis.load(raw).embed(TEXTS)), ref)
