"""OLMo 3: a post-norm decoder — each sublayer's output RMSNormed inside the residual
(post_attention_layernorm, post_feedforward_layernorm; no norm on the sublayers' inputs) —
with q and k RMSNormed over the whole projection (all heads at once) before RoPE, sliding-window
layers where layer_types says (transformers' default: three sliding, then one full), no biases
unless attention_bias, a tied or untied head.

HF `olmo3`: transformers 5 states RoPE per layer type (rope_parameters' full_attention and
sliding_attention: YaRN on the full layers only, in the released checkpoints); the hub's classic
rope_theta / rope_scaling read as its Olmo3Config intends them (θ for both types, the scaling
on the full layers). mlx-lm's olmo3 has the same names. GGUF: llama.cpp's converter writes
OLMo 3 as `olmo2` (its Olmo2Model: no permutation), with attention.sliding_window,
sliding_window_pattern and rope.freq_base_swa; its graph turns the sliding layers without the
scaling, as transformers does. An `olmo2` file without a window is an OLMo 2, the same block.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError
from mlxlis.limits import check_sizes
from mlxlis.models.base import (
    GGUF_LLAMA_BLOCK,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import ModelConfig, RopeConfig, parse_rope, yarn_keys
from mlxlis.models.decoder import Decoder
from mlxlis.models.layers import MLP, PostNormBlock, WholeQKNormAttention
from mlxlis.models.reading import check_act
from mlxlis.models.rope import Rope

import mlx.nn as nn
import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 500000.0  # Olmo3Config.default_theta
HF_DEFAULTS = {  # transformers' Olmo3Config, for the keys the shared parser reads
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
HF_WINDOW = 4096  # Olmo3Config's sliding_window default
GGUF_EVERY = 4  # llama.cpp's olmo2 without a pattern key: three sliding layers, then one full
GGUF_BLOCK = {
    **{k: v for k, v in GGUF_LLAMA_BLOCK.items() if k not in ("attn_norm", "ffn_norm")},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class Olmo3Layer(PostNormBlock):
    """The post-norm block over attention with whole-projection q/k norms and the SwiGLU MLP."""

    attention = WholeQKNormAttention

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__(cfg, rope, MLP(cfg))


class Olmo3(Decoder):
    """The shared decoder with OLMo 3's blocks."""

    layer: type[nn.Module] = Olmo3Layer


def _default_types(n: int) -> list[str]:
    return [FULL if (i + 1) % GGUF_EVERY == 0 else SLIDING for i in range(n)]


def _ropes(cfg: dict, path: str) -> tuple[RopeConfig, RopeConfig]:
    """(the full layers' RoPE, the sliding layers')."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = parse_rope(params.get(FULL), DEFAULT_THETA, path, f"rope_parameters.{FULL}")
        local = parse_rope(params.get(SLIDING), DEFAULT_THETA, path, f"rope_parameters.{SLIDING}")
        return full, local
    # classic keys: transformers 5.25 reads rope_theta into the full layers only (its sliding
    # layers keep 5e5); the released checkpoints state 5e5, where both readings agree
    theta = cfg.get("rope_theta", DEFAULT_THETA)
    if isinstance(params, dict):
        full = parse_rope(params, theta, path, "rope_parameters")
    else:
        full = parse_rope(cfg.get("rope_scaling"), theta, path, "rope_scaling")
    return full, RopeConfig(theta=full.theta)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n = base.num_hidden_layers
    types = cfg.get("layer_types") or _default_types(n)
    if (
        not isinstance(types, list)
        or len(types) != n
        or any(t not in (SLIDING, FULL) for t in types)
    ):
        raise ConfigError(
            f"expected {n} of {(SLIDING, FULL)}, got {types!r}"[:300],
            path=path,
            field="layer_types",
        )
    window = cfg.get("sliding_window", HF_WINDOW)
    if SLIDING not in types:
        types, window = [], None
    else:
        window = check_sizes({"sliding_window": ("sliding_window", window)}, path)["sliding_window"]
    rope, local = _ropes(cfg, path)
    attention = replace(base.attention, sliding_window=window, rope_local=local if types else None)
    mlp = replace(base.mlp, bias=False)  # Olmo3MLP has no bias; attention_bias covers q/k/v/o
    return check_act(
        base.with_(rope=rope, attention=attention, mlp=mlp, layer_types=tuple(types)), path
    )


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    n, field = base.num_hidden_layers, m.key("attention.sliding_window_pattern")
    window = m.get("attention.sliding_window", 0)
    if not window:  # OLMo 2
        return base
    check_sizes({"sliding_window": (m.key("attention.sliding_window"), window)}, m.path)
    pattern = m.md.get(field)
    if pattern is None:
        types = _default_types(n)
    elif isinstance(pattern, np.ndarray) and pattern.shape == (n,):
        types = [SLIDING if x else FULL for x in pattern.tolist()]
    else:
        raise ConfigError(f"expected {n} bools, got {pattern!r}"[:200], path=m.path, field=field)
    if SLIDING not in types:
        return base
    local = RopeConfig(theta=m.get("rope.freq_base_swa", base.rope.theta, float))
    attention = replace(base.attention, sliding_window=window, rope_local=local)
    return base.with_(attention=attention, layer_types=tuple(types))


def _rope_keys(r: RopeConfig) -> dict[str, Any]:
    """A RopeConfig as one of transformers 5's rope_parameters entries."""
    if r.type == "yarn":
        return {**yarn_keys(r), "rope_theta": r.theta}
    keys: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type != "default":
        keys["factor"] = r.factor
    if r.type == "llama3":
        keys["low_freq_factor"] = r.low_freq_factor
        keys["high_freq_factor"] = r.high_freq_factor
        keys["original_max_position_embeddings"] = r.original_max_position_embeddings
    return keys


def export(cfg: ModelConfig) -> dict[str, Any]:
    a, n = cfg.attention, cfg.num_hidden_layers
    return {  # classic rope_theta / rope_scaling (mlx-lm's reading) come from the shared keys
        "attention_bias": a.bias,
        "sliding_window": a.sliding_window or HF_WINDOW,  # mlx-lm requires the key
        "layer_types": list(cfg.layer_types) or [FULL] * n,
        "rope_parameters": {
            FULL: _rope_keys(cfg.rope),
            SLIDING: _rope_keys(a.rope_local or cfg.rope),
        },
    }


def _describe(c: ModelConfig) -> dict[str, Any]:
    local = c.attention.rope_local
    return {"post_norm": {"qk_norm": "whole projection", "local_rope_theta": local and local.theta}}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    p = config["post_norm"]
    rows = [("block", "post-norm (each sublayer's output normed), q/k norms over all heads")]
    if p["local_rope_theta"] is not None:
        rows.append(("local", f"θ {p['local_rope_theta']:g} on the sliding layers, unscaled"))
    return rows


OLMO3 = Family(
    name="olmo3",
    hf=HFFormat(model_types=("olmo3",), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(archs=("olmo2",), parse=parse_gguf, block=GGUF_BLOCK),
    network=Olmo3,
    export=Export(model_type="olmo3", architecture="Olmo3ForCausalLM", config=export),
    describe=Description(("post_norm",), _describe, _rows),
)
