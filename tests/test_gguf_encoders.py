"""Encoder GGUF files (llama.cpp's `bert`, `nomic-bert` and `modern-bert` architectures)
against sentence-transformers, llama.cpp's own tokenizer tests and llama.cpp itself.

Reference parity: tiny random sentence-transformers / CrossEncoder folders (tests/encoders.py,
built by that library from transformers 5 models) converted by llama.cpp's own
convert_hf_to_gguf.py (tests/llama_cpp_convert.py) in F32: BERT with mean and with CLS pooling
(the file's pooling_type); nomic-bert (given the config keys the converter asserts); a
ModernBERT embedder and reranker (a byte-level BPE vocabulary, global and local layers); an
XLM-RoBERTa reranker with its own SentencePiece unigram vocabulary (the converter's `t5`
vocabulary, its position table cut past the padding index, its head as cls / cls.output).
Each vector within cosine 1 − 1e-6 and max |Δ| 1e-5 of `SentenceTransformer.encode`, scores
within 1e-5 of `CrossEncoder.predict`; a mixed-length batch gives each input what it gives
alone. The GGUF vocabularies encode texts and pairs to the folders' own tokenizer.json ids,
and llama.cpp's WordPiece test suite (ggml-vocab-bert-bge) to llama.cpp's ids. The real
all-MiniLM-L6-v2 (`extended`): F32 against sentence-transformers; Q8_0 (blocks kept
quantized) against sentence-transformers run on gguf-py's dequantization of those very
blocks. Where llama-cpp-python is installed, llama.cpp's own embeddings and rank scores on
the same files: ours within llama.cpp's own distance to the reference.
"""

from __future__ import annotations

from pathlib import Path

import mlxlis
from mlxlis.errors import MlxlisError
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.models.from_encoder import gguf_pooling
from mlxlis.tokenizer.gguf_encoder import encoder_vocab

import llama_cpp
import numpy as np
import pytest
from conftest import llama_cpp_reference
from encoders import cross_encoder_folder, sentence_folder
from llama_cpp_convert import convert_all, start_converter
from test_embed_bert import close

# within the folders' max_seq_length (40): a GGUF has no such limit, only its position table
TEXTS = [
    "hello world",
    "the query is short",
    "a passage about local embedding models on apple silicon and the retrieval of text",
    "x",
    "search the local server for a sentence",
]
QUERY = "search the local server"
DOCS = ["hello world", "a passage about local models and the retrieval of text", "x", "query"]
SCORE_BOUND = 1e-5


def nomic_keys(folder: Path) -> None:
    """`folder`'s config.json given the keys of nomic's own configuration that llama.cpp's
    converter asserts (transformers' NomicBertConfig saves none of them), stating what the
    transformers model computes: SwiGLU, post-norm, no biases, the whole head rotated."""
    import json

    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(
        n_positions=8192,  # with max_trained_positions 2048: nomic-embed v1.5's, as asserted
        max_trained_positions=2048,
        activation_function="swiglu",
        causal=False,
        qkv_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        prenorm=False,
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=False,
        rotary_emb_scale_base=None,
    )
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """name -> (GGUF path, the sentence-transformers model it was converted from): all
    converted in one run of llama.cpp's converter."""
    root = tmp_path_factory.mktemp("gguf-enc")
    convert = start_converter("modern-bert")  # ModernBERT's BPE split; the others take none
    refs = {
        "bert-mean": sentence_folder(root / "bert-mean", "bert", "mean", seed=1),
        "bert-cls": sentence_folder(root / "bert-cls", "bert", "cls", seed=2),
        "xlmr-rerank": cross_encoder_folder(root / "xlmr-rerank", "xlm-roberta", unigram=True),
        "nomic": sentence_folder(root / "nomic", "nomic_bert", "mean", seed=4),
        "modernbert": sentence_folder(root / "modernbert", "modernbert", "cls", seed=5, bpe=True),
        "modernbert-rerank": cross_encoder_folder(
            root / "modernbert-rerank", "modernbert", seed=6, bpe=True, classifier_pooling="mean"
        ),
    }
    nomic_keys(root / "nomic")
    jobs = [(root / n, root / f"{n}.gguf", "f32") for n in refs]
    convert(jobs)
    return {n: (root / f"{n}.gguf", ref) for n, ref in refs.items()}


@pytest.mark.parametrize(
    "name,mode",
    [("bert-mean", "mean"), ("bert-cls", "cls"), ("nomic", "mean"), ("modernbert", "cls")],
)
def test_embed_matches_sentence_transformers_and_batches_equal_each_alone(ggufs, name, mode):
    """The converted file embeds as sentence-transformers does on the folder: the pooling its
    pooling_type states, L2-normalised (nomic-bert: its fused attn_qkv and its ffn_gate /
    ffn_up apart, RoPE on the whole head; ModernBERT: its fused attn_qkv, a window of ±4 on
    the local layers, two RoPE bases, no norm before layer 0); a mixed-length batch (padded,
    masked) gives each input what it gives alone, both against sentence-transformers."""
    path, st = ggufs[name]
    model = mlxlis.load(path, "float32")
    assert model.task == "embed" and model.format == "gguf"
    assert model.embedder.pooling.modes == (mode,) and model.embedder.pooling.normalize
    ref = st.encode(TEXTS, convert_to_numpy=True)
    close(np.array(model.embed(TEXTS)), ref)
    for text, row in zip(TEXTS, ref, strict=True):
        close(np.array(model.embed([text])), row[None])


def test_pooling_types_differ_on_the_same_weights(ggufs):
    """The parity above is not blind to pooling: the CLS model's vectors pooled by mean
    (a misread pooling_type) are far from sentence-transformers'."""
    from dataclasses import replace

    path, st = ggufs["bert-cls"]
    model = mlxlis.load(path, "float32")
    model.embedder.pooling = replace(model.embedder.pooling, modes=("mean",))
    delta = np.abs(np.array(model.embed(TEXTS)) - st.encode(TEXTS, convert_to_numpy=True)).max()
    assert delta > 1e-2


@pytest.mark.parametrize("name", ["xlmr-rerank", "modernbert-rerank"])
def test_reranker_matches_cross_encoder_predict(ggufs, name):
    """The classifier from the file over the vocabulary's pairs: XLM-R's (cls: dense + tanh,
    cls.output: out_proj; <s> q </s></s> d </s>, positions from the cut table) and
    ModernBERT's (mean of the real tokens as classifier.pooling_type says, cls + GELU +
    cls.norm + cls.output): CrossEncoder.predict's sigmoid scores within 1e-5, in any batch;
    the scores spread far wider than the bound."""
    path, ce = ggufs[name]
    model = mlxlis.load(path, "float32")
    head = "roberta" if name == "xlmr-rerank" else "modernbert"
    assert model.task == "rerank" and model.config.family_config.head == head
    ref = ce.predict([(QUERY, d) for d in DOCS])
    ours = np.array(model.rerank(QUERY, DOCS))
    assert np.abs(ours - ref).max() <= SCORE_BOUND, (ours, ref)
    assert np.ptp(ref) > 100 * SCORE_BOUND
    alone = [model.rerank(QUERY, [d])[0] for d in DOCS]
    assert np.abs(np.array(alone) - ref).max() <= SCORE_BOUND


def test_vocabularies_encode_as_the_folders_tokenizers(ggufs):
    """The GGUF's `bert`, `t5` and (ModernBERT's) `gpt2` vocabularies give the ids (and token
    types) of the folder's tokenizer.json, for texts and for (query, document) pairs."""
    for name in ("bert-mean", "xlmr-rerank", "modernbert"):
        path, ref = ggufs[name]
        hf = ref.tokenizer
        with read_gguf(path) as g:
            md = dict(g.metadata)
        tk = encoder_vocab(md, path)
        for text in TEXTS:
            assert tk.encode(text).ids == hf(text)["input_ids"], (name, text)
        for d in DOCS:
            enc, want = tk.encode(QUERY, d), hf(QUERY, d)
            assert enc.ids == want["input_ids"], (name, d)
            if "token_type_ids" in want:
                assert enc.type_ids == want["token_type_ids"], (name, d)


def _vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 inputs and ids for ggml-vocab-`name`.gguf."""
    sep = "\n__ggml_vocab_test__\n"
    raw = llama_cpp_reference(f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    inputs = raw.split(sep)
    if inputs[-1] == "":
        inputs.pop()
    lines = llama_cpp_reference(f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines) == 46
    return [(s, [int(t) for t in line.split()]) for s, line in zip(inputs, lines, strict=True)]


def test_wordpiece_gives_llama_cpp_ids():
    """llama.cpp's own WordPiece test (bge's vocabulary: lowercasing, accents stripped, CJK and
    punctuation split, unknown words as [UNK]): every one of its 46 inputs encodes to its ids,
    and a text gets [CLS] ... [SEP] as llama.cpp adds them."""
    tok = mlxlis.load_tokenizer(llama_cpp_reference("ggml-vocab-bert-bge.gguf"))
    bad = [
        (t, ids)
        for t, ids in _vocab_cases("bert-bge")
        if tok.encode(t, add_bos=False, add_eos=False) != ids
    ]
    assert not bad, bad[:3]
    assert tok.encode("Hello world") == [101, 7592, 2088, 102]


def test_refusals_name_the_file_and_field(ggufs):
    """A BERT cross-encoder's GGUF has lost its pooler (the converter drops pooler.dense:
    cls.output without cls): refused naming cls.weight; a pooling type the embedder cannot
    run: refused naming the key."""
    from mlxlis.models.gguf_config import config_from_gguf

    path, _ = ggufs["bert-cls"]
    with read_gguf(path) as g:
        md, shapes = dict(g.metadata), {n: t.shape for n, t in g.tensors.items()}
    with pytest.raises(MlxlisError) as e:
        config_from_gguf(md, {**shapes, "cls.output.weight": (1, 48)}, str(path))
    assert e.value.field == "cls.weight" and str(path) in str(e.value)
    for kind, head in ((0, False), (4, False), (9, True)):
        with pytest.raises(MlxlisError) as e:
            gguf_pooling({"bert.pooling_type": kind}, "bert", Path("x.gguf"), head)
        assert e.value.field == "bert.pooling_type"
    assert gguf_pooling({}, "bert", Path("x.gguf"), False).modes == ("mean",)


def test_unread_encoders_are_refused_by_name(tmp_path):
    """A RoBERTa GGUF's byte-level BPE vocabulary (no pair template read) is refused naming
    tokenizer.ggml.model; an encoder architecture not read (NeoBERT) naming
    general.architecture."""
    import gguf

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(MlxlisError) as e:
        encoder_vocab(md, tmp_path / "roberta.gguf")
    assert e.value.field == "tokenizer.ggml.model"
    for arch in ("neo-bert",):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(MlxlisError) as e:
            mlxlis.load(path, "float32")
        assert e.value.field == "general.architecture", arch


# --- the real all-MiniLM-L6-v2, converted by llama.cpp's converter ---

REAL_TEXTS = ["A man is eating food.", "The new movie is awesome", "word " * 200, "Hi"]
# llama.cpp's names -> BertModel's (what the converter renamed)
HF_NAMES = [
    ("token_embd", "embeddings.word_embeddings"),
    ("position_embd", "embeddings.position_embeddings"),
    ("token_types", "embeddings.token_type_embeddings"),
    ("token_embd_norm", "embeddings.LayerNorm"),
    ("attn_q", "attention.self.query"),
    ("attn_k", "attention.self.key"),
    ("attn_v", "attention.self.value"),
    ("attn_output", "attention.output.dense"),
    ("attn_output_norm", "attention.output.LayerNorm"),
    ("ffn_up", "intermediate.dense"),
    ("ffn_down", "output.dense"),
    ("layer_output_norm", "output.LayerNorm"),
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """(F32 GGUF, Q8_0 GGUF, SentenceTransformer) of the catalog's all-MiniLM-L6-v2."""
    from conftest import need_pulled
    from sentence_transformers import SentenceTransformer

    folder = need_pulled("all-minilm-l6-v2")
    root = tmp_path_factory.mktemp("minilm")
    f32, q8 = root / "minilm-f32.gguf", root / "minilm-q8_0.gguf"
    convert_all([(folder, f32, "f32"), (folder, q8, "q8_0")], pre="default")
    return f32, q8, SentenceTransformer(str(folder), device="cpu").eval()


def dequantized_reference(st, path: Path):
    """A copy of `st` whose BertModel holds gguf-py's dequantization of the GGUF's tensors
    (names mapped back as the converter renamed them): the model the file's blocks encode."""
    import copy

    import gguf
    import torch

    ref = copy.deepcopy(st)
    bert = ref[0].auto_model
    state = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        stem, part = t.name.rsplit(".", 1)
        block, _, key = stem.rpartition(".") if stem.startswith("blk.") else ("", "", stem)
        hf = dict(HF_NAMES)[key]
        name = f"encoder.layer.{block.split('.')[1]}.{hf}" if block else hf
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        state[f"{name}.{part}"] = torch.from_numpy(np.array(values, np.float32))
    missing, unexpected = bert.load_state_dict(state, strict=False)
    assert not unexpected and all("pooler" in m or "position_ids" in m for m in missing), missing
    return ref


@pytest.mark.extended
def test_real_minilm_f32_matches_sentence_transformers(minilm):
    """all-MiniLM-L6-v2's F32 GGUF (mean pooling from its pooling_type, L2-normalised as its
    Normalize module does) against SentenceTransformer on the folder, within cosine 1 − 1e-6
    and max |Δ| 1e-5, inputs within its max_seq_length (256)."""
    f32, _, st = minilm
    model = mlxlis.load(f32, "float32")
    assert model.embedder.pooling.modes == ("mean",)
    close(np.array(model.embed(REAL_TEXTS)), st.encode(REAL_TEXTS, convert_to_numpy=True))


# Q8_0 against the original weights' vectors: llama.cpp's own embeddings of this Q8_0 file are
# up to 1 − cos = 8.6e-4 from sentence-transformers' (it rounds the activations to 8 bits as
# well); ours (weights alone quantized) 3.3e-4. The bound is llama.cpp's own distance, rounded up
Q8_COSINE = 1 - 1e-3


@pytest.mark.extended
def test_real_minilm_q8_0_keeps_blocks_and_matches_their_dequantization(minilm):
    """The Q8_0 file loaded with its blocks kept quantized (the project's quantized linear):
    its vectors are sentence-transformers' on gguf-py's dequantization of those very blocks
    within cosine 1 − 1e-6 and max |Δ| 1e-5, and within cosine 1 − 1e-3 (llama.cpp's own
    distance, see Q8_COSINE) of the original weights' vectors."""
    from mlxlis.models.quantized import QuantizedLinear

    _, q8, st = minilm
    model = mlxlis.load(q8, "float32", dequantize=False)
    query = model.net.encoder.layers[0].attention.query
    assert isinstance(query, QuantizedLinear) and query.bits == 8
    ours = np.array(model.embed(REAL_TEXTS))
    ref = dequantized_reference(st, q8).encode(REAL_TEXTS, convert_to_numpy=True)
    close(ours, ref)
    original = st.encode(REAL_TEXTS, convert_to_numpy=True)
    cos = (ours * original).sum(axis=1)
    assert cos.min() >= Q8_COSINE and cos.min() < 1 - 1e-6, cos


# --- llama.cpp itself (llama-cpp-python) on the same files ---


def within_llama_cpp(ours: np.ndarray, theirs: np.ndarray, ref: np.ndarray) -> None:
    """Ours within llama.cpp's own distance to the reference (plus ours, by the triangle
    inequality; and no worse than 2e-6 in cosine): llama.cpp's F32 graph is not the reference
    either (its GELU is tabulated: 4.7e-4 off sentence-transformers' all-MiniLM vectors)."""

    def dist(a, b):
        return np.abs(a - b).max(axis=-1), 1 - (a * b).sum(-1)

    (d_ours, c_ours), (d_lcpp, c_lcpp) = dist(ours, ref), dist(theirs, ref)
    d, c = dist(ours, theirs)
    assert (d <= d_ours + d_lcpp + 1e-7).all(), (d, d_ours, d_lcpp)
    assert (c <= c_ours + c_lcpp + 2e-6).all(), (c, c_ours, c_lcpp)


def test_xlmr_reranker_matches_llama_cpp_rank_pooling(ggufs):
    """llama.cpp's rank pooling on the same GGUF (its classifier head on the first token, fed
    our pair ids; sigmoid applied to its logit as CrossEncoder does): our scores within its
    own distance to CrossEncoder.predict; its tokenizer gives our ids for single texts."""
    path, ce = ggufs["xlmr-rerank"]
    llm = llama_cpp.Llama(
        str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, verbose=False
    )
    model = mlxlis.load(path, "float32")
    pairs = model.embedder.tokenizer

    def score(ids: list[int]) -> float:
        llm._batch.reset()
        llm._batch.add_sequence(ids, 0, True)
        llm._ctx.decode(llm._batch)
        return float(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[0])

    for text in [QUERY, *DOCS]:
        assert llm.tokenize(text.encode()) == pairs.encode(text)[0], text
    theirs = 1 / (1 + np.exp(-np.array([score(pairs.encode(QUERY, d)[0]) for d in DOCS])))
    ours, ref = np.array(model.rerank(QUERY, DOCS)), ce.predict([(QUERY, d) for d in DOCS])
    within_llama_cpp(ours[:, None], theirs[:, None], ref[:, None])
    assert np.abs(ours - theirs).max() <= 1e-4


@pytest.mark.parametrize("name", ["bert-cls", "nomic"])
def test_tiny_embedders_match_llama_cpp_embeddings(ggufs, name):
    """llama.cpp's embeddings of the tiny files (BERT with CLS pooling; nomic-bert's rotary,
    fused-QKV graph): its tokenizer gives our ids, our vectors are within its own distance to
    sentence-transformers'."""
    path, st = ggufs[name]
    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=64, n_batch=64, verbose=False)
    model = mlxlis.load(path, "float32")
    for text in TEXTS:
        assert llm.tokenize(text.encode()) == model.embedder.tokenizer.encode(text)[0]
    theirs = np.array(llm.embed(TEXTS, normalize=True))
    ours, ref = np.array(model.embed(TEXTS)), st.encode(TEXTS, convert_to_numpy=True)
    within_llama_cpp(ours, theirs, ref)


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_real_minilm_matches_llama_cpp_embeddings(minilm, kind):
    """llama.cpp's embeddings of the same file (mean pooling from its pooling_type, normalised
    as llama-cpp-python's embed(normalize=True)): its tokenizer gives our ids; our vectors
    are within llama.cpp's own distance to sentence-transformers' (F32: 4.7e-4 max |Δ|,
    1 − cos 5e-6; Q8_0: its activations rounded to 8 bits too), and ours are no farther from
    sentence-transformers' than llama.cpp's."""
    f32, q8, st = minilm
    path = f32 if kind == "f32" else q8
    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, verbose=False)
    model = mlxlis.load(path, "float32", dequantize=False)
    for text in REAL_TEXTS:
        assert llm.tokenize(text.encode()) == model.embedder.tokenizer.encode(text)[0]
    theirs = np.array(llm.embed(REAL_TEXTS, normalize=True))
    ours, ref = np.array(model.embed(REAL_TEXTS)), st.encode(REAL_TEXTS, convert_to_numpy=True)
    within_llama_cpp(ours, theirs, ref)
    assert (1 - (ours * ref).sum(-1)).max() <= (1 - (theirs * ref).sum(-1)).max() + 1e-7
