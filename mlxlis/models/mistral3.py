"""Mistral (7B, Nemo, Small 3.x) and Ministral 3 / Devstral 2 (text): the Llama decoder with
  window         every layer sees the last `sliding_window` positions when the config sets
                 one (transformers' MistralModel and Ministral3Model: one mask for all)
  RoPE           YaRN where configured (Ministral 3: factor 16 over 16384, mscale and
                 mscale_all_dim giving the attention factor)
  temperature    Ministral 3's llama_4_scaling_beta: every layer's queries scaled by
                 1 + beta·log(1 + ⌊p / original_max_position_embeddings⌋)
HF `mistral`, `ministral3` and the `mistral3` wrapper (`model.language_model.*` or the older
`language_model.model.*`; the Pixtral vision tower and its projector skipped and said), mlx-lm's
layouts; GGUF `mistral3` (llama.cpp's Ministral3Model: Q/K permuted as for Llama,
attention.temperature_scale the beta, its floor the YaRN original context) — Mistral GGUFs of
arch `llama` are the Llama family's. `convert` writes `ministral3` where a temperature or YaRN
is configured (mlx-lm's ministral3 reads them from rope_parameters), else `mistral`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import (
    LANGUAGE_MODEL_RENAMES,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import ModelConfig, number, yarn_keys, yarn_mscale
from mlxlis.models.conventions import UNPERMUTE_K, UNPERMUTE_Q
from mlxlis.models.decoder import Decoder, DecoderLayer
from mlxlis.models.layers import TemperedAttention
from mlxlis.models.reading import check_act, rope_freqs_as_config

SLIDING = "sliding_attention"


def _window(cfg: ModelConfig, window: int | None) -> ModelConfig:
    n = cfg.num_hidden_layers
    attention = replace(cfg.attention, sliding_window=window)
    return cfg.with_(attention=attention, layer_types=(SLIDING,) * n if window else ())


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    base = check_act(base, path)
    # transformers' MistralConfig defaults to a window of 4096 (Ministral3Config to none)
    window = cfg.get("sliding_window", 4096 if cfg.get("model_type") == "mistral" else None)
    if window is not None:
        window = check_sizes({"sliding_window": ("sliding_window", window)}, path)
        window = window["sliding_window"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    fld = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    beta = rope.get("llama_4_scaling_beta") if isinstance(rope, dict) else None
    temperature = None
    if beta is not None:
        orig = rope.get("original_max_position_embeddings")
        if not number(beta) or beta < 0:
            raise ConfigError(
                f"llama_4_scaling_beta must be a number ≥ 0, got {beta!r}"[:200],
                path=path,
                field=fld,
            )
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise ConfigError(
                "llama_4_scaling_beta needs a positive original_max_position_embeddings, "
                f"got {orig!r}"[:200],
                path=path,
                field=fld,
            )
        temperature = (orig, float(beta)) if beta else None
    return _temperature(_window(base, window), temperature)


def parse_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    beta = meta.get("attention.temperature_scale", 0.0, float)
    temperature = None
    if beta:  # llama.cpp's floor is the YaRN original context
        if base.rope.type != "yarn":
            raise ConfigError(
                "attention.temperature_scale needs YaRN's rope.scaling.original_context_length",
                path=meta.path,
                field=meta.key("attention.temperature_scale"),
            )
        temperature = (base.rope.original_max_position_embeddings, beta)
    return _temperature(base, temperature)


def _temperature(cfg: ModelConfig, temperature: tuple[int, float] | None) -> ModelConfig:
    """Ministral 3's temperature on every layer's queries, from position 0."""
    att = replace(
        cfg.attention, temperature=temperature, temperature_offset=0, temperature_all=True
    )
    return cfg.with_(attention=att)


def export(cfg: ModelConfig) -> dict[str, Any]:
    """MistralConfig's keys, or Ministral3Config's (rope_parameters with the temperature's
    beta and YaRN's mscale pair, which mlx-lm reads: mscale 1 and the mscale_all_dim that
    gives the attention factor) when a temperature or YaRN is configured."""
    out: dict[str, Any] = {"sliding_window": cfg.attention.sliding_window}
    r = cfg.rope
    if cfg.attention.temperature is None and r.type != "yarn":
        return out
    if r.type not in ("default", "yarn"):  # Ministral3Config's rope_parameters say no other
        raise UnsupportedError(
            f"a position temperature with {r.type} RoPE scaling cannot be written",
            path=cfg.source,
            field="rope_parameters",
        )
    params: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type == "yarn":
        m1 = yarn_mscale(r.factor)
        all_dim = (
            (m1 / r.attention_factor - 1) / (0.1 * math.log(r.factor)) if r.factor > 1 else 1.0
        )
        params.update(yarn_keys(r), mscale=1.0, mscale_all_dim=all_dim)
    floor, beta = cfg.attention.temperature or (r.original_max_position_embeddings, 0.0)
    if r.type == "yarn" and floor != r.original_max_position_embeddings:
        raise ConfigError(
            f"the temperature's floor {floor} is not YaRN's original context "
            f"{r.original_max_position_embeddings}: Ministral3Config cannot say both",
            path=cfg.source,
            field="llama_4_scaling_beta",
        )
    params.update(llama_4_scaling_beta=beta, original_max_position_embeddings=floor)
    if cfg.attention.sliding_window:  # mlx-lm's ministral3 reads the window per layer type only
        out["layer_types"] = list(cfg.layer_types)
    return {
        **out,
        "rope_scaling": None,  # rope_parameters says it (transformers would merge the two)
        "model_type": "ministral3",
        "architectures": ["Ministral3ForCausalLM"],
        "rope_parameters": params,
    }


class Mistral3Layer(DecoderLayer):
    attention = TemperedAttention  # the temperature on every layer, none where unset


class Mistral3(Decoder):
    """The shared decoder with Ministral 3's tempered attention."""

    layer = Mistral3Layer


MISTRAL3 = Family(
    name="mistral3",
    hf=HFFormat(
        model_types=("mistral", "ministral3", "mistral3"),
        parse=parse_hf,
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=(
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "vision_tower.",
            "multi_modal_projector.",
        ),
    ),
    gguf=GGUFFormat(
        archs=("mistral3",),
        parse=parse_gguf,
        conventions=(UNPERMUTE_Q, UNPERMUTE_K),  # Ministral3Model is a LlamaModel
        rope_freqs=rope_freqs_as_config,
    ),
    network=Mistral3,
    export=Export(
        model_type="mistral",
        architecture="MistralForCausalLM",
        config=export,
    ),
)
