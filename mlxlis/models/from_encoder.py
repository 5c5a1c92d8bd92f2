"""An encoder's folder as a Model that embeds or reranks: the network from config.json and the
safetensors, the pooling / Dense / Normalize / prompts from the sentence-transformers files.

A checkpoint with a classification head (BertForSequenceClassification, ...) is a reranker
(task "rerank"): one logit per (query, document) pair, through the activation sentence-
transformers' CrossEncoder applies (its saved activation_fn, else sigmoid for one label).
Any other is an embedding model (task "embed"). A plain Hugging Face folder (no modules.json)
pools as sentence-transformers does when it wraps one: mean pooling, no normalisation.

A GGUF of llama.cpp's converter (`load_encoder_gguf`) states its pooling (`{arch}.pooling_type`,
written from the folder's 1_Pooling: mean, cls or last token; absent: mean, as for a plain
folder) but neither a Normalize module nor max_seq_length, and no CrossEncoder activation.
Embeddings are L2-normalised, as llama.cpp's server returns them by default (embd_normalize
2; llama-cpp-python's `embed` only with normalize=True), and as every sentence-transformers
embedder in the catalog ends; inputs may be as long as the position table (llama.cpp's
limit); a reranker's logit goes through sigmoid, CrossEncoder's default for one label
(llama.cpp's rank pooling returns the logit itself: the same order).
"""

from __future__ import annotations

from pathlib import Path

from mlxlis.bounded import check_folder_json
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.loading.binding import bind
from mlxlis.loading.safetensors import load_tensors
from mlxlis.loading.sentence_folder import (
    DenseFile,
    SentenceFolder,
    max_seq_length,
    read_sentence_folder,
)
from mlxlis.models import build_model
from mlxlis.models.config import ModelConfig, read_json
from mlxlis.models.embedding import Embedder
from mlxlis.models.encoder import EncoderConfig, EncoderNetwork, max_tokens
from mlxlis.models.model import Model
from mlxlis.models.pooling import Dense, Pooling, dense_activation
from mlxlis.tokenizer import Tokenizer
from mlxlis.tokenizer.gguf_encoder import encoder_vocab
from mlxlis.tokenizer.pairs import EncoderTokenizer

import mlx.core as mx

_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


def _dense(d: DenseFile, width: int, dtype: mx.Dtype) -> Dense:
    path = d.path / "config.json"
    weight = d.tensors.get("linear.weight")
    bias = d.tensors.get("linear.bias")
    if weight is None or weight.ndim != 2 or weight.shape[1] != width:
        raise ConfigError(
            f"linear.weight must be (out, {width})",
            path=d.path / "model.safetensors",
            field="linear.weight",
        )
    if d.config.get("bias", True) and bias is None:
        raise ConfigError("the config has a bias the file lacks", path=path, field="bias")
    act = dense_activation(d.config.get("activation_function"), path)
    return Dense(weight.astype(dtype), None if bias is None else bias.astype(dtype), act)


def _activation(folder: Path, cfg: dict, saved: str | None, labels: int) -> str:
    """The CrossEncoder activation: config_sentence_transformers.json's, config.json's (4.x-5.x:
    sentence_transformers.activation_fn; earlier: sbert_ce_default_activation_function), else
    sigmoid for one label."""
    st = cfg.get("sentence_transformers")
    path = saved or (st.get("activation_fn") if isinstance(st, dict) else None)
    path = path or cfg.get("sbert_ce_default_activation_function")
    if path is None:
        return "sigmoid" if labels == 1 else "identity"
    if path not in _ACTIVATIONS:
        raise UnsupportedError(
            f"activation {path!r} is not implemented (Sigmoid, Identity)",
            path=folder / "config_sentence_transformers.json",
            field="activation_fn",
        )
    return _ACTIVATIONS[path]


def sentence_pooling(st: SentenceFolder | None, hidden: int, dtype: mx.Dtype) -> Pooling:
    """The folder's Pooling, Dense modules and Normalize (a plain folder: mean, as
    sentence-transformers wraps one), over hidden states `hidden` wide."""
    if st is not None and st.pooling is not None:
        pooling = Pooling.from_st(st.pooling, st.pooling_path)
    else:
        pooling = Pooling(("mean",))
    dense, width = [], hidden * len(pooling.modes)
    for d in st.dense if st else ():
        dense.append(_dense(d, width, dtype))
        width = dense[-1].weight.shape[0]
    return Pooling(pooling.modes, bool(st and st.normalize), tuple(dense))


def load_encoder_folder(folder: Path, cfg: ModelConfig, dtype: mx.Dtype) -> Model:
    """`folder` (config.json parsed into `cfg` by an encoder family) as an embed or rerank
    Model."""
    enc = cfg.own(EncoderConfig)
    net = build_model(cfg)
    bind(net, net.sanitize(load_tensors(folder)), folder, dtype)
    st = read_sentence_folder(folder)
    limit = max_tokens(cfg)
    wanted = st.max_seq_length if st is not None else max_seq_length(folder)
    length = min(limit, wanted) if wanted else limit
    check_folder_json(folder)
    if not (folder / "tokenizer.json").is_file():
        raise UnsupportedError(
            "an encoder needs its tokenizer.json", path=folder, field="tokenizer.json"
        )
    pairs = EncoderTokenizer(folder / "tokenizer.json", length)
    common = dict(net=net, tokenizer=pairs, pad_id=enc.pad_token_id)
    if enc.head:
        if enc.num_labels != 1:
            raise UnsupportedError(
                f"a classifier of {enc.num_labels} labels (a reranker has one)",
                path=folder / "config.json",
                field="id2label",
            )
        raw = read_json(folder / "config.json")
        act = _activation(folder, raw, st.activation_fn if st else None, enc.num_labels)
        embedder = Embedder(task="rerank", activation=act, **common)
    else:
        pooling = sentence_pooling(st, cfg.hidden_size, dtype)
        prompts = st.prompts if st else {}
        default = st.default_prompt_name if st else None
        embedder = Embedder(
            task="embed", pooling=pooling, prompts=prompts, default_prompt=default, **common
        )
    return Model(
        cfg,
        net,
        Tokenizer.from_folder(folder),
        dtype=dtype,
        path=folder,
        fmt="safetensors",
        task=embedder.task,
        embedder=embedder,
    )


# llama.cpp's pooling types (enum llama_pooling_type) an embedder's GGUF may state
GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
RANK = 4  # llama.cpp's rank pooling: a classifier head's score


def gguf_pooling(md: dict, arch: str, path: Path, head: bool) -> Pooling:
    """An embedder's pooling from `{arch}.pooling_type` (absent: mean), L2-normalised (see
    the module's doc); a reranker's (head) needs none."""
    key = f"{arch}.pooling_type"
    kind = md.get(key)
    if head:
        if kind not in (None, RANK, *GGUF_POOLING):
            raise UnsupportedError(f"pooling type {kind!r} for a reranker", path=path, field=key)
        return Pooling()
    if kind is None:
        return Pooling(("mean",), normalize=True)
    if kind not in GGUF_POOLING:
        known = ", ".join(f"{k} ({m})" for k, m in GGUF_POOLING.items())
        raise UnsupportedError(
            f"pooling type {kind!r} for an embedder (known: {known})", path=path, field=key
        )
    return Pooling((GGUF_POOLING[kind],), normalize=True)


def load_encoder_gguf(
    path: Path,
    cfg: ModelConfig,
    net: EncoderNetwork,
    tokenizer: Tokenizer,
    md: dict,
    dtype: mx.Dtype,
    **model,
) -> Model:
    """The GGUF at `path` (metadata `md`, its network `net` built and bound) as an embed or
    rerank Model; `model`: more of Model's fields (the quantization summary...)."""
    enc = cfg.own(EncoderConfig)
    pairs = EncoderTokenizer(path, max_tokens(cfg), built=encoder_vocab(md, path))
    common = dict(net=net, tokenizer=pairs, pad_id=enc.pad_token_id)
    pooling = gguf_pooling(md, md.get("general.architecture", ""), path, bool(enc.head))
    if enc.head:
        if enc.num_labels != 1:
            raise UnsupportedError(
                f"a classifier of {enc.num_labels} labels (a reranker has one)",
                path=path,
                field="cls.output.weight",
            )
        embedder = Embedder(task="rerank", activation="sigmoid", **common)
    else:
        embedder = Embedder(task="embed", pooling=pooling, **common)
    return Model(
        cfg,
        net,
        tokenizer,
        dtype=dtype,
        path=path,
        fmt="gguf",
        task=embedder.task,
        embedder=embedder,
        **model,
    )
