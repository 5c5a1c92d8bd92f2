"""BERT and XLM-RoBERTa: post-norm encoders with absolute positions (embedding models such as
all-MiniLM, bge-*-en-v1.5, e5, bge-m3, multilingual-e5) and their sequence-classification heads
(cross-encoders such as ms-marco MiniLM and bge-reranker).

One unit, two model types: they share the forward; XLM-R counts positions from past its padding
index and, as a classifier, has RoBERTa's head (dense + tanh + out_proj) instead of BERT's pooler
and linear classifier. HF `bert` and `xlm-roberta` (also `roberta`).

GGUF `bert`, as llama.cpp's converter writes BertModel, XLMRobertaModel and
XLMRobertaForSequenceClassification: q, k, v kept apart (no fusion, no permutation); for XLM-R
the position table cut to start past the padding index, so a GGUF counts positions from 0;
a RoBERTa head's dense and out_proj as `cls` and `cls.output`. The file does not say the
activation: exact (erf) GELU, BertConfig's default, the one the released checkpoints use
(llama.cpp's graph runs GELU too). A BertForSequenceClassification GGUF has lost its pooler
(the converter drops pooler.dense: `cls.output` without `cls`): refused, not run headless.
"""

from __future__ import annotations

import re
from dataclasses import replace

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.encoder import (
    ACTIVATIONS,
    Encoder,
    EncoderConfig,
    gguf_names,
    gguf_pad,
    label_count,
    norm_eps,
    pad_id,
    type_vocab,
)

import mlx.core as mx
import mlx.nn as nn

# architectures whose checkpoint holds a classification head, and which head
_HEADS = {
    "BertForSequenceClassification": "pooler",
    "XLMRobertaForSequenceClassification": "roberta",
    "RobertaForSequenceClassification": "roberta",
}


def _parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    model_type = cfg["model_type"]
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedError(
            f"position_embedding_type {cfg['position_embedding_type']!r} (only absolute)",
            path=path,
            field="position_embedding_type",
        )
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise UnsupportedError(
            f"activation {act!r} is not implemented", path=path, field="hidden_act"
        )
    heads = [_HEADS[a] for a in cfg.get("architectures") or () if a in _HEADS]
    pad = pad_id(cfg, 1 if model_type != "bert" else 0, path, null_is_default=True)
    eps = norm_eps(cfg, "layer_norm_eps", 1e-12, path)
    types = type_vocab(cfg, path)
    num_labels = label_count(cfg, path)
    enc = EncoderConfig(
        layer_norm_eps=eps,
        type_vocab_size=types,
        pad_token_id=pad,
        position_offset=0 if model_type == "bert" else pad + 1,
        hidden_act=act,
        head=heads[0] if heads else "",
        num_labels=num_labels,
    )
    if enc.position_offset >= base.max_position_embeddings:
        raise ConfigError(
            "no positions past the padding index", path=path, field="max_position_embeddings"
        )
    mlp = replace(base.mlp, hidden_act=act, bias=True)
    attention = replace(base.attention, bias=True, o_bias=True, causal=False)
    return base.with_(family_config=enc, mlp=mlp, attention=attention)


def _parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    if m.md.get(m.key("attention.causal"), False) is not False:
        raise UnsupportedError(
            "only a bidirectional encoder is read", path=m.path, field=m.key("attention.causal")
        )
    shapes = m.shapes
    if "cls.output.weight" in shapes and "cls.weight" not in shapes:
        raise UnsupportedError(
            "a classifier without its pooler (llama.cpp's converter drops a "
            "BertForSequenceClassification's pooler.dense): convert the folder's safetensors",
            path=m.path,
            field="cls.weight",
        )
    eps = m.get("attention.layer_norm_epsilon", kind=float)
    if not 0 <= eps < 1:
        raise ConfigError(
            f"expected a small number, got {eps!r}",
            path=m.path,
            field=m.key("attention.layer_norm_epsilon"),
        )
    head = "cls.output.weight" in shapes
    enc = EncoderConfig(
        layer_norm_eps=eps,
        type_vocab_size=shapes["token_types.weight"][0] if "token_types.weight" in shapes else 0,
        pad_token_id=gguf_pad(m),
        position_offset=0,  # the converter cut XLM-R's table to start at its first position
        hidden_act="gelu",
        head="roberta" if head else "",
        num_labels=shapes["cls.output.weight"][0] if head else 1,
    )
    mlp = replace(base.mlp, hidden_act="gelu", bias=True)
    attention = replace(base.attention, bias=True, o_bias=True, causal=False)
    return base.with_(family_config=enc, mlp=mlp, attention=attention, tie_word_embeddings=False)


# llama.cpp's tensor names (less .weight / .bias) -> our modules
_GGUF_NAMES = [
    (r"token_embd", "encoder.embeddings.words"),
    (r"position_embd", "encoder.embeddings.positions"),
    (r"token_types", "encoder.embeddings.types"),
    (r"token_embd_norm", "encoder.embeddings.norm"),
    (r"blk\.(\d+)\.attn_q", r"encoder.layers.\1.attention.query"),
    (r"blk\.(\d+)\.attn_k", r"encoder.layers.\1.attention.key"),
    (r"blk\.(\d+)\.attn_v", r"encoder.layers.\1.attention.value"),
    (r"blk\.(\d+)\.attn_output", r"encoder.layers.\1.attention.out"),
    (r"blk\.(\d+)\.attn_output_norm", r"encoder.layers.\1.attention_norm"),
    (r"blk\.(\d+)\.ffn_up", r"encoder.layers.\1.up"),
    (r"blk\.(\d+)\.ffn_down", r"encoder.layers.\1.down"),
    (r"blk\.(\d+)\.layer_output_norm", r"encoder.layers.\1.mlp_norm"),
    (r"cls", "head_dense"),  # RoBERTa's head: dense (+ tanh), then out_proj
    (r"cls\.output", "classifier"),
]
gguf_name = gguf_names(_GGUF_NAMES)


# checkpoint names (after the prefix a task model adds) -> ours, first match wins
_RENAMES = [
    (r"^(bert|roberta)\.", ""),
    (r"\.gamma$", ".weight"),  # checkpoints from before LayerNorm's weight was so called
    (r"\.beta$", ".bias"),
    (r"^embeddings\.word_embeddings\.", "encoder.embeddings.words."),
    (r"^embeddings\.position_embeddings\.", "encoder.embeddings.positions."),
    (r"^embeddings\.token_type_embeddings\.", "encoder.embeddings.types."),
    (r"^embeddings\.LayerNorm\.", "encoder.embeddings.norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.", r"encoder.layers.\1.attention."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"encoder.layers.\1.attention.out."),
    (
        r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.",
        r"encoder.layers.\1.attention_norm.",
    ),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"encoder.layers.\1.up."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"encoder.layers.\1.down."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"encoder.layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "pooler."),
    (r"^classifier\.dense\.", "head_dense."),
    (r"^classifier\.out_proj\.", "classifier."),
]
_RENAMES_RE = [(re.compile(p), r) for p, r in _RENAMES]


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor name under our module names (each rule applied once, in order)."""
    for pattern, repl in _RENAMES_RE:
        name = pattern.sub(repl, name)
    return name


class BertNetwork(nn.Module):
    """The encoder, and a cross-encoder's head where the checkpoint has one."""

    def __init__(self, cfg: ModelConfig, family: Family | None = None):
        super().__init__()
        self.config = cfg
        self._enc = cfg.own(EncoderConfig)
        self.encoder = Encoder(cfg)
        h = cfg.hidden_size
        if self._enc.head == "pooler":
            self.pooler = nn.Linear(h, h)
        elif self._enc.head == "roberta":
            self.head_dense = nn.Linear(h, h)
        if self._enc.head:
            self.classifier = nn.Linear(h, self._enc.num_labels)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        return self.encoder(ids, mask, types)  # (B, T, hidden)

    def classify(self, h: mx.array, mask: mx.array | None = None) -> mx.array:
        """(B, T, hidden) -> (B, num_labels): the head on the first token ([CLS] / <s>)."""
        if not self._enc.head:
            raise UnsupportedError(
                "this checkpoint has no classification head", field="architectures"
            )
        first = h[:, 0]
        dense = self.pooler if self._enc.head == "pooler" else self.head_dense
        return self.classifier(mx.tanh(dense(first)))

    def sanitize(self, weights: dict) -> dict:
        """Checkpoint names under ours; what this network does not use dropped (a base model's
        pooler when there is no head, the position_ids buffer)."""
        ours = {}
        has_pooler = self._enc.head == "pooler"
        for name, value in weights.items():
            new = checkpoint_name(name)
            if new.endswith("position_ids") or (new.startswith("pooler.") and not has_pooler):
                continue
            ours[new] = value
        return ours


BERT = Family(
    name="bert",
    hf=HFFormat(model_types=("bert", "xlm-roberta", "roberta"), parse=_parse_hf),
    gguf=GGUFFormat(archs=("bert",), parse=_parse_gguf, block={}, names=gguf_name),
    network=BertNetwork,
    export=Export(model_type="bert", architecture="BertModel"),
    kind="encoder",
)
