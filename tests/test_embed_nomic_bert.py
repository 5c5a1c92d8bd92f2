"""nomic-bert embeddings against sentence-transformers on transformers' NomicBertModel: tiny
random encoders (3 heads, rotary on the whole head, SwiGLU, post-norm) saved as
sentence-transformers folders by that library (transformers writes nomic's own tensor names:
Wqkv, fc11 / fc12 / fc2, norm1 / norm2, emb_ln), and a CrossEncoder folder. Each vector
within cosine 1 − 1e-6 and max |Δ| 1e-5 of `SentenceTransformer.encode` in float32; scores
within 1e-5 of `CrossEncoder.predict`."""

from __future__ import annotations

import json

import mlxlis
from mlxlis.errors import MlxlisError

import numpy as np
import pytest
from encoders import cross_encoder_folder, sentence_folder
from test_embed_bert import close
from test_embed_modernbert import MAX_SEQ, TEXTS


@pytest.fixture(scope="module")
def folder_and_st(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nomic") / "st"
    return folder, sentence_folder(folder, "nomic_bert", "mean", max_seq=MAX_SEQ)


def test_embed_matches_sentence_transformers_and_batches_equal_each_alone(folder_and_st):
    """RoPE (base 1000), the fused Wqkv split, fc12 as SwiGLU's gate, the post-norm blocks
    and the token-type embeddings as transformers computes them, mean-pooled and normalised
    as sentence-transformers does; a batch of mixed lengths gives each row what it gives
    alone, both against sentence-transformers."""
    folder, st = folder_and_st
    model = mlxlis.load(folder)
    assert model.task == "embed" and model.config.family == "nomic_bert"
    ref = st.encode(TEXTS, convert_to_numpy=True)
    close(np.array(model.embed(TEXTS)), ref)
    for text, row in zip(TEXTS, ref, strict=True):
        close(np.array(model.embed([text])), row[None])


def test_nomic_spelling_of_the_config_reads_alike(folder_and_st, tmp_path):
    """config.json in nomic's own keys (n_embd, n_head, rotary_emb_base, swiglu, ...), as the
    Hub's nomic-embed-text files have it, gives the same vectors; what no reference computes
    (an interleaved rotary) is refused naming the field."""
    import shutil

    folder, st = folder_and_st
    out = tmp_path / "nomic-keys"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    nomic = {
        "model_type": "nomic_bert",
        "vocab_size": cfg["vocab_size"],
        "n_embd": cfg["hidden_size"],
        "n_head": cfg["num_attention_heads"],
        "n_layer": cfg["num_hidden_layers"],
        "n_inner": cfg["intermediate_size"],
        "n_positions": cfg["max_position_embeddings"],
        "layer_norm_epsilon": cfg["layer_norm_eps"],
        "rotary_emb_base": cfg["rope_parameters"]["rope_theta"],
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "activation_function": "swiglu",
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "type_vocab_size": 2,
        "pad_token_id": cfg["pad_token_id"],
    }
    (out / "config.json").write_text(json.dumps(nomic))
    close(np.array(mlxlis.load(out).embed(TEXTS)), st.encode(TEXTS, convert_to_numpy=True))
    (out / "config.json").write_text(json.dumps({**nomic, "rotary_emb_interleaved": True}))
    with pytest.raises(MlxlisError) as e:
        mlxlis.load(out)
    assert e.value.field == "rotary_emb_interleaved"


def test_rerank_matches_cross_encoder_predict(tmp_path):
    """NomicBertForSequenceClassification's head (BERT's tanh pooler on the first token, then
    the classifier), token types 0 / 1 of the pair, through CrossEncoder's sigmoid."""
    ce = cross_encoder_folder(tmp_path / "ce", "nomic_bert", max_seq=MAX_SEQ)
    model = mlxlis.load(tmp_path / "ce")
    assert model.task == "rerank"
    query = "search the local server"
    ref = ce.predict([(query, d) for d in TEXTS])
    np.testing.assert_allclose(model.rerank(query, TEXTS), ref, atol=1e-5, rtol=0)
