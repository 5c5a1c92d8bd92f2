"""Nemotron-H (NVIDIA Nemotron Nano v2, Nemotron 3 Nano): one mixer per block, h += mixer(norm(h)),
the mixers as hybrid_override_pattern says — 'M' a Mamba-2 layer (mamba2.py), '*' GQA attention
without positions (no RoPE, scale 1/√head_dim, no biases), '-' an MLP down(relu(up(x))²), 'E' a
mixture of experts: the routed experts (non-gated relu² MLPs, optionally between a latent down-
and up-projection) chosen by sigmoid scores with a correction bias within the best groups
(grouped_experts.GroupRouter), plus a shared relu² MLP on every token. Plain RMSNorms; the
final one named norm_f; an untied head by default.

HF `nemotron_h`: hub configs state hybrid_override_pattern, transformers 5 saves
layers_block_type ("linear_attention" | "full_attention" | "mlp" | "moe"); tensors under
`backbone.` (backbone.embeddings, backbone.norm_f), the experts one tensor each (or transformers
5's fused up_proj / down_proj), the next-token layers (`mtp.*`) skipped; mlx-lm's nemotron_h has
the same names with the experts stacked (`switch_mlp.fc1` / `fc2`) and its conv kernel saved (C,
K, 1). GGUF: llama.cpp's NemotronHModel writes arch `nemotron_h` (MLP blocks) or
`nemotron_h_moe` (expert blocks), head_count_kv nonzero on attention blocks and
feed_forward_length on MLP / expert blocks, the Mamba-2 conventions of mamba2.GGUF_CONVENTIONS
and Llama's Q/K row permute (GraniteHybridModel's undo_permute), here on `mixer.q_proj` / `k_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxlis.cache import CacheBatch, KVCache, KVFormat, RecurrentCache, StatelessCache
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models import mamba2
from mlxlis.models.base import (
    Convention,
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
    MLXFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.conventions import unpermute_rows
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import ExpertSource, SwitchMLP
from mlxlis.models.grouped_experts import GroupRouter, GroupRouting, checked_routing
from mlxlis.models.layers import Attention, Cache, Mask, norm
from mlxlis.models.reading import expert_sizes, flag, moe_config
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

MAMBA, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTN, "-": MLP, "E": MOE}
LEGACY = {"mamba": MAMBA, "attention": ATTN}  # older names transformers remaps
CHUNK = 128  # transformers' chunk_size default (GGUF files do not say)
MAMBA_KEYS = {  # the mixer's config.json keys and transformers' defaults
    "heads": ("mamba_num_heads", 128),
    "head_dim": ("mamba_head_dim", 64),
    "state": ("ssm_state_size", 128),
    "groups": ("n_groups", 8),
    "conv_kernel": ("conv_kernel", 4),
    "chunk": ("chunk_size", CHUNK),
}
BIASES = ("use_conv_bias", "use_bias")  # the conv's; in_proj's and out_proj's
GGUF_BLOCK = {
    "attn_norm": "norm",
    **{f"attn_{p}": f"mixer.{p}_proj" for p in "qkv"},
    "attn_output": "mixer.o_proj",
    **mamba2.gguf_block("mixer"),
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mixer.gate",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps": "mixer.switch_mlp.fc1",
    "ffn_down_exps": "mixer.switch_mlp.fc2",
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
}


# llama.cpp permutes attn_q / attn_k rows for its RoPE layout even without RoPE: undone
MIXER_Q: Convention = (
    lambda n: ".mixer.q_proj." in n,
    lambda w, c, _: unpermute_rows(w, c.num_attention_heads),
)
MIXER_K: Convention = (
    lambda n: ".mixer.k_proj." in n,
    lambda w, c, _: unpermute_rows(w, c.num_key_value_heads),
)


@dataclass(frozen=True)
class NemotronHConfig(FamilyConfig):
    """The Mamba-2 layers' shape; the expert blocks' routing and latent width (0: none)."""

    mamba: mamba2.Mamba2Config
    routing: GroupRouting | None = None
    latent: int = 0


def relu2(x: mx.array) -> mx.array:
    return mx.square(nn.relu(x))


class Relu2MLP(nn.Module):
    """down(relu(up(x))²)."""

    def __init__(self, d: int, f: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronMoE(nn.Module):
    """The routed relu² experts (in the latent width, when there is one) weighted by the
    grouped sigmoid router, plus the shared MLP on the block's input."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        own, moe, d = cfg.own(NemotronHConfig), cfg.moe, cfg.hidden_size
        self.gate = GroupRouter(cfg, own.routing)
        width = own.latent or d
        self.switch_mlp = SwitchMLP(moe.num_experts, width, moe.intermediate_size, relu2)
        if own.latent:
            self.fc1_latent_proj = nn.Linear(d, width, bias=cfg.mlp.bias)
            self.fc2_latent_proj = nn.Linear(width, d, bias=cfg.mlp.bias)
        self.shared_experts = Relu2MLP(d, own.routing.shared_intermediate_size, cfg.mlp.bias)

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.gate(x)
        h = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        y = self.switch_mlp(h, inds)  # (B, T, k, width)
        y = (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)
        y = self.fc2_latent_proj(y) if "fc2_latent_proj" in self else y
        return y + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """h += mixer(norm(h)); an MLP or expert block advances its StatelessCache."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None, layer: int):
        super().__init__()
        kind, d = cfg.layer_types[layer], cfg.hidden_size
        self.norm = norm(cfg, d)
        if kind == MAMBA:
            self.mixer = mamba2.Mamba2Mixer(d, cfg.own(NemotronHConfig).mamba)
        elif kind == ATTN:
            self.mixer = Attention(cfg, None)
        elif kind == MLP:
            self.mixer = Relu2MLP(d, cfg.mlp.intermediate_size, cfg.mlp.bias)
        else:
            self.mixer = NemotronMoE(cfg)
        self._kind = kind

    def __call__(
        self, h: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        x = self.norm(h)
        if self._kind == MAMBA:
            return h + self.mixer(x, cache)
        if self._kind == ATTN:
            return h + self.mixer(x, mask, cache, positions)
        for c in cache.caches if isinstance(cache, CacheBatch) else [cache]:
            if c is not None:
                c.advance(x.shape[1])
        return h + self.mixer(x)


class NemotronH(Decoder):
    """The shared decoder with Nemotron-H's blocks: a RecurrentCache per Mamba block, a KV
    cache per attention block, a StatelessCache per MLP or expert block."""

    layer: type[nn.Module] = NemotronHBlock

    def _cache(self, i: int, kv: KVFormat | None) -> Cache:
        kind = self.config.layer_types[i]
        if kind == MAMBA:
            return RecurrentCache()
        return KVCache(kv) if kind == ATTN else StatelessCache()

    def expert_stacks(self) -> dict[str, ExpertSource]:
        stacks: dict[str, ExpertSource] = {}
        n = self.config.moe.num_experts if self.config.moe else 0
        for i, layer in enumerate(self.model.layers):
            if layer is not None and isinstance(layer.mixer, NemotronMoE):
                p = f"model.layers.{i}.mixer"
                for ours, theirs in (("fc1", "up_proj"), ("fc2", "down_proj")):
                    parts = tuple(f"{p}.experts.{e}.{theirs}.weight" for e in range(n))
                    src = ExpertSource(parts, f"{p}.experts.{theirs}", None)
                    stacks[f"{p}.switch_mlp.{ours}.weight"] = src
        return stacks


def _types(cfg: dict, path: str) -> tuple[str, ...]:
    """hybrid_override_pattern (a string of M * - E), else layers_block_type's names."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN):
            field = "hybrid_override_pattern"
            raise ConfigError(
                f"expected a string of M * - E, got {pattern!r}"[:200], path=path, field=field
            )
        return tuple(PATTERN[c] for c in pattern)
    key = "layers_block_type" if "layers_block_type" in cfg else "layer_types"
    types = cfg.get(key)
    names = (MAMBA, ATTN, MLP, MOE)
    if (
        not isinstance(types, list)
        or not types
        or any(LEGACY.get(t, t) not in names for t in types)
    ):
        raise ConfigError(f"expected a list of {names}, got {types!r}"[:300], path=path, field=key)
    return tuple(LEGACY.get(t, t) for t in types)


def _base(cfg: dict) -> dict:
    """What the shared parser reads: the layer count from the pattern, the norms' eps."""
    out = dict(cfg)
    try:
        out["num_hidden_layers"] = len(_types(cfg, ""))
    except ConfigError:  # parse_hf names the field
        out["num_hidden_layers"] = cfg.get("num_hidden_layers") or 1
    out["rms_norm_eps"] = cfg.get("layer_norm_epsilon", 1e-5)
    out["hidden_act"] = "silu"  # the MLPs' relu² is mlp_hidden_act, checked by parse_hf
    return out


def _with(base: ModelConfig, own: NemotronHConfig, types: tuple[str, ...], moe) -> ModelConfig:
    attention = replace(
        base.attention, bias=False, o_bias=False, no_rope_layers=(True,) * len(types)
    )
    return base.with_(layer_types=types, moe=moe, attention=attention, family_config=own)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    types = _types(cfg, path)
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise UnsupportedError(f"MLP activation {act!r}", path=path, field="mlp_hidden_act")
    mamba = mamba2.from_hf(cfg, MAMBA_KEYS, BIASES, base.norms.eps, path)
    moe, routing, latent = None, None, 0
    if MOE in types:
        keys = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        defaults = (8, 2, 7688)
        sizes = {
            f: (k, cfg.get(k, d))
            for f, k, d in zip(
                ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
                keys,
                defaults,
                strict=True,
            )
        }
        norm_topk = flag({"norm_topk_prob": True, **cfg}, "norm_topk_prob", path)
        moe = moe_config(
            expert_sizes(sizes, path), tuple(t == MOE for t in types), norm_topk_prob=norm_topk
        )
        shared = cfg.get("moe_shared_expert_intermediate_size", 7688)
        routing = checked_routing(
            moe,
            cfg.get("n_group", 1),
            cfg.get("topk_group", 1),
            cfg.get("routed_scaling_factor", 1.0),
            shared,
            path,
            ("n_group", "topk_group", "routed_scaling_factor"),
        )
        latent = cfg.get("moe_latent_size") or 0
    own = NemotronHConfig(mamba, routing, latent)
    mlp = replace(base.mlp, bias=flag(cfg, "mlp_bias", path), hidden_act="relu2")
    return _with(base.with_(mlp=mlp, num_hidden_layers=len(types)), own, types, moe)


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    """Attention blocks state KV heads, MLP / expert blocks a feed_forward_length, the rest
    are Mamba blocks."""
    n, eps = base.num_hidden_layers, m.get("attention.layer_norm_epsilon", 1e-5, float)
    base = base.with_(norms=replace(base.norms, eps=eps))  # plain eps, not the _rms_ key
    attn = mamba2.attention_layers(m.md.get(m.key("attention.head_count_kv"), 0), n, m)
    ff = m.md.get(m.key("feed_forward_length"), 0)
    ff = ff.tolist() if hasattr(ff, "tolist") else [ff] * n
    experts = m.arch == "nemotron_h_moe"
    types = tuple(
        ATTN if a else (MOE if experts else MLP) if f else MAMBA
        for a, f in zip(attn, ff, strict=True)
    )
    if m.has("moe_latent_size"):
        raise UnsupportedError(
            "latent expert projections in GGUF", path=m.path, field=m.key("moe_latent_size")
        )
    moe, routing = None, None
    if experts:
        keys = {
            "num_experts": "expert_count",
            "num_experts_per_tok": "expert_used_count",
            "moe_intermediate_size": "expert_feed_forward_length",
        }
        sizes = {f: (m.key(k), m.get(k)) for f, k in keys.items()}
        norm_topk = bool(m.md.get(m.key("expert_weights_norm"), False))
        moe = moe_config(
            expert_sizes(sizes, m.path), tuple(t == MOE for t in types), norm_topk_prob=norm_topk
        )
        groups = m.get("expert_group_count", 1)
        if groups > 1 and not m.has("expert_group_used_count"):
            raise UnsupportedError(
                f"{groups} expert groups, none said used",
                path=m.path,
                field=m.key("expert_group_used_count"),
            )
        routing = checked_routing(
            moe,
            groups,
            m.get("expert_group_used_count", 1),
            m.get("expert_weights_scale", 1.0, float),
            m.get("expert_shared_feed_forward_length"),
            m.path,
            tuple(
                m.key(k)
                for k in ("expert_group_count", "expert_group_used_count", "expert_weights_scale")
            ),
        )
    own = NemotronHConfig(mamba2.from_gguf(m, base.norms.eps, CHUNK), routing)
    counts = m.md.get(m.key("attention.head_count_kv"), 0)
    kv = max(counts.tolist()) if hasattr(counts, "tolist") else counts
    mlp_width = max(ff) if any(ff) else base.mlp.intermediate_size
    mlp = replace(base.mlp, intermediate_size=mlp_width, hidden_act="relu2")
    base = base.with_(num_key_value_heads=kv or base.num_attention_heads, mlp=mlp)
    return _with(base, own, types, moe)


def export(cfg: ModelConfig) -> dict[str, Any]:
    own, moe = cfg.own(NemotronHConfig), cfg.moe
    m, r = own.mamba, own.routing
    out = {
        "layers_block_type": list(cfg.layer_types),
        "num_hidden_layers": cfg.num_hidden_layers,
        "head_dim": cfg.head_dim,
        **{key: getattr(m, name) for name, (key, _) in MAMBA_KEYS.items()},
        "use_conv_bias": m.conv_bias,
        "use_bias": m.proj_bias,
        "mamba_proj_bias": m.proj_bias,
        "time_step_limit": list(m.dt_limit),
        "mlp_hidden_act": "relu2",
        "mlp_bias": cfg.mlp.bias,
        "attention_bias": False,
        "layer_norm_epsilon": cfg.norms.eps,
        "expand": m.inner // cfg.hidden_size,
    }
    if moe is not None:
        out |= {
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.intermediate_size,
            "moe_shared_expert_intermediate_size": r.shared_intermediate_size,
            "n_shared_experts": 1,
            "norm_topk_prob": moe.norm_topk_prob,
            "n_group": r.n_group,
            "topk_group": r.topk_group,
            "routed_scaling_factor": r.routed_scaling_factor,
            "moe_latent_size": own.latent or None,
        }
    return out


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(NemotronHConfig)
    layers = sum(t == MAMBA for t in c.layer_types)
    pattern = "".join(k for t in c.layer_types for k, v in PATTERN.items() if v == t)
    return {"mamba2": {**mamba2.describe(own.mamba, layers), "pattern": pattern}}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    m = config["mamba2"]
    blocks = "M Mamba-2, * attention (no positions), - relu² MLP, E experts"
    return [mamba2.row(m, config["layers"]), ("pattern", f"{m['pattern']} ({blocks})")]


NEMOTRON_H = Family(
    name="nemotron_h",
    hf=HFFormat(
        model_types=("nemotron_h",),
        parse=parse_hf,
        defaults={"max_position_embeddings": 4096, "num_key_value_heads": 8},
        base=_base,
        renames=(
            ("backbone.embeddings.", "model.embed_tokens."),
            ("backbone.norm_f.", "model.norm."),
            ("backbone.", "model."),
        ),
        dropped=("mtp.",),  # the next-token layers: drafting with them is not implemented
    ),
    gguf=GGUFFormat(
        archs=("nemotron_h", "nemotron_h_moe"),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        conventions=(*mamba2.GGUF_CONVENTIONS, MIXER_Q, MIXER_K),
        per_layer_keys=("attention.head_count_kv", "feed_forward_length"),
    ),
    network=NemotronH,
    export=Export(
        model_type="nemotron_h",
        architecture="NemotronHForCausalLM",
        config=export,
        renames=(
            ("model.embed_tokens.", "backbone.embeddings."),
            ("model.norm.", "backbone.norm_f."),
            ("model.", "backbone."),
        ),
    ),
    mlx=MLXFormat(layouts={"mixer.conv1d.weight": (0, 2, 1)}),  # mlx-lm's sanitize: (C, K, 1)
    describe=Description(("mamba2",), _describe, _rows),
)
