"""Family registry: config parsing and model classes per family, as explicit dicts."""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn

from ..config import ModelConfig, RopeConfig, parse_rope
from ..errors import ConfigError, UnsupportedError
from ..loading.limits import check_sizes
from . import gemma, llama
from .activations import GATED


def _llama_config(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    return base


def _qwen2_config(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    # Qwen2 always has a bias on q/k/v and none on o_proj, whatever config.json says
    return base.with_(attention_bias=True, o_bias=False, mlp_bias=False)


# transformers' defaults for keys a Gemma config.json may omit
_GEMMA_DEFAULTS: dict[str, dict] = {
    "gemma": dict(query_pre_attn_scalar=None, attn_logit_softcapping=None,
                  final_logit_softcapping=None, sliding_window=None, pattern=None),
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window=4096, pattern=2),
    "gemma3": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None,
                   final_logit_softcapping=None, sliding_window=4096, pattern=6),
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _positive(cfg: dict, key: str, default, path: str) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"expected a positive number or null, got {value!r}", path=path,
                          field=key)
    return value


def _gemma_config(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    family = base.family
    dflt = _GEMMA_DEFAULTS[family]
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedError("bidirectional (embedding) Gemma models are not implemented",
                               path=path, field="use_bidirectional_attention")
    if family == "gemma":  # Gemma 1 reads hidden_act; its legacy "gelu" means the tanh GELU
        act = cfg.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    else:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GATED:
        raise UnsupportedError(f"activation {act!r} is not implemented", path=path,
                               field="hidden_activation")
    n = base.num_hidden_layers
    layer_types: tuple[str, ...] = ()
    if cfg.get("layer_types") is not None and family != "gemma":
        layer_types = tuple(cfg["layer_types"])
        if len(layer_types) != n or any(t not in LAYER_TYPES for t in layer_types):
            raise ConfigError(f"expected {n} of {LAYER_TYPES}, got {cfg['layer_types']!r}",
                              path=path, field="layer_types")
    elif dflt["pattern"] is not None:  # classic configs: every pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", dflt["pattern"])
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"bad pattern {pattern!r}", path=path, field="sliding_window_pattern")
        layer_types = tuple(LAYER_TYPES[(i + 1) % pattern != 0] for i in range(n))
    window = _positive(cfg, "sliding_window", dflt["sliding_window"], path)
    if window is not None:
        check_sizes({"sliding_window": ("sliding_window", window)}, path)
    if "sliding_attention" in layer_types and window is None:
        raise ConfigError("sliding-window layers need a sliding_window", path=path,
                          field="sliding_window")
    rope, rope_local = base.rope, None
    if family == "gemma3":  # global θ (+ linear scaling) for full layers, a local θ for sliding
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and ("full_attention" in params or
                                         "sliding_attention" in params):
            rope = parse_rope(params.get("full_attention"), cfg.get("rope_theta", 1e6), path,
                              "rope_parameters.full_attention")
            rope_local = parse_rope(params.get("sliding_attention"),
                                    cfg.get("rope_local_base_freq", 1e4), path,
                                    "rope_parameters.sliding_attention")
        else:
            if params is not None:
                rope = parse_rope(params, cfg.get("rope_theta", 1e6), path, "rope_parameters")
            else:
                rope = parse_rope(cfg.get("rope_scaling"), cfg.get("rope_theta", 1e6), path,
                                  "rope_scaling")
            local = _positive(cfg, "rope_local_base_freq", 1e4, path)
            rope_local = RopeConfig(theta=float(local or 1e4))
    qpas = _positive(cfg, "query_pre_attn_scalar", dflt["query_pre_attn_scalar"], path)
    return base.with_(
        hidden_act=act,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope=rope,
        rope_local=rope_local,
        layer_types=layer_types,
        sliding_window=int(window) if window is not None and layer_types else None,
        query_pre_attn_scalar=float(qpas) if qpas is not None and family != "gemma" else None,
        attn_logit_softcapping=_positive(cfg, "attn_logit_softcapping",
                                         dflt["attn_logit_softcapping"], path),
        final_logit_softcapping=_positive(cfg, "final_logit_softcapping",
                                          dflt["final_logit_softcapping"], path),
    )


CONFIG_PARSERS: dict[str, Callable[[dict, ModelConfig, str], ModelConfig]] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "gemma": _gemma_config,
    "gemma2": _gemma_config,
    "gemma3": _gemma_config,
}

FAMILIES: dict[str, type[nn.Module]] = {
    "llama": llama.Model,
    "qwen2": llama.Model,
    "gemma": gemma.Model,
    "gemma2": gemma.Model,
    "gemma3": gemma.Model,
}


def parse_family_config(family: str, cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    if family not in CONFIG_PARSERS:
        raise UnsupportedError(f"family {family!r} is not implemented yet", path=path,
                               field="model_type")
    return CONFIG_PARSERS[family](cfg, base, path)


def build_model(cfg: ModelConfig, **kwargs) -> nn.Module:
    return FAMILIES[cfg.family](cfg, **kwargs)
