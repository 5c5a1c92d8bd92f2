"""SmolLM3: Llama's decoder with NoPE layers (no RoPE on every no_rope_layer_interval-th layer,
default 4, or where `no_rope_layers` — 1 meaning "has RoPE" — says 0), optionally a sliding
window on the NoPE layers (use_sliding_window + sliding_window, as transformers places it).

HF `smollm3` (transformers' SmolLM3Config defaults: θ 2e6, tied embeddings; a window where
layer_types says, as its eager attention has it); mlx-lm's layout is the same names. GGUF
`smollm3` (llama.cpp's SmolLM3Model, a LlamaModel: Q/K rows permuted, undone on load; its
graph fixes NoPE on every 4th layer, read the same way). Its chat template switches reasoning
with enable_thinking or "/think" / "/no_think" in the system message; a prompt ending in an
empty <think></think> starts the answer (prompt/reasoning.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError
from mlxlis.limits import check_sizes
from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.conventions import UNPERMUTE_K, UNPERMUTE_Q
from mlxlis.models.decoder import Decoder
from mlxlis.models.reading import check_act

HF_DEFAULTS = {  # transformers' SmolLM3Config, for the keys the shared parser reads
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 2e6,
    "tie_word_embeddings": True,
}
GGUF_NOPE_EVERY = 4  # llama.cpp's smollm3: n_no_rope_layer_step, set rather than read
LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_on(cfg: dict, n: int, path: str) -> list[int]:
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = check_sizes(
            {
                "no_rope_layer_interval": (
                    "no_rope_layer_interval",
                    cfg.get("no_rope_layer_interval", 4),
                )
            },
            path,
        )["no_rope_layer_interval"]
        return [int((i + 1) % every != 0) for i in range(n)]
    if (
        not isinstance(flags, list)
        or len(flags) != n
        or any(isinstance(v, bool) or v not in (0, 1) for v in flags)
    ):
        raise ConfigError(
            f"expected {n} flags of 0 or 1, got {flags!r}"[:200], path=path, field="no_rope_layers"
        )
    return flags


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    n = base.num_hidden_layers
    rope_on = _rope_on(cfg, n, path)
    window = cfg.get("sliding_window")
    if window is not None:
        window = check_sizes({"sliding_window": ("sliding_window", window)}, path)["sliding_window"]
    types = cfg.get("layer_types")
    if types is None:  # transformers: sliding on the NoPE layers, when use_sliding_window
        on = bool(cfg.get("use_sliding_window")) and window is not None
        types = [LAYER_TYPES[on and not r] for r in rope_on]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"expected {n} of {LAYER_TYPES}, got {types!r}"[:300], path=path, field="layer_types"
        )
    # transformers' eager and sdpa attention slide where layer_types says, by sliding_window
    # (use_sliding_window is read by flash-attention only)
    if window is None or "sliding_attention" not in types:
        types, window = [], None
    return check_act(
        base.with_(
            attention=replace(
                base.attention,
                no_rope_layers=tuple(not r for r in rope_on),
                sliding_window=window,
            ),
            layer_types=tuple(types),
        ),
        path,
    )


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    n = base.num_hidden_layers
    nope = tuple((i + 1) % GGUF_NOPE_EVERY == 0 for i in range(n))
    return base.with_(attention=replace(base.attention, no_rope_layers=nope))


def export(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "attention_bias": cfg.attention.bias,
        "mlp_bias": cfg.mlp.bias,
        "no_rope_layers": [int(not x) for x in cfg.attention.no_rope_layers],
        "use_sliding_window": cfg.attention.sliding_window is not None,
        "sliding_window": cfg.attention.sliding_window,
        "layer_types": list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers,
    }


SMOLLM3 = Family(
    name="smollm3",
    hf=HFFormat(
        model_types=("smollm3",),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
    ),
    gguf=GGUFFormat(
        archs=("smollm3",),
        parse=parse_gguf,
        conventions=(UNPERMUTE_Q, UNPERMUTE_K),  # SmolLM3Model is a LlamaModel
    ),
    network=Decoder,
    export=Export(
        model_type="smollm3",
        architecture="SmolLM3ForCausalLM",
        config=export,
    ),
)
