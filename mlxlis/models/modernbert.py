"""ModernBERT: a pre-norm encoder with rotary positions (gte-modernbert, nomic-embed v2 style
embedding models, ModernBERT rerankers).

Per layer: x + attention(LayerNorm(x)), x + GeGLU(LayerNorm(x)); LayerNorms without bias, no
position table (RoPE on q and k), one fused Wqkv. Layers alternate: every
`global_attn_every_n_layers`-th (from the first) attends to the whole row with the global RoPE
theta; the others attend within `local_attention // 2` positions either side, with the local
theta. The embeddings are normalised and the last layer's output takes a final norm.
A sequence classifier (rerankers) pools the first token or the mean over the real tokens, then
dense -> activation -> LayerNorm -> classifier. transformers unpads the batch; the math is that
of the padded batch with masks, which is what runs here. HF `modernbert`.

GGUF `modern-bert` (llama.cpp's converter): one attn_qkv (taken as it is: `gguf_layout`); every
sliding_window_pattern-th layer global from the first (absent: every 3rd), the head pooled as
classifier.pooling_type says (absent: mean), as llama.cpp reads them.
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
    PreNormLayer,
    attention_mask,
    flag,
    gguf_names,
    gguf_pad,
    label_count,
    norm_eps,
    pad_id,
    rotary,
    window_mask,
)
from mlxlis.models.pooling import POOLERS

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class ModernBertConfig(EncoderConfig):
    """ModernBERT's own fields beside the encoder's (and its values of the encoder's)."""

    type_vocab_size: int = 0
    positions: str = "rotary"
    norm: str = "pre"
    global_layers: tuple[bool, ...] = ()  # per layer: True full attention, False local
    window: int = 64  # local layers see positions at most this far on either side
    global_theta: float = 160_000.0
    local_theta: float = 10_000.0
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_pooling: str = "cls"  # "cls" | "mean"
    classifier_act: str = "gelu"
    classifier_bias: bool = False
    gguf_layout: bool = False  # one qkv projection (llama.cpp's attn_qkv)


def _theta(cfg: dict, kind: str, classic: str, default: float, path: str) -> float:
    """The RoPE base of a layer kind: transformers 5's rope_parameters[kind], else the classic
    global_rope_theta / local_rope_theta key, else ModernBERT's default."""
    params = (cfg.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise UnsupportedError(
            f"rope_type {params['rope_type']!r} (only the default)",
            path=path,
            field=f"rope_parameters.{kind}",
        )
    theta = params.get("rope_theta", cfg.get(classic, default))
    if not isinstance(theta, (int, float)) or not theta > 1:
        raise ConfigError(f"expected a RoPE base, got {theta!r}", path=path, field=classic)
    return float(theta)


def _layer_types(cfg: dict, n: int, path: str) -> tuple[bool, ...]:
    """Per layer, whether it attends globally: config.json's layer_types (transformers 5),
    else every global_attn_every_n_layers-th layer from the first."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise ConfigError(f"expected {n} layer types", path=path, field="layer_types")
        known = {"full_attention": True, "sliding_attention": False}
        if any(t not in known for t in types):
            raise UnsupportedError("unknown layer type", path=path, field="layer_types")
        return tuple(known[t] for t in types)
    every = cfg.get("global_attn_every_n_layers", 3)
    if not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"expected a count, got {every!r}", path=path, field="global_attn_every_n_layers"
        )
    return tuple(i % every == 0 for i in range(n))


def _parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    for key, default in (("hidden_activation", "gelu"), ("classifier_activation", "gelu")):
        if cfg.get(key, default) not in ACTIVATIONS:
            raise UnsupportedError(
                f"activation {cfg[key]!r} is not implemented", path=path, field=key
            )
    pooling = cfg.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise UnsupportedError(
            f"classifier pooling {pooling!r} (cls, mean)", path=path, field="classifier_pooling"
        )
    window = cfg.get("local_attention", 128)
    if not isinstance(window, int) or window < 2:
        raise ConfigError(f"expected a window, got {window!r}", path=path, field="local_attention")
    eps = norm_eps(cfg, "norm_eps", 1e-5, path)
    pad = pad_id(cfg, 50283, path)
    num_labels = label_count(cfg, path)
    head = "ModernBertForSequenceClassification" in (cfg.get("architectures") or ())
    act = cfg.get("hidden_activation", "gelu")
    enc = ModernBertConfig(
        layer_norm_eps=eps,
        pad_token_id=pad,
        hidden_act=act,
        head="modernbert" if head else "",
        num_labels=num_labels,
        global_layers=_layer_types(cfg, base.num_hidden_layers, path),
        window=window // 2,  # local_attention is the whole window, centred on the query
        global_theta=_theta(cfg, "full_attention", "global_rope_theta", 160_000.0, path),
        local_theta=_theta(cfg, "sliding_attention", "local_rope_theta", 10_000.0, path),
        norm_bias=flag(cfg, "norm_bias", False, path),
        attention_bias=flag(cfg, "attention_bias", False, path),
        mlp_bias=flag(cfg, "mlp_bias", False, path),
        classifier_pooling=pooling,
        classifier_act=cfg.get("classifier_activation", "gelu"),
        classifier_bias=flag(cfg, "classifier_bias", False, path),
    )
    mlp = replace(base.mlp, hidden_act=act, bias=enc.mlp_bias)
    attention = replace(base.attention, bias=enc.attention_bias, causal=False)
    return base.with_(family_config=enc, mlp=mlp, attention=attention)


def _parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    shapes, act = m.shapes, m.md.get(m.key("hidden_activation"), "gelu")
    window = m.get("attention.sliding_window", 0)
    every = m.get("attention.sliding_window_pattern", 3) if window else 1
    pooling = {1: "mean", 2: "cls"}.get(m.get("classifier.pooling_type", 1))
    head = "cls.output.weight" in shapes
    if act not in ACTIVATIONS or every < 1 or not pooling:
        key = "hidden_activation" if act not in ACTIVATIONS else "classifier.pooling_type"
        key = key if every >= 1 else "attention.sliding_window_pattern"
        raise UnsupportedError("not implemented", path=m.path, field=m.key(key))
    eps = "attention.layer_norm_epsilon"  # the converter writes the rms key
    enc = ModernBertConfig(
        layer_norm_eps=m.get(eps if m.has(eps) else "attention.layer_norm_rms_epsilon", kind=float),
        pad_token_id=gguf_pad(m),
        hidden_act=act,
        head="modernbert" if head else "",
        num_labels=shapes["cls.output.weight"][0] if head else 1,
        global_layers=tuple(i % every == 0 for i in range(base.num_hidden_layers)),
        window=window // 2,  # as local_attention: the whole window, centred on the query
        global_theta=base.rope.theta,
        local_theta=m.get("rope.freq_base_swa", base.rope.theta, float),
        norm_bias="token_embd_norm.bias" in shapes,
        attention_bias="blk.0.attn_qkv.bias" in shapes,
        mlp_bias="blk.0.ffn_up.bias" in shapes,
        classifier_pooling=pooling,
        classifier_bias="cls.bias" in shapes,
        gguf_layout=True,
    )
    mlp = replace(base.mlp, hidden_act=act, bias=enc.mlp_bias)
    attention = replace(base.attention, bias=enc.attention_bias, causal=False)
    return base.with_(family_config=enc, mlp=mlp, attention=attention, tie_word_embeddings=False)


# llama.cpp's tensor names (less .weight / .bias) -> ours
_GGUF_NAMES = [
    (r"token_embd", "embeddings.words"),
    (r"token_embd_norm", "embeddings.norm"),
    (r"blk\.(\d+)\.attn_norm", r"layers.\1.attention_norm"),
    (r"blk\.(\d+)\.attn_qkv", r"layers.\1.attention.qkv"),
    (r"blk\.(\d+)\.attn_output", r"layers.\1.attention.out"),
    (r"blk\.(\d+)\.ffn_norm", r"layers.\1.mlp_norm"),
    (r"blk\.(\d+)\.ffn_up", r"layers.\1.mlp.gate_up"),  # Wi: [input | gate]
    (r"blk\.(\d+)\.ffn_down", r"layers.\1.mlp.down"),
    (r"output_norm", "final_norm"),
    (r"cls", "head_dense"),
    (r"cls\.norm", "head_norm"),
    (r"cls\.output", "classifier"),
]
gguf_name = gguf_names(_GGUF_NAMES)


# checkpoint names (after the task model's "model." prefix) -> ours, first match wins
_RENAMES = [
    (r"^model\.", ""),
    (r"^embeddings\.tok_embeddings\.", "embeddings.words."),
    (r"^layers\.(\d+)\.attn_norm\.", r"layers.\1.attention_norm."),
    (r"^layers\.(\d+)\.attn\.Wo\.", r"layers.\1.attention.out."),
    (r"^layers\.(\d+)\.mlp\.Wi\.", r"layers.\1.mlp.gate_up."),  # [input | gate]: act on the first
    (r"^layers\.(\d+)\.mlp\.Wo\.", r"layers.\1.mlp.down."),
    # a sequence classifier's head (a masked-LM head has the same names: dropped without one)
    (r"^head\.dense\.", "head_dense."),
    (r"^head\.norm\.", "head_norm."),
]
_RENAMES_RE = [(re.compile(p), r) for p, r in _RENAMES]
_QKV = re.compile(r"^layers\.(\d+)\.attn\.Wqkv\.(weight|bias)$")


class ModernBertEmbeddings(nn.Module):
    """Token embeddings, then LayerNorm (no positions: they are rotary)."""

    def __init__(self, cfg: ModelConfig, enc: ModernBertConfig):
        super().__init__()
        self.words = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps, bias=enc.norm_bias)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.norm(self.words(ids))  # (B, T, hidden)


class ModernBertNetwork(nn.Module):
    """Embeddings, the alternating global / local pre-norm layers, the final norm; a
    reranker's head where the checkpoint has one."""

    def __init__(self, cfg: ModelConfig, family: Family | None = None):
        super().__init__()
        self.config = cfg
        enc = self._enc = cfg.own(ModernBertConfig)
        h, eps = cfg.hidden_size, enc.layer_norm_eps

        def norm() -> nn.LayerNorm:
            return nn.LayerNorm(h, eps=eps, bias=enc.norm_bias)

        self.embeddings = ModernBertEmbeddings(cfg, enc)
        self.layers = []
        for i, full in enumerate(enc.global_layers):
            theta = enc.global_theta if full else enc.local_theta
            rope = rotary(cfg.head_dim, theta)
            heads = cfg.num_attention_heads
            attn = EncoderAttention(
                h, heads, cfg.head_dim, enc.attention_bias, rope, fused=enc.gguf_layout
            )
            mlp = GLU(h, cfg.mlp.intermediate_size, enc.hidden_act, bias=enc.mlp_bias)
            self.layers.append(PreNormLayer(attn, mlp, norm() if i else None, norm()))
        self.final_norm = norm()
        if enc.head:
            self.head_dense = nn.Linear(h, h, bias=enc.classifier_bias)
            self.head_norm = norm()
            self.classifier = nn.Linear(h, enc.num_labels)

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        x = self.embeddings(ids)
        full, local = attention_mask(mask), window_mask(mask, self._enc.window)
        for layer, is_global in zip(self.layers, self._enc.global_layers, strict=True):
            x = layer(x, full if is_global else local)
        return self.final_norm(x)  # (B, T, hidden)

    def classify(self, h: mx.array, mask: mx.array) -> mx.array:
        """(B, T, hidden), (B, T) -> (B, num_labels): the first token or the mean over the
        real tokens, then dense -> activation -> LayerNorm -> classifier."""
        if not self._enc.head:
            raise UnsupportedError(
                "this checkpoint has no classification head", field="architectures"
            )
        pooled = POOLERS[self._enc.classifier_pooling](h, mask)  # (B, hidden)
        act = ACTIVATIONS[self._enc.classifier_act]
        return self.classifier(self.head_norm(act(self.head_dense(pooled))))

    def sanitize(self, weights: dict) -> dict:
        """Checkpoint names under ours, each fused Wqkv split into query, key and value rows
        (its rows are [q | k | v], each heads × head_dim); a masked-LM head dropped."""
        ours = {}
        for name, value in weights.items():
            for pattern, repl in _RENAMES_RE:
                name = pattern.sub(repl, name)
            if name.startswith(("decoder.", "head.")) or (
                name.startswith(("head_dense.", "head_norm.", "classifier.")) and not self._enc.head
            ):
                continue
            m = _QKV.match(name)
            if m:
                q, k, v = mx.split(value, 3, axis=0)
                for part, t in (("query", q), ("key", k), ("value", v)):
                    ours[f"layers.{m[1]}.attention.{part}.{m[2]}"] = t
                continue
            ours[name] = value
        return ours


MODERNBERT = Family(
    name="modernbert",
    hf=HFFormat(model_types=("modernbert",), parse=_parse_hf),
    gguf=GGUFFormat(archs=("modern-bert",), parse=_parse_gguf, block={}, names=gguf_name),
    network=ModernBertNetwork,
    export=Export(model_type="modernbert", architecture="ModernBertModel"),
    kind="encoder",
)
