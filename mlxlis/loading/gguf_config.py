"""ModelConfig from GGUF metadata (`{arch}.*` keys), mirroring what llama.cpp reads."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..config import ModelConfig, RopeConfig
from ..errors import ConfigError, UnsupportedError
from .limits import check_sizes

ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}

_MISSING = object()


class _Meta:
    def __init__(self, md: dict[str, Any], arch: str, path: str):
        self.md, self.arch, self.path = md, arch, path

    def get(self, key: str, default: Any = _MISSING, kind: type = int) -> Any:
        full = f"{self.arch}.{key}"
        value = self.md.get(full, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ConfigError("required metadata key missing", path=self.path, field=full)
            return default
        if isinstance(value, np.ndarray):  # per-layer arrays: we need them uniform
            if value.size == 0 or not (value == value.flat[0]).all():
                raise UnsupportedError(
                    "per-layer values that differ are not supported", path=self.path, field=full
                )
            value = value.flat[0].item()
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)  # inf / NaN: int() would raise
        if not ok or (kind is int and float(value) != int(value)):
            raise ConfigError(
                f"expected a {kind.__name__}, got {value!r}", path=self.path, field=full
            )
        return kind(value)


def config_from_gguf(
    md: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], path: str
) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedError(
            f"architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})",
            path=path,
            field="general.architecture",
        )
    family = ARCHS[arch]
    m = _Meta(md, arch, path)
    if "token_embd.weight" not in tensor_shapes:
        raise ConfigError("tensor token_embd.weight missing", path=path, field="token_embd.weight")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = m.get("embedding_length")
    heads = m.get("attention.head_count")
    kv_heads = m.get("attention.head_count_kv", heads)
    sizes = {  # every size, bounded before anything is computed or built from it
        "hidden_size": (key("embedding_length"), hidden),
        "num_attention_heads": (key("attention.head_count"), heads),
        "num_key_value_heads": (key("attention.head_count_kv"), kv_heads),
        "intermediate_size": (key("feed_forward_length"), m.get("feed_forward_length")),
        "num_hidden_layers": (key("block_count"), m.get("block_count")),
        "max_position_embeddings": (key("context_length"), m.get("context_length", 4096)),
        # Gemma 3 trims embedding rows: the tensor is the truth
        "vocab_size": ("token_embd.weight", tensor_shapes["token_embd.weight"][0]),
    }
    size = check_sizes(sizes, path)
    heads, kv_heads = size["num_attention_heads"], size["num_key_value_heads"]
    if heads % kv_heads:
        raise ConfigError(
            f"head_count_kv {kv_heads} must divide head_count {heads}",
            path=path,
            field=key("attention.head_count_kv"),
        )
    head_dim = m.get("attention.key_length", hidden // heads)
    check_sizes({"head_dim": (key("attention.key_length"), head_dim)}, path)
    theta = m.get("rope.freq_base", 10000.0, float)
    rope = RopeConfig(theta=theta)
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = m.get("rope.scaling.factor", 1.0, float)
        rope = RopeConfig(theta=theta, type="linear", factor=factor)
    elif scaling not in ("none", None):
        raise UnsupportedError(
            f"rope scaling {scaling!r} is not implemented",
            path=path,
            field=f"{arch}.rope.scaling.type",
        )
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        family=family,
        vocab_size=size["vocab_size"],
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=m.get("attention.layer_norm_rms_epsilon", 1e-6, float),
        rope=rope,
        max_position_embeddings=size["max_position_embeddings"],
        tie_word_embeddings="output.weight" not in tensor_shapes,  # llama.cpp omits it when tied
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        o_bias="blk.0.attn_output.bias" in tensor_shapes,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=(eos,) if isinstance(eos, int) else (),
        source=path,
    )
    if family.startswith("gemma"):
        cfg = _gemma(cfg, m, arch)
    return cfg


def _gemma(cfg: ModelConfig, m: _Meta, arch: str) -> ModelConfig:
    n = cfg.num_hidden_layers
    changes: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh"}
    # llama.cpp: the 27B models scale by hidden/heads (below), every other size by head_dim
    changes["query_pre_attn_scalar"] = float(cfg.head_dim)
    if arch in ("gemma2", "gemma3"):
        default = 4096 if arch == "gemma2" else 512
        window = m.get("attention.sliding_window", default)
        check_sizes({"sliding_window": (f"{arch}.attention.sliding_window", window)}, m.path)
    if arch == "gemma2":
        changes.update(
            sliding_window=window,
            layer_types=tuple(
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
            ),
            attn_logit_softcapping=m.get("attn_logit_softcapping", 50.0, float),
            final_logit_softcapping=m.get("final_logit_softcapping", 30.0, float),
        )
    elif arch == "gemma3":
        # llama.cpp's Gemma 3: 5 sliding layers then 1 global, local RoPE base 10 000
        changes.update(
            sliding_window=window,
            layer_types=tuple(
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
            ),
            rope_local=RopeConfig(theta=10000.0),
        )
    if (arch, n) in (("gemma2", 46), ("gemma3", 62)):  # the 27B models
        changes["query_pre_attn_scalar"] = float(cfg.hidden_size // cfg.num_attention_heads)
    return cfg.with_(**changes)
