"""BERT and XLM-RoBERTa embeddings and reranking against sentence-transformers itself: tiny
random encoders saved as sentence-transformers / CrossEncoder folders by that library, and the
real all-MiniLM-L6-v2 folder from the catalog. Each vector within cosine 1 − 1e-6 and
max |Δ| 1e-5 of `SentenceTransformer.encode` in float32; scores within 1e-5 of
`CrossEncoder.predict`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlxlis
from mlxlis.errors import MlxlisError
from mlxlis.models.embedding import BUCKET_GROWTH, BUCKET_SLACK, BUCKET_TOKENS, buckets

import numpy as np
import pytest
from conftest import need_pulled
from encoders import MAX_SEQ, cross_encoder_folder, sentence_folder

TEXTS = [
    "hello world",
    "the query is short",
    "a long passage about local embedding models on apple silicon and the retrieval of text, "
    "long enough to pass the folder's max_seq_length so that truncation is compared too",
    "x",
    "search the local server for a sentence",
]

# name -> (encoder kind, pooling modes, Dense out dims, Normalize)
EMBEDDERS = {
    "bert-mean": ("bert", "mean", 0, True),
    "bert-cls": ("bert", "cls", 0, True),
    "bert-max-dense": ("bert", "max", 20, True),
    "xlmr-mean": ("xlm-roberta", "mean", 0, False),
}
PROMPTS = {"query": "query: ", "document": "passage: "}


@pytest.fixture(scope="module")
def embedders(tmp_path_factory):
    """get(name) -> (folder, SentenceTransformer), each built once."""
    built: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in built:
            kind, modes, dense, norm = EMBEDDERS[name]
            folder = tmp_path_factory.mktemp("st") / name
            st = sentence_folder(folder, kind, modes, dense=dense, normalize=norm, prompts=PROMPTS)
            built[name] = (folder, st)
        return built[name]

    return get


def close(ours, ref) -> None:
    """Per vector: cosine ≥ 1 − 1e-6 and max |Δ| ≤ 1e-5 (float32)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    for a, b in zip(ours, ref, strict=True):
        cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
        assert cos >= 1 - 1e-6 and np.abs(a - b).max() <= 1e-5, (cos, np.abs(a - b).max())


@pytest.mark.parametrize("name", list(EMBEDDERS))
def test_embed_matches_sentence_transformers_and_batches_equal_each_alone(embedders, name):
    """Pooling (cls / mean / max), Dense, Normalize and truncation at max_seq_length as
    sentence-transformers computes them; a batch of mixed lengths (padded, masked) gives each
    row what the row alone gives, both against sentence-transformers."""
    folder, st = embedders(name)
    model = mlxlis.load(folder)
    assert model.task == "embed" and model.embedder.max_length == MAX_SEQ
    ref = st.encode(TEXTS, convert_to_numpy=True)
    close(np.array(model.embed(TEXTS)), ref)
    for text, row in zip(TEXTS, ref, strict=True):
        close(np.array(model.embed([text])), row[None])


def test_attention_a_row_at_a_time_matches_sentence_transformers(embedders, monkeypatch):
    """The encoder's attention split into chunks of one row (as long inputs run: see
    encoder.SCORES_PER_CHUNK) keeps each row's own padding mask: a mixed-length batch still
    equals sentence-transformers."""
    from mlxlis.models import encoder

    monkeypatch.setattr(encoder, "SCORES_PER_CHUNK", 1)
    folder, st = embedders("bert-mean")
    texts = ["hello world", "the query is short", "x", "search the local server", "a b c d"]
    close(np.array(mlxlis.load(folder).embed(texts)), st.encode(texts, convert_to_numpy=True))


def test_matryoshka_dimensions_truncate_and_renormalise(embedders):
    """`dimensions` = sentence-transformers' vectors cut to d and renormalised (the model
    normalises); an unnormalised model's are cut only."""
    folder, st = embedders("bert-mean")
    model = mlxlis.load(folder)
    ref = st.encode(TEXTS, convert_to_numpy=True)[:, :16]
    ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    close(np.array(model.embed(TEXTS, dimensions=16)), ref)
    folder, st = embedders("xlmr-mean")
    close(np.array(mlxlis.load(folder).embed(TEXTS, dimensions=7)), st.encode(TEXTS)[:, :7])
    for bad in (0, 49, 2.5):
        with pytest.raises(MlxlisError) as e:
            model.embed(TEXTS, dimensions=bad)
        assert e.value.field == "dimensions"


def test_prompt_name_prepends_the_checkpoints_prompt(embedders):
    """prompt_name reads config_sentence_transformers.json's prompts as encode(prompt_name=)."""
    folder, st = embedders("bert-cls")
    model = mlxlis.load(folder)
    for name in PROMPTS:
        ref = st.encode(TEXTS, prompt_name=name, convert_to_numpy=True)
        close(np.array(model.embed(TEXTS, prompt_name=name)), ref)
    with pytest.raises(MlxlisError) as e:
        model.embed(TEXTS, prompt_name="nope")
    assert e.value.field == "prompt_name"


def test_plain_hugging_face_folder_pools_as_sentence_transformers_wraps_it(embedders):
    """A BERT folder without modules.json: mean pooling, no normalisation, as
    SentenceTransformer(folder) builds it."""
    from sentence_transformers import SentenceTransformer

    folder, _ = embedders("bert-cls")
    raw = folder.parent / f"{folder.name}-raw"
    assert not (raw / "modules.json").exists()
    ref = SentenceTransformer(str(raw), device="cpu").encode(TEXTS, convert_to_numpy=True)
    close(np.array(mlxlis.load(raw).embed(TEXTS)), ref)


def test_buckets_group_similar_lengths_and_cover_every_input():
    """Sorted by length, each bucket's longest within 1.25 × its shortest + 8 tokens and its
    padded size within the budget (one long input alone excepted): no row pays for much more
    than its own length; every input in exactly one bucket."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 512, 1000)]
    groups = buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(1000))
    for g in groups:
        lo, hi = min(lengths[i] for i in g), max(lengths[i] for i in g)
        assert hi <= lo * BUCKET_GROWTH + BUCKET_SLACK
        assert len(g) * hi <= BUCKET_TOKENS or len(g) == 1
    # inputs share forwards: more per bucket, on average, than the budget holds at 512 tokens
    assert len(groups) < 1000 / (BUCKET_TOKENS / 512)


def test_token_ids_and_truncate_false(embedders):
    """Lists of ids embed as the tokenizer's ids of the same text do; with truncate=False an
    input past the model's maximum is refused naming its index."""
    folder, st = embedders("bert-mean")
    model = mlxlis.load(folder)
    ids = [st.tokenizer(t)["input_ids"][:MAX_SEQ] for t in TEXTS[:2]]
    close(np.array(model.embed(ids)), st.encode(TEXTS[:2], convert_to_numpy=True))
    with pytest.raises(MlxlisError) as e:
        model.embed(TEXTS, truncate=False)
    assert e.value.field == "input[2]"


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_rerank_matches_cross_encoder_predict(tmp_path, kind):
    """BERT's pooler + classifier and RoBERTa's dense + out_proj head, with CrossEncoder's
    default activation for one label (sigmoid), equal CrossEncoder.predict; truncation of the
    longest pair included."""
    ce = cross_encoder_folder(tmp_path / "ce", kind)
    model = mlxlis.load(tmp_path / "ce")
    assert model.task == "rerank"
    query = "search the local server"
    ref = ce.predict([(query, d) for d in TEXTS])
    np.testing.assert_allclose(model.rerank(query, TEXTS), ref, atol=1e-5, rtol=0)


@pytest.mark.real
def test_real_minilm_matches_sentence_transformers():
    """The catalog's all-MiniLM-L6-v2 (mean pooling, Normalize, max_seq_length 256) vs
    SentenceTransformer on the same folder, with an input past 256 tokens."""
    from sentence_transformers import SentenceTransformer

    folder = need_pulled("all-minilm-l6-v2")
    texts = ["A man is eating food.", "The new movie is awesome", "word " * 400, "Hi"]
    model = mlxlis.load("all-minilm-l6-v2")
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    close(np.array(model.embed(texts)), ref)


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def test_legacy_pooling_flags_read_as_sentence_transformers_reads_them(embedders, tmp_path):
    """A 1_Pooling/config.json in the 2.x spelling (one pooling_mode_*_tokens flag per mode,
    word_embedding_dimension) pools as sentence-transformers 6 reads it."""
    from sentence_transformers import SentenceTransformer

    folder = _copy(embedders("bert-max-dense")[0], tmp_path)
    legacy = {
        "word_embedding_dimension": 48,
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    close(np.array(mlxlis.load(folder).embed(TEXTS)), ref)


def test_refusals_name_the_file_and_field(embedders, tmp_path, tiny):
    """An unknown pooling mode, a Dense only in pytorch_model.bin, generating with an embed
    model and embedding with a chat model: one MlxlisError each, naming what is wrong."""
    folder = _copy(embedders("bert-mean")[0], tmp_path / "a")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(MlxlisError) as e:
        mlxlis.load(folder)
    assert e.value.field == "pooling_mode" and "1_Pooling" in str(e.value)

    folder = _copy(embedders("bert-max-dense")[0], tmp_path / "b")
    dense = next(folder.glob("*_Dense"))
    (dense / "model.safetensors").rename(dense / "pytorch_model.bin")
    with pytest.raises(MlxlisError, match="pytorch_model.bin"):
        mlxlis.load(folder)

    model = mlxlis.load(embedders("bert-mean")[0])
    with pytest.raises(MlxlisError, match="embedding model"):
        list(mlxlis.generate(model, [5, 6, 7], max_tokens=2))
    with pytest.raises(MlxlisError, match="does not rerank"):
        model.rerank("q", ["d"])
    with pytest.raises(MlxlisError, match="no logits"):
        model.logits([5, 6, 7])

    chat = mlxlis.load(tiny("llama")[0])
    assert chat.task == "generate"
    with pytest.raises(MlxlisError, match="does not embed") as e:
        chat.embed(["hello"])
    assert e.value.field == "model"


def test_embed_command_prints_the_vectors_and_refuses_in_one_line(embedders):
    """`mlxlis embed --json` (a subprocess) prints the vectors model.embed gives; a bad
    --dimensions exits 2 with one line on stderr naming the field."""
    folder, _ = embedders("bert-mean")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "mlxlis", "embed", "-m", str(folder), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=root)

    done = run("--json", "--dimensions", "8", *TEXTS[:2])
    assert done.returncode == 0, done.stderr
    want = mlxlis.load(folder).embed(TEXTS[:2], dimensions=8)
    close(json.loads(done.stdout), np.array(want))
    bad = run("--dimensions", "0", "hello")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "dimensions" in bad.stderr
