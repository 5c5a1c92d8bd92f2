"""The models: ModelConfig (config.py), one module per family with its GGUF names and
conventions as data, the blocks they share (attention, rope, layers, experts, deltanet, the
Decoder), the Protocols of a network and of a pipeline placement, the Model the public API
hands out (model.py), and building one from a safetensors folder or a GGUF file (from_folder.py,
from_gguf.py). Imports the cache, loading and lower layers.

This module is the family registry: every implemented family, listed once, and the lookups
built from it. Adding a family is one module that builds a `Family` (see base.py), imported
and listed below.
"""

from __future__ import annotations

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.base import Family, Projector
from mlxlis.models.bert import BERT
from mlxlis.models.config import ModelConfig, SpecialTokens, base_config, eos_list
from mlxlis.models.deepseek_v3 import DEEPSEEK_V3
from mlxlis.models.deepseek_v4 import DEEPSEEK_V4
from mlxlis.models.deepseek_v32 import DEEPSEEK_V32
from mlxlis.models.gemma import GEMMA, GEMMA2, GEMMA3
from mlxlis.models.gemma3n import GEMMA3N
from mlxlis.models.gemma4 import GEMMA4
from mlxlis.models.gemma4_assistant import GEMMA4_ASSISTANT, OUTER_KEYS
from mlxlis.models.glm4_moe import GLM4_MOE
from mlxlis.models.gpt_oss import GPT_OSS
from mlxlis.models.granitemoehybrid import GRANITE4
from mlxlis.models.lfm2 import LFM2
from mlxlis.models.llama import LLAMA
from mlxlis.models.llama4 import LLAMA4
from mlxlis.models.minimax_m2 import MINIMAX_M2
from mlxlis.models.mistral3 import MISTRAL3
from mlxlis.models.modernbert import MODERNBERT
from mlxlis.models.nemotron_h import NEMOTRON_H
from mlxlis.models.nomic_bert import NOMIC_BERT
from mlxlis.models.olmo3 import OLMO3
from mlxlis.models.phi3 import PHI3
from mlxlis.models.qwen2 import QWEN2
from mlxlis.models.qwen3 import QWEN3
from mlxlis.models.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from mlxlis.models.qwen3_moe import QWEN3_MOE
from mlxlis.models.qwen3_next import QWEN3_NEXT
from mlxlis.models.qwen4_exp import QWEN4_EXP
from mlxlis.models.smollm3 import SMOLLM3
from mlxlis.models.voxtral import VOXTRAL

import mlx.nn as nn

REGISTRY: dict[str, Family] = {
    f.name: f
    for f in (
        *(
            LLAMA,
            LLAMA4,
            MISTRAL3,
            QWEN2,
            QWEN3,
            QWEN3_MOE,
            QWEN3_5,
            QWEN3_5_MOE,
            QWEN3_NEXT,
            QWEN4_EXP,
            SMOLLM3,
            OLMO3,
            LFM2,
            PHI3,
            GPT_OSS,
            GLM4_MOE,
            MINIMAX_M2,
            DEEPSEEK_V3,
            DEEPSEEK_V32,
            DEEPSEEK_V4,
            GRANITE4,
            NEMOTRON_H,
            VOXTRAL,
        ),
        BERT,
        MODERNBERT,
        NOMIC_BERT,
        *(GEMMA, GEMMA2, GEMMA3, GEMMA3N, GEMMA4, GEMMA4_ASSISTANT),
    )
}
HF_MODEL_TYPES: dict[str, Family] = {t: f for f in REGISTRY.values() for t in f.hf.model_types}
GGUF_ARCHS: dict[str, Family] = {a: f for f in REGISTRY.values() for a in f.gguf.archs}
# the families that see, by name: their towers in llama.cpp's mmproj files (Family.mmproj)
PROJECTORS: dict[str, Projector] = {f.name: f.mmproj for f in REGISTRY.values() if f.mmproj}
# the families' tiny configs that `make install` warms the kernels with (Family.warmup)
WARMUP_CONFIGS: tuple[dict, ...] = tuple(f.warmup for f in REGISTRY.values() if f.warmup)


# keys a multimodal wrapper may hold outside its text_config (Qwen3.5: tie_word_embeddings)
# (a Gemma 4 assistant: its own keys beside text_config)
_OUTER_KEYS = ("tie_word_embeddings", "eos_token_id", "bos_token_id", *OUTER_KEYS)


# transformers' Mxfp4Config (gpt-oss's experts): OCP MX blocks of 32 4-bit e2m1 values, one
# power-of-two (E8M0) scale each — MLX's "mxfp4" mode, bit for bit
MXFP4_QUANT = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def family(name: str) -> Family:
    """The family a ModelConfig names."""
    return REGISTRY[name]


def build_model(cfg: ModelConfig, **kwargs) -> nn.Module:
    """The family's network for `cfg`, parameters not yet loaded; kwargs: loader extras
    (`rope_freq_factors` from a GGUF)."""
    spec = REGISTRY[cfg.family]
    return spec.network(cfg, spec, **kwargs)


def config_from_hf(
    cfg: dict, path: str = "config.json", generation: dict | None = None
) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (classic or transformers-5 keys) and,
    when given, generation_config.json (its EOS ids join the config's)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"expected a JSON object, got {type(cfg).__name__}", path=path)
    if generation is not None and not isinstance(generation, dict):
        raise ConfigError("generation config is not a JSON object", path=path)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        known = ", ".join(sorted(HF_MODEL_TYPES))
        raise UnsupportedError(
            f"model_type {model_type!r} is not supported (known: {known})",
            path=path,
            field="model_type",
        )
    spec = HF_MODEL_TYPES[model_type]
    quant = cfg.get("quantization", cfg.get("quantization_config"))
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" and "bits" not in quant:
        quant = MXFP4_QUANT  # only the modules whose scales the checkpoint has (the experts)
    if "text_config" in cfg:  # multimodal wrapper: the decoder lives in text_config
        text = cfg["text_config"]
        if not isinstance(text, dict):
            raise ConfigError("expected an object", path=path, field="text_config")
        outer = {k: cfg[k] for k in _OUTER_KEYS if k in cfg}  # some wrappers keep these outside
        cfg = {**outer, **text, "model_type": text.get("model_type", model_type)}
    base = base_config(
        {**spec.hf.defaults, **(spec.hf.base(cfg) if spec.hf.base else cfg)}, spec.name, path
    )
    try:
        base = spec.hf.parse(cfg, base, path)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        # config.json is untrusted: a value of the wrong type is a bad file, not a crash
        raise ConfigError(f"malformed value ({type(e).__name__}: {e})"[:300], path=path) from None
    eos = eos_list(cfg.get("eos_token_id"), path, "eos_token_id")
    if generation and generation.get("eos_token_id") is not None:
        eos = tuple(dict.fromkeys(eos + eos_list(generation["eos_token_id"], path, "eos_token_id")))
    bos = cfg.get("bos_token_id")
    if generation and generation.get("bos_token_id") is not None:
        bos = generation["bos_token_id"]
    if isinstance(quant, dict):  # per-module overrides are keyed by checkpoint module paths
        quant = {
            (spec.hf.name(k) if isinstance(v, (dict, bool)) else k): v for k, v in quant.items()
        }
        quant.pop(None, None)  # overrides of dropped modules (a vision tower)
    return base.with_(
        special=SpecialTokens(bos if isinstance(bos, int) else None, eos),
        quantization=quant if isinstance(quant, dict) else None,
    )
