"""Decoder embedders and the yes / no reranker against their references, in float32 on tiny
random models: Qwen3-Embedding- and EmbeddingGemma-like sentence-transformers folders vs
`SentenceTransformer.encode` (reference parity), a mixed-length batch vs each input alone
(padding changes no row: self-consistency), and a Qwen3-Reranker-like causal LM vs transformers
run by the model card's recipe on the same prompt text (reference parity)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
import mlxlis  # noqa: E402
from mlxlis.errors import UnsupportedError  # noqa: E402

from tests.decoder_folders import (  # noqa: E402
    embedding_gemma_folder,
    qwen3_embedding_folder,
    reranker_folder,
)

TEXTS = [
    "a short query",
    "the long local server apple silicon retrieval embedding model vector sentence text",
    "yes",
    "search for a passage on the web that is relevant",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {
        "qwen3": (root / "qwen3", qwen3_embedding_folder(root / "qwen3")),
        "gemma": (root / "gemma", embedding_gemma_folder(root / "gemma")),
        "rerank": (root / "rerank", reranker_folder(root / "rerank")),
    }


def close(ours, ref) -> None:
    """Each vector within 1e-5 of the reference, cosine ≥ 1 − 1e-6."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-5
    cos = (ours * ref).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 1 - 1e-6


@pytest.mark.parametrize("name", ["qwen3", "gemma"])
def test_embed_matches_sentence_transformers(folders, name):
    """`embed` equals SentenceTransformer.encode, plain and with the folder's query prompt."""
    path, st = folders[name]
    model = mlxlis.load(path)
    assert model.task == "embed"
    close(model.embed(TEXTS), st.encode(TEXTS))
    close(model.embed(TEXTS, prompt_name="query"), st.encode(TEXTS, prompt_name="query"))
    tokens = st.tokenizer(TEXTS[0])["input_ids"]  # the tokenizer's own EOS (and BOS) included
    assert model.embedder.tokenizer.encode(TEXTS[0])[0] == tokens


@pytest.mark.parametrize("name", ["qwen3", "gemma"])
def test_mixed_lengths_batch_equals_each_alone(folders, name):
    """Padding changes no row: the causal model's last real token, the bidirectional one's
    masked pads (texts longer than the Gemma sliding window, both sides of it)."""
    model = mlxlis.load(folders[name][0])
    batch = np.array(model.embed(TEXTS, prompt_name="query"))
    alone = np.stack([np.array(model.embed([t], prompt_name="query"))[0] for t in TEXTS])
    assert np.abs(batch - alone).max() <= 1e-6


def test_embedding_gemma_matryoshka(folders):
    """The first d of the Dense projections' output, renormalised, as sentence-transformers'
    truncate_dim then normalisation gives."""
    path, st = folders["gemma"]
    model = mlxlis.load(path)
    assert model.embedder.dims == 24
    ref = st.encode(TEXTS, truncate_dim=8)
    close(model.embed(TEXTS, dimensions=8), ref / np.linalg.norm(ref, axis=-1, keepdims=True))


def test_bidirectional_gemma_without_pooling_is_refused(folders):
    """A bidirectional Gemma folder that states no pooling (no modules.json) is neither a
    generator nor an embedder: refused naming the field."""
    path = folders["gemma"][0]
    with pytest.raises(UnsupportedError) as e:
        mlxlis.load(path.parent / f"{path.name}-raw")
    assert e.value.field == "use_bidirectional_attention"


def test_yes_no_reranker_matches_the_recipe(folders):
    """p(yes) / (p(yes) + p(no)) at the last position of the card's prompt, computed with
    transformers' model on the same text tokenized by the same tokenizer, within 1e-5."""
    from mlxlis.models.decoder_rerank import BODY, INSTRUCTION, SUFFIX, SYSTEM

    import torch

    path, (hf, tok) = folders["rerank"]
    assert mlxlis.load(path).task == "generate"  # a causal LM reranks only when asked
    model = mlxlis.load(path, task="rerank")
    assert model.task == "rerank"
    query = "what is a local server"
    docs = ["apple silicon server", "no", TEXTS[1], "the short text of a long passage"]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    ref = []
    for doc in docs:
        text = SYSTEM + BODY.format(instruction=INSTRUCTION, query=query, doc=doc) + SUFFIX
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        ref.append(torch.softmax(torch.stack([last[no], last[yes]]), 0)[1].item())
    got = model.rerank(query, docs)
    assert np.abs(np.array(got) - np.array(ref)).max() <= 1e-5
    assert max(ref) - min(ref) > 1e-3  # the documents score apart: a swap would show
    task = "judge the apple silicon passages"
    text = SYSTEM + BODY.format(instruction=task, query=query, doc=docs[0]) + SUFFIX
    with torch.no_grad():
        last = hf(torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])).logits[0, -1]
    want = torch.softmax(torch.stack([last[no], last[yes]]), 0)[1].item()
    assert abs(model.rerank(query, docs[:1], instruction=task)[0] - want) <= 1e-5
    assert abs(want - ref[0]) > 1e-4  # the instruction reached the prompt


def test_task_the_folder_is_not_is_refused(folders):
    """task="embed" on a causal LM folder is refused naming `task`."""
    with pytest.raises(UnsupportedError) as e:
        mlxlis.load(folders["rerank"][0], task="embed")
    assert e.value.field == "task"


def test_reranker_cuts_the_document_and_keeps_the_suffix(folders):
    """Past the model's maximum the middle part is cut from its end (the prompt's suffix, where
    the answer is read, kept); with truncate=False it is refused naming the document."""
    from mlxlis.errors import MlxlisError
    from mlxlis.models.decoder_rerank import SUFFIX

    model = mlxlis.load(folders["rerank"][0], task="rerank")
    long = " ".join([TEXTS[1]] * 40)
    ids = model.embedder.tokenizer.encode("a query", long)[0]
    suffix = model.tokenizer.encode(SUFFIX, special=True)
    assert len(ids) == model.config.max_position_embeddings and ids[-len(suffix) :] == suffix
    assert 0 < model.rerank("a query", [long])[0] < 1
    with pytest.raises(MlxlisError) as e:
        model.rerank("a query", ["short", long], truncate=False)
    assert e.value.field == "documents[1]"
