"""A decoder family's network run as an encoder: the whole padded batch in one forward, no
cache, its last hidden states (after the final norm) pooled by the embedding runtime
(embedding.py). Qwen3-Embedding (causal, last-token pooling) and EmbeddingGemma (Gemma 3 with
use_bidirectional_attention: mean pooling, two Dense projections) load this way.

Rows are padded on the right (embedding.Embedder.hidden). Causal: every pad comes after a row's
real tokens, so no real token sees one and each row's states equal those of the row run alone
(positions 0.. as alone). Bidirectional: the pads are masked as keys, and a sliding layer sees
keys within its window on both sides (|q − k| < window, transformers' bidirectional overlay).

A decoder folder is an embedding model when it is a sentence-transformers folder with a Pooling
module (modules.json); the rule is `embedding_folder`.
"""

from __future__ import annotations

from pathlib import Path

from mlxlis.bounded import check_folder_json
from mlxlis.errors import MlxlisError, UnsupportedError
from mlxlis.loading.binding import bind
from mlxlis.loading.safetensors import load_tensors
from mlxlis.loading.sentence_folder import SentenceFolder, read_sentence_folder
from mlxlis.models import build_model
from mlxlis.models.config import ModelConfig
from mlxlis.models.embedding import Embedder
from mlxlis.models.from_encoder import sentence_pooling
from mlxlis.models.model import Model
from mlxlis.tokenizer import Tokenizer
from mlxlis.tokenizer.pairs import EncoderTokenizer

import mlx.core as mx
import mlx.nn as nn


def embedding_folder(folder: Path) -> SentenceFolder | None:
    """The folder's sentence-transformers layout where it pools (modules.json with a Pooling
    module: an embedding model), else None (a causal LM folder)."""
    st = read_sentence_folder(folder)
    return st if st is not None and st.pooling is not None else None


class DecoderEncoder(nn.Module):
    """A decoder network (decoder.Decoder or a family's subclass) as an encoder.EncoderNetwork:
    (B, T) ids and mask -> (B, T, hidden) final-normed hidden states."""

    def __init__(self, net: nn.Module, final_norm: bool = True):
        super().__init__()
        self.net = net
        self.config: ModelConfig = net.config
        self._final_norm = final_norm  # False: the states `net.head` takes (a reranker's)

    def masks(self, mask: mx.array) -> tuple[mx.array, mx.array | None]:
        """Bidirectional masks from the (B, T) token mask: (full (B, 1, T, T), sliding or
        None). A pad query also sees itself, so no row of scores is all masked (its NaN would
        reach real rows through the values)."""
        T = mask.shape[1]
        pos = mx.arange(T)
        keys = (mask > 0)[:, None, None, :] | (pos[:, None] == pos[None, :])  # (B, 1, T, T)
        window = self.config.attention.sliding_window
        if window is None:
            return keys, None
        near = mx.abs(pos[:, None] - pos[None, :]) < window  # (T, T)
        return keys, keys & near

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        net, cfg = self.net, self.config
        h = net.embed(ids)  # (B, T, hidden)
        if cfg.attention.causal:
            h = net.run_layers(h)  # causal (and causal windows): pads sit after real tokens
        else:
            full, sliding = self.masks(mask)
            for i, layer in enumerate(net.model.layers):
                h = layer(h, sliding if cfg.is_sliding(i) else full, None)
        return net.model.norm(h) if self._final_norm else h  # (B, T, hidden)

    def classify(self, h: mx.array) -> mx.array:
        raise UnsupportedError("a decoder embedding model has no classification head")


def _weights(folder: Path) -> dict[str, mx.array]:
    """The checkpoint under the decoder's names: a base model's (Qwen3Model, Gemma3TextModel)
    tensors sit at the root (`layers.0...`), a causal LM's under `model.`; a head is unused."""
    out = {}
    for name, arr in load_tensors(folder).items():
        if name.startswith("lm_head."):
            continue
        out[name if name.startswith("model.") else "model." + name] = arr
    return out


def load_decoder_embedder(
    folder: Path, cfg: ModelConfig, st: SentenceFolder, dtype: mx.Dtype
) -> Model:
    """A decoder family's sentence-transformers folder as an embedding Model (task "embed")."""
    # built tied: the head is never run, so no lm_head awaits a tensor the base model lacks
    net = build_model(cfg.with_(tie_word_embeddings=True))
    bind(net, net.sanitize(_weights(folder)), folder, dtype)
    check_folder_json(folder)  # bounds the tokenizer's JSON files before they are parsed
    if not (folder / "tokenizer.json").is_file():
        raise UnsupportedError(
            "an embedding model needs its tokenizer.json", path=folder, field="tokenizer.json"
        )
    limit = cfg.max_position_embeddings
    length = min(limit, st.max_seq_length) if st.max_seq_length else limit
    encoder = DecoderEncoder(net)
    embedder = Embedder(
        net=encoder,
        tokenizer=EncoderTokenizer(folder / "tokenizer.json", length),
        pad_id=0,  # never seen by a real token (see the module's doc)
        task="embed",
        pooling=sentence_pooling(st, cfg.hidden_size, dtype),
        prompts=st.prompts,
        default_prompt=st.default_prompt_name,
    )
    return Model(
        cfg,
        encoder,
        Tokenizer.from_folder(folder),
        dtype=dtype,
        path=folder,
        fmt="safetensors",
        task="embed",
        embedder=embedder,
    )


TASKS = (None, "generate", "embed", "rerank")


def decoder_task(folder: Path, cfg: ModelConfig, task: str | None, dtype: mx.Dtype) -> Model | None:
    """The rule for a decoder family's folder: a sentence-transformers folder that pools is an
    embedding model (unless `task` says "generate" or "rerank"); a causal LM folder generates,
    or reranks when `task` is "rerank" (decoder_rerank.py). The embedding Model, or None where
    the folder loads as a network of its family; what `task` asks that the folder is not,
    refused."""
    if task not in TASKS:
        raise MlxlisError(f"task {task!r}: expected generate, embed or rerank", field="task")
    st = embedding_folder(folder) if task in (None, "embed") else None
    if st is not None:
        return load_decoder_embedder(folder, cfg, st, dtype)
    if task == "embed":
        raise UnsupportedError(
            "not an embedding model: no sentence-transformers Pooling module (modules.json)",
            path=folder,
            field="task",
        )
    return None
