"""The gated-DeltaNet hybrid decoder's configuration as files state it, shared by the families
built on it (Qwen3.5 / 3.6, Qwen3-Next, Qwen4-Exp): its layer kinds, the DeltaNet and MoE
sizes, the partial RoPE, config.json and GGUF readers, llama.cpp's tensor names, what
`convert` writes, and the names a text load leaves out. A family composes these with its own
defaults (qwen3_5.py, qwen3_next.py, qwen4_exp.py); the layers are deltanet.py's and the
shared decoder's, its attention layers.GatedAttention (HybridLayer)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import GGUFMeta, MLXFormat
from mlxlis.models.config import DeltaNetConfig, ModelConfig, MoEConfig
from mlxlis.models.conventions import ZERO_CENTRED_NORM_MINUS_ONE
from mlxlis.models.decoder import Decoder, DecoderLayer
from mlxlis.models.layers import GatedAttention
from mlxlis.models.reading import check_act, moe_config

LAYER_TYPES = ("linear_attention", "full_attention")
HF_DEFAULTS = {  # transformers' Qwen3_5TextConfig
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
DELTANET = tuple(k for k in HF_DEFAULTS if k.startswith("linear_"))  # DeltaNetConfig's, prefixed
MOE_DEFAULTS = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


def read_layer_types(cfg: dict, n: int, path: str) -> tuple[str, ...]:
    if cfg.get("layer_types") is not None:
        types = tuple(cfg["layer_types"])
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(
                f"expected {n} of {LAYER_TYPES}, got {cfg['layer_types']!r}"[:300],
                path=path,
                field="layer_types",
            )
        return types
    every = cfg.get("full_attention_interval", 4)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"bad interval {every!r}", path=path, field="full_attention_interval")
    return tuple(LAYER_TYPES[(i + 1) % every == 0] for i in range(n))


def read_rotary_dim(cfg: dict, head_dim: int, path: str) -> int:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(
            f"expected a number in (0, 1], got {factor!r}", path=path, field="partial_rotary_factor"
        )
    dim = int(head_dim * factor)
    if dim % 2:
        raise ConfigError(
            f"rotary dims {dim} must be even", path=path, field="partial_rotary_factor"
        )
    return dim


def deltanet(size: dict[str, int], **more: Any) -> DeltaNetConfig:
    """The DeltaNet's shape from its `linear_*` sizes."""
    return DeltaNetConfig(**{k.removeprefix("linear_"): size[k] for k in DELTANET}, **more)


def moe_keys(moe: MoEConfig) -> dict[str, int]:
    """The experts' config.json keys (MOE_DEFAULTS')."""
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.intermediate_size,
        "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
    }


def hf_parser(moe: bool):
    def parse(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
        keys = {**HF_DEFAULTS, **(MOE_DEFAULTS if moe else {})}
        size = check_sizes(
            {k: (k, cfg.get(k) if cfg.get(k) is not None else v) for k, v in keys.items()}, path
        )
        if size["linear_num_value_heads"] % size["linear_num_key_heads"]:
            raise ConfigError(
                "linear_num_key_heads must divide linear_num_value_heads",
                path=path,
                field="linear_num_key_heads",
            )
        n = base.num_hidden_layers
        changes: dict[str, Any] = dict(
            norms=replace(base.norms, kind="rms_plus_one"),
            mlp=replace(base.mlp, bias=False),
            head_dim=size["head_dim"],
            attention=replace(
                base.attention,
                qk_norm=True,
                o_bias=base.attention.bias,
                rotary_dim=read_rotary_dim(cfg, size["head_dim"], path),
            ),
            layer_types=read_layer_types(cfg, n, path),
            deltanet=deltanet(size),
        )
        if moe:
            if size["num_experts_per_tok"] > size["num_experts"]:
                raise ConfigError(
                    "more experts per token than experts", path=path, field="num_experts_per_tok"
                )
            shared = size["shared_expert_intermediate_size"]
            changes.update(  # the router always renormalises
                moe=moe_config(
                    size, (True,) * n, norm_topk_prob=True, shared_expert_intermediate_size=shared
                )
            )
        return check_act(base.with_(**changes), path)

    return parse


def gguf_parser(moe: bool):
    """llama.cpp's reading of qwen35 / qwen35moe (src/models/qwen35*.cpp): the ssm.* keys give
    the DeltaNet sizes (one state size for k and v heads), attention.recurrent_layers or
    full_attention_interval the layer types; block_count counts the MTP layers too."""

    def parse(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
        mtp = m.get("nextn_predict_layers", 0)
        n = base.num_hidden_layers - mtp
        if not 0 < n:
            raise ConfigError(
                f"{mtp} prediction layers of {base.num_hidden_layers}",
                path=m.path,
                field=m.key("nextn_predict_layers"),
            )
        vh = m.get("ssm.time_step_rank")
        check_sizes({"linear_num_value_heads": (m.key("ssm.time_step_rank"), vh)}, m.path)
        size = check_sizes(
            {
                "linear_conv_kernel_dim": (m.key("ssm.conv_kernel"), m.get("ssm.conv_kernel")),
                "linear_key_head_dim": (m.key("ssm.state_size"), m.get("ssm.state_size")),
                "linear_num_key_heads": (m.key("ssm.group_count"), m.get("ssm.group_count")),
                "linear_num_value_heads": (m.key("ssm.time_step_rank"), vh),
                "linear_value_head_dim": (m.key("ssm.inner_size"), m.get("ssm.inner_size") // vh),
                "rotary_dim": (m.key("rope.dimension_count"), m.get("rope.dimension_count")),
            },
            m.path,
        )
        rotary = size.pop("rotary_dim")
        flags = m.md.get(m.key("attention.recurrent_layers"))
        if flags is not None:
            types = tuple(LAYER_TYPES[not bool(f)] for f in list(flags)[:n])
        else:
            types = read_layer_types(
                {"full_attention_interval": m.get("full_attention_interval", 4)}, n, m.path
            )
        if len(types) != n:
            raise ConfigError(
                f"expected {n} flags", path=m.path, field=m.key("attention.recurrent_layers")
            )
        changes: dict[str, Any] = dict(
            num_hidden_layers=n,
            norms=replace(base.norms, kind="rms_plus_one"),
            attention=replace(base.attention, qk_norm=True, rotary_dim=rotary),
            layer_types=types,
            deltanet=deltanet(size),
        )
        if moe:
            changes.update(
                moe=MoEConfig(
                    m.get("expert_count"),
                    m.get("expert_used_count"),
                    m.get("expert_feed_forward_length"),
                    (True,) * n,
                    norm_topk_prob=True,
                    shared_expert_intermediate_size=m.get("expert_shared_feed_forward_length", 0),
                )
            )
        return base.with_(**changes)

    return parse


def mtp_tensor(name: str, cfg: ModelConfig) -> bool:
    """The multi-token-prediction blocks llama.cpp appends after the model's layers (read on
    their own by qwen3_5_mtp_load.py when drafting)."""
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= cfg.num_hidden_layers


# llama.cpp's names (gguf-py TensorNameMap for QWEN35 / QWEN35MOE); rows keyed "name.part" or
# "name." map to whole parameter paths
GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a.": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def exporter(moe: bool):
    def export(cfg: ModelConfig) -> dict[str, Any]:
        if cfg.rope.type != "default":  # its rope_parameters below would drop the scaling
            raise UnsupportedError(
                f"writing a {cfg.family} model with {cfg.rope.type} RoPE scaling is not supported",
                path=cfg.source,
                field="rope_parameters",
            )
        factor = (cfg.attention.rotary_dim or cfg.head_dim) / cfg.head_dim
        out = {
            "layer_types": list(cfg.layer_types),
            # as Qwen3.5's own configs: readers take θ and the factor from rope_parameters
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": cfg.rope.theta,
                "partial_rotary_factor": factor,
            },
            "attention_bias": cfg.attention.bias,
            "head_dim": cfg.head_dim,
            **{k: getattr(cfg.deltanet, k.removeprefix("linear_")) for k in DELTANET},
        }
        every = next(
            (
                n
                for n in range(1, len(cfg.layer_types) + 1)
                if cfg.layer_types
                == read_layer_types({"full_attention_interval": n}, len(cfg.layer_types), "")
            ),
            None,
        )
        if every:  # readers that know only the interval (mlx-lm) place the layers right
            out["full_attention_interval"] = every
        if moe:
            out.update(moe_keys(cfg.moe))
        return out

    return export


DROPPED = ("model.visual.", "mtp.")
# mlx-lm's sanitize moves the conv1d kernel axis last (C, kernel, 1) and adds 1 to the
# zero-centred norms; a folder it saved has that conv layout
MLX = MLXFormat(
    layouts={"linear_attn.conv1d.weight": (0, 2, 1)},
    conventions=(ZERO_CENTRED_NORM_MINUS_ONE,),
)


class HybridLayer(DecoderLayer):
    """The shared decoder's block: a Gated DeltaNet or the gated attention, then the MLP."""

    attention = GatedAttention


class HybridDecoder(Decoder):
    """The shared decoder over HybridLayer blocks (Qwen3.5 / 3.6, Qwen3-Next)."""

    layer = HybridLayer
