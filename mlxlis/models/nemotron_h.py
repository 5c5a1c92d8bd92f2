"""Nemotron-H (NVIDIA Nemotron Nano v2, Nemotron 3 Nano): blocks h += mixer(norm(h)), the mixer
as hybrid_override_pattern says: 'M' Mamba-2 (mamba2.py), '*' GQA attention without positions
(no RoPE, scale 1/√head_dim, no biases), '-' a relu² MLP down(relu(up(x))²), 'E' experts
(grouped_experts.ReluSquaredMoE: relu² experts, optionally in a latent width, chosen by sigmoid
scores with a correction bias within the best groups, and a shared relu² MLP). Plain RMSNorms,
the final one norm_f; an untied head by default.

HF `nemotron_h`: hub configs state hybrid_override_pattern, transformers 5 saves
layers_block_type ("linear_attention" | "full_attention" | "mlp" | "moe"); tensors under
`backbone.` (embeddings, norm_f), the experts one tensor each (or transformers 5's stacked
up_proj / down_proj), the next-token layers (`mtp.*`) skipped; mlx-lm's nemotron_h has the same
names with the experts stacked (`switch_mlp.fc1` / `fc2`), its conv kernel saved (C, K, 1).
GGUF: llama.cpp's NemotronHModel writes `nemotron_h` (MLP blocks) or `nemotron_h_moe` (expert
blocks), head_count_kv nonzero on attention blocks, feed_forward_length on MLP / expert blocks,
mamba2.GGUF_CONVENTIONS and Llama's Q/K row permute (GraniteHybridModel's undo_permute).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxlis.cache import CacheBatch, KVCache, KVFormat, RecurrentCache, StatelessCache
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models import mamba2
from mlxlis.models.activations import relu2
from mlxlis.models.base import (
    Description,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
    MLXFormat,
)
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.conventions import MIXER_UNPERMUTE_K, MIXER_UNPERMUTE_Q
from mlxlis.models.decoder import Decoder
from mlxlis.models.experts import ExpertSource
from mlxlis.models.grouped_experts import (
    GroupRouting,
    ReluSquaredMoE,
    checked_routing,
    read_routing,
)
from mlxlis.models.layers import Attention, Cache, Mask, UpDownMLP, norm
from mlxlis.models.reading import expert_sizes, flag, gguf_expert_sizes, moe_config
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

MAMBA, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTN, "-": MLP, "E": MOE}
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
EXPERT_KEYS = {  # the experts' config.json keys and transformers' defaults
    "num_experts": ("n_routed_experts", 8),
    "num_experts_per_tok": ("num_experts_per_tok", 2),
    "moe_intermediate_size": ("moe_intermediate_size", 7688),
}
SHARED = "moe_shared_expert_intermediate_size"
RENAMES = (  # the checkpoints' names -> ours
    ("backbone.embeddings.", "model.embed_tokens."),
    ("backbone.norm_f.", "model.norm."),
    ("backbone.", "model."),
)
GGUF_BLOCK = {
    "attn_norm": "norm",
    **{f"attn_{p}": f"mixer.{p}_proj" for p in "qkv"},
    "attn_output": "mixer.o_proj",
    **mamba2.gguf_block("mixer"),
    **{f"ffn_{p}": f"mixer.{p}_proj" for p in ("up", "down")},
    "ffn_gate_inp": "mixer.gate",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps": "mixer.switch_mlp.fc1",
    "ffn_down_exps": "mixer.switch_mlp.fc2",
    **{f"ffn_{p}_shexp": f"mixer.shared_experts.{p}_proj" for p in ("up", "down")},
}


@dataclass(frozen=True)
class NemotronHConfig(FamilyConfig):
    """The Mamba-2 layers' shape; the expert blocks' routing and latent width (0: none)."""

    mamba: mamba2.Mamba2Config
    routing: GroupRouting | None = None
    latent: int = 0


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
            self.mixer = UpDownMLP(d, cfg.mlp.intermediate_size, cfg.mlp.bias, relu2)
        else:
            own = cfg.own(NemotronHConfig)
            self.mixer = ReluSquaredMoE(cfg, own.routing, own.latent)
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
        for i, layer in enumerate(self.model.layers):
            if layer is not None and isinstance(layer.mixer, ReluSquaredMoE):
                stacks.update(layer.mixer.expert_stacks(f"model.layers.{i}.mixer"))
        return stacks


def _types(cfg: dict, path: str) -> tuple[str, ...]:
    """hybrid_override_pattern (a string of M * - E), else layers_block_type's names."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        keys = ("layers_block_type", "layer_types")
        types = mamba2.layer_kinds(cfg, keys, (MAMBA, ATTN, MLP, MOE), path)
        if types is None:
            raise ConfigError("no layer pattern", path=path, field="hybrid_override_pattern")
        return types
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN):
        what = f"expected a string of M * - E, got {pattern!r}"[:200]
        raise ConfigError(what, path=path, field="hybrid_override_pattern")
    return tuple(PATTERN[c] for c in pattern)


def _base(cfg: dict) -> dict:
    """What the shared parser reads: the layer count from the pattern, the norms' eps."""
    n = cfg.get("num_hidden_layers") or 1
    try:
        n = len(_types(cfg, ""))
    except ConfigError:  # parse_hf names the field
        pass
    eps = cfg.get("layer_norm_epsilon", 1e-5)  # the MLPs' relu² is read by parse_hf
    return {**cfg, "num_hidden_layers": n, "rms_norm_eps": eps, "hidden_act": "silu"}


def _with(base: ModelConfig, own: NemotronHConfig, types: tuple[str, ...], moe) -> ModelConfig:
    a = replace(base.attention, bias=False, o_bias=False, no_rope_layers=(True,) * len(types))
    return base.with_(layer_types=types, moe=moe, attention=a, family_config=own)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    types = _types(cfg, path)
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise UnsupportedError(f"MLP activation {act!r}", path=path, field="mlp_hidden_act")
    mamba = mamba2.from_hf(cfg, MAMBA_KEYS, BIASES, base.norms.eps, path)
    moe, routing, latent = None, None, 0
    if MOE in types:
        sizes = {f: (k, cfg.get(k, d)) for f, (k, d) in EXPERT_KEYS.items()}
        norm_topk = flag({"norm_topk_prob": True, **cfg}, "norm_topk_prob", path)
        sparse = tuple(t == MOE for t in types)
        moe = moe_config(expert_sizes(sizes, path), sparse, norm_topk_prob=norm_topk)
        keys = ("n_group", "topk_group", "routed_scaling_factor", SHARED)
        routing = read_routing(moe, cfg, keys, (1, 1, 1.0, 7688), path)
        if latent := cfg.get("moe_latent_size") or 0:
            latent = check_sizes({"head_dim": ("moe_latent_size", latent)}, path)["head_dim"]
    own = NemotronHConfig(mamba, routing, latent)
    mlp = replace(base.mlp, bias=flag(cfg, "mlp_bias", path), hidden_act="relu2")
    return _with(base.with_(mlp=mlp, num_hidden_layers=len(types)), own, types, moe)


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    """Attention blocks state KV heads, MLP / expert blocks a feed_forward_length, the rest
    are Mamba blocks; the norms' eps is layer_norm_epsilon (not the _rms_ key)."""
    n, eps = base.num_hidden_layers, m.get("attention.layer_norm_epsilon", 1e-5, float)
    attn, kv = mamba2.gguf_attention(m, n)
    ff = mamba2.per_layer(m, "feed_forward_length", n)
    dense = MLP if m.arch == "nemotron_h" else MOE
    types = tuple(ATTN if a else dense if f else MAMBA for a, f in zip(attn, ff, strict=True))
    if m.has("moe_latent_size"):
        what = "latent expert projections in GGUF"
        raise UnsupportedError(what, path=m.path, field=m.key("moe_latent_size"))
    moe, routing = None, None
    if dense == MOE:
        norm_topk = bool(m.md.get(m.key("expert_weights_norm"), False))
        sparse = tuple(t == MOE for t in types)
        moe = moe_config(gguf_expert_sizes(m), sparse, norm_topk_prob=norm_topk)
        keys = ("expert_group_count", "expert_group_used_count", "expert_weights_scale")
        groups, scale = m.get(keys[0], 1), m.get(keys[2], 1.0, float)
        used = m.get(keys[1]) if groups > 1 else m.get(keys[1], 1)  # required with groups
        shared = m.get("expert_shared_feed_forward_length")
        routing = checked_routing(moe, groups, used, scale, shared, m.path, tuple(map(m.key, keys)))
    base = base.with_(
        norms=replace(base.norms, eps=eps), num_key_value_heads=kv or base.num_attention_heads
    )
    own = NemotronHConfig(mamba2.from_gguf(m, eps, CHUNK), routing)
    width = max(ff) if any(ff) else base.mlp.intermediate_size
    mlp = replace(base.mlp, intermediate_size=width, hidden_act="relu2")
    return _with(base.with_(mlp=mlp), own, types, moe)


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
        sizes = (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size)
        out |= {k: v for (k, _), v in zip(EXPERT_KEYS.values(), sizes, strict=True)}
        out |= {SHARED: r.shared_intermediate_size, "n_shared_experts": 1, "n_group": r.n_group}
        out |= {"topk_group": r.topk_group, "routed_scaling_factor": r.routed_scaling_factor}
        out |= {"norm_topk_prob": moe.norm_topk_prob, "moe_latent_size": own.latent or None}
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
        renames=RENAMES,
        dropped=("mtp.",),  # the next-token layers: drafting with them is not implemented
    ),
    gguf=GGUFFormat(
        archs=("nemotron_h", "nemotron_h_moe"),
        parse=parse_gguf,
        block=GGUF_BLOCK,
        conventions=(*mamba2.GGUF_CONVENTIONS, MIXER_UNPERMUTE_Q, MIXER_UNPERMUTE_K),
        per_layer_keys=("attention.head_count_kv", "feed_forward_length"),
    ),
    network=NemotronH,
    export=Export(
        model_type="nemotron_h",
        architecture="NemotronHForCausalLM",
        config=export,
        renames=tuple((ours, theirs) for theirs, ours in RENAMES),
    ),
    mlx=MLXFormat(layouts={"mixer.conv1d.weight": (0, 2, 1)}),  # mlx-lm's sanitize: (C, K, 1)
    describe=Description(("mamba2",), _describe, _rows),
)
