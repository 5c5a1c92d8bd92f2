"""nomic-bert: a post-norm encoder with rotary positions and a SwiGLU MLP (nomic-embed-text v1 /
v1.5 embedding models).

Per layer: LayerNorm(x + attention(x)), LayerNorm(x + fc2(silu(fc12(x)) * fc11(x))); one fused
Wqkv and no biases in attention or MLP; the embeddings are words + token types, then LayerNorm
(no position table: RoPE on the whole head, rotate-half layout). Config keys come in two
spellings: nomic's own (n_embd, n_head, rotary_emb_base, qkv_proj_bias, ...) on the Hub and
transformers' (hidden_size, rope_parameters, ...) in transformers' NomicBertConfig; both are
read. What neither reference computes (a partial or interleaved rotary, biases, pre-norm,
scaled rotary) is refused naming the field. NomicBertForSequenceClassification (BERT's pooler
and classifier on the first token) is a reranker. HF `nomic_bert`.

GGUF `nomic-bert` (llama.cpp's converter takes nomic's config keys only): Wqkv kept as one
attn_qkv, fc11 / fc12 as ffn_up / ffn_gate apart; the network takes that layout as it is
(`NomicConfig.gguf_layout`), the same products.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.encoder import (
    ACTIVATIONS,
    GLU,
    EncoderAttention,
    EncoderConfig,
    PostNormBlock,
    attention_mask,
    gguf_names,
    gguf_pad,
    label_count,
    norm_eps,
    pad_id,
    rotary,
    type_vocab,
)

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class NomicConfig(EncoderConfig):
    """nomic-bert's own fields beside the encoder's."""

    rope_theta: float = 1000.0
    gguf_layout: bool = False  # one qkv projection, gate and up apart (as llama.cpp's)


# nomic's config.json keys -> transformers' (the shared parser reads the latter)
_KEYS = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}
# nomic's activation_function names: the gate's activation of the GLU
_GLU_ACTS = {"swiglu": "silu", "geglu": "gelu"}
# settings whose other values neither reference implements: key -> the value supported
_FIXED = {
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_scaling_factor": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "prenorm": False,
    "causal": False,
}


def _base(cfg: dict) -> dict:
    """config.json under transformers' key names (nomic's spelling mapped where it is used)."""
    out = dict(cfg)
    for old, new in _KEYS.items():
        if new not in out and old in out:
            out[new] = out[old]
    if "intermediate_size" not in out and "hidden_size" in out:
        out["intermediate_size"] = 4 * out["hidden_size"]  # nomic's n_inner default
    return out


def _parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    cfg = _base(cfg)
    for key, value in _FIXED.items():
        if cfg.get(key, value) != value:
            raise UnsupportedError(
                f"{key} {cfg[key]!r} is not implemented (only {value!r})", path=path, field=key
            )
    act = cfg.get("hidden_act") or _GLU_ACTS.get(cfg.get("activation_function", "swiglu"))
    if act not in ACTIVATIONS:
        field = "hidden_act" if "hidden_act" in cfg else "activation_function"
        raise UnsupportedError(
            f"activation {cfg.get(field)!r} is not implemented", path=path, field=field
        )
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedError(
            f"rope_type {rope['rope_type']!r} (only the default)",
            path=path,
            field="rope_parameters",
        )
    theta = rope.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 1000.0)))
    if not isinstance(theta, (int, float)) or not theta > 1:
        raise ConfigError(
            f"expected a RoPE base, got {theta!r}", path=path, field="rotary_emb_base"
        )
    eps = norm_eps(cfg, "layer_norm_eps", 1e-12, path)
    types = type_vocab(cfg, path)
    pad = pad_id(cfg, 0, path)
    num_labels = label_count(cfg, path)
    head = "NomicBertForSequenceClassification" in (cfg.get("architectures") or ())
    enc = NomicConfig(
        head="pooler" if head else "",
        num_labels=num_labels,
        layer_norm_eps=eps,
        type_vocab_size=types,
        pad_token_id=pad,
        positions="rotary",
        hidden_act=act,
        rope_theta=float(theta),
    )
    mlp = replace(base.mlp, hidden_act=act, bias=False)
    attention = replace(base.attention, bias=False, causal=False)
    return base.with_(family_config=enc, mlp=mlp, attention=attention)


def _parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    if m.md.get(m.key("attention.causal"), False) is not False:
        raise UnsupportedError("a causal encoder", path=m.path, field=m.key("attention.causal"))
    types = m.shapes.get("token_types.weight", (0,))[0]
    enc = NomicConfig(
        layer_norm_eps=norm_eps(m.md, m.key("attention.layer_norm_epsilon"), 1e-12, m.path),
        type_vocab_size=types,
        pad_token_id=gguf_pad(m),
        positions="rotary",
        hidden_act="silu",  # the converter takes swiglu only
        rope_theta=base.rope.theta,
        gguf_layout=True,
    )
    mlp = replace(base.mlp, hidden_act="silu", bias=False)
    attention = replace(base.attention, bias=False, causal=False)
    return base.with_(family_config=enc, mlp=mlp, attention=attention, tie_word_embeddings=False)


# llama.cpp's tensor names (less .weight / .bias) -> ours
_GGUF_NAMES = [
    (r"token_embd", "embeddings.words"),
    (r"token_types", "embeddings.types"),
    (r"token_embd_norm", "embeddings.norm"),
    (r"blk\.(\d+)\.attn_qkv", r"layers.\1.attention.qkv"),
    (r"blk\.(\d+)\.attn_output", r"layers.\1.attention.out"),
    (r"blk\.(\d+)\.attn_output_norm", r"layers.\1.attention_norm"),
    (r"blk\.(\d+)\.ffn_gate", r"layers.\1.mlp.gate"),  # fc12, activated
    (r"blk\.(\d+)\.ffn_up", r"layers.\1.mlp.up"),  # fc11
    (r"blk\.(\d+)\.ffn_down", r"layers.\1.mlp.down"),
    (r"blk\.(\d+)\.layer_output_norm", r"layers.\1.mlp_norm"),
]
gguf_name = gguf_names(_GGUF_NAMES)


# checkpoint names -> ours, first match wins (nomic's names, which transformers also saves)
_RENAMES = [
    (r"^nomic_bert\.", ""),
    (r"^embeddings\.word_embeddings\.", "embeddings.words."),
    (r"^embeddings\.token_type_embeddings\.", "embeddings.types."),
    (r"^emb_ln\.", "embeddings.norm."),
    (r"^encoder\.layers\.(\d+)\.attn\.out_proj\.", r"layers.\1.attention.out."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc2\.", r"layers.\1.mlp.down."),
    (r"^encoder\.layers\.(\d+)\.norm1\.", r"layers.\1.attention_norm."),
    (r"^encoder\.layers\.(\d+)\.norm2\.", r"layers.\1.mlp_norm."),
]
_RENAMES_RE = [(re.compile(p), r) for p, r in _RENAMES]
_QKV = re.compile(r"^encoder\.layers\.(\d+)\.attn\.Wqkv\.weight$")
_FC = re.compile(r"^encoder\.layers\.(\d+)\.mlp\.fc1([12])\.weight$")


class NomicEmbeddings(nn.Module):
    """Word + token type embeddings, then LayerNorm (positions are rotary)."""

    def __init__(self, cfg: ModelConfig, enc: EncoderConfig):
        super().__init__()
        self.words = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.type_rows = enc.type_vocab_size
        if enc.type_vocab_size:
            self.types = nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)

    def __call__(self, ids: mx.array, types: mx.array | None) -> mx.array:
        x = self.words(ids)
        if self.type_rows:
            x = x + self.types(mx.zeros_like(ids) if types is None else types)
        return self.norm(x)  # (B, T, hidden)


class NomicBertNetwork(nn.Module):
    """Embeddings and the post-norm rotary SwiGLU layers; a reranker's head where the
    checkpoint has one."""

    def __init__(self, cfg: ModelConfig, family: Family | None = None):
        super().__init__()
        self.config = cfg
        enc = cfg.own(NomicConfig)
        h, eps = cfg.hidden_size, enc.layer_norm_eps
        self.embeddings = NomicEmbeddings(cfg, enc)
        rope, gguf = rotary(cfg.head_dim, enc.rope_theta), enc.gguf_layout
        heads, ff = cfg.num_attention_heads, cfg.mlp.intermediate_size
        self.layers = [
            PostNormBlock(
                EncoderAttention(h, heads, cfg.head_dim, bias=False, rope=rope, fused=gguf),
                GLU(h, ff, enc.hidden_act, apart=gguf),
                nn.LayerNorm(h, eps=eps),
                nn.LayerNorm(h, eps=eps),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self._head = enc.head
        if enc.head:  # BERT's: a tanh dense on the first token, then a linear classifier
            self.pooler = nn.Linear(h, h)
            self.classifier = nn.Linear(h, enc.num_labels)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        x = self.embeddings(ids, types)
        m = attention_mask(mask)
        for layer in self.layers:
            x = layer(x, m)
        return x  # (B, T, hidden)

    def classify(self, h: mx.array, mask: mx.array) -> mx.array:
        """(B, T, hidden) -> (B, num_labels): the pooler and classifier on the first token."""
        if not self._head:
            raise UnsupportedError(
                "this checkpoint has no classification head", field="architectures"
            )
        return self.classifier(mx.tanh(self.pooler(h[:, 0])))

    def sanitize(self, weights: dict) -> dict:
        """Checkpoint names under ours: each fused Wqkv split into query, key and value (rows
        [q | k | v]); fc12 (the gate, activated) and fc11 joined as the GLU's [gate | up];
        a masked-LM head and a pooler dropped."""
        weights = {re.sub(r"^nomic_bert\.", "", k): v for k, v in weights.items()}
        ours = {}
        for name, value in weights.items():
            if (m := _QKV.match(name)) is not None:
                q, k, v = mx.split(value, 3, axis=0)
                for part, t in (("query", q), ("key", k), ("value", v)):
                    ours[f"layers.{m[1]}.attention.{part}.weight"] = t
                continue
            if (m := _FC.match(name)) is not None:
                up = weights.get(f"encoder.layers.{m[1]}.mlp.fc11.weight")
                if m[2] == "2" and up is not None:  # without fc11 the binding names gate_up
                    ours[f"layers.{m[1]}.mlp.gate_up.weight"] = mx.concatenate([value, up])
                continue
            for pattern, repl in _RENAMES_RE:
                name = pattern.sub(repl, name)
            if name.startswith(("embeddings.", "layers.")) and not name.endswith("position_ids"):
                ours[name] = value
            elif self._head and name.startswith(("pooler.dense.", "classifier.")):
                ours[name.replace("pooler.dense.", "pooler.")] = value
        return ours


NOMIC_BERT = Family(
    name="nomic_bert",
    hf=HFFormat(model_types=("nomic_bert",), parse=_parse_hf, base=_base),
    gguf=GGUFFormat(archs=("nomic-bert",), parse=_parse_gguf, block={}, names=gguf_name),
    network=NomicBertNetwork,
    export=Export(model_type="nomic_bert", architecture="NomicBertModel"),
    kind="encoder",
)
