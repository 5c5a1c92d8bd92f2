"""Mixture of experts with sigmoid, group-limited routing and shared experts (GLM-4.5's
`Glm4MoeMoE`; DeepSeek-V3's "noaux_tc" router has the same shape).

Each token scores every routed expert with sigmoid(x·Wᵀ) in float32. The choice adds a
learnt per-expert correction bias (`e_score_correction_bias`) to the scores; the weights do
not (they are the uncorrected scores of the chosen experts). The experts are split into
n_group equal groups; a group is worth the sum of its two best corrected scores, and only the
topk_group best groups compete for the top k. The k weights are renormalised to sum 1 when
norm_topk_prob, then multiplied by routed_scaling_factor. Shared experts (one gated MLP of
n_shared · expert width) run on every token and add to the routed sum.

The routed experts are experts.py's SwitchGLU (gather_mm over the chosen experts only), or
its SwitchMLP without a gate (Nemotron-H: relu² experts, optionally between a latent down- and
up-projection, beside a relu² shared MLP: ReluSquaredMoE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxlis import limits
from mlxlis.errors import ConfigError
from mlxlis.limits import check_sizes
from mlxlis.loading.binding import Float32Parameters
from mlxlis.models.activations import relu2
from mlxlis.models.base import GGUFMeta
from mlxlis.models.config import ModelConfig, MoEConfig, number
from mlxlis.models.experts import ExpertSource, SwitchGLU, SwitchMLP, expert_stacks
from mlxlis.models.layers import MLP, UpDownMLP
from mlxlis.models.reading import expert_sizes, flag, gguf_expert_sizes, moe_config

import mlx.core as mx
import mlx.nn as nn

# the router's sizes, beside limits.SIZE_BOUNDS
BOUNDS = {"n_group": limits.CONFIG_MAX_EXPERTS, "topk_group": limits.CONFIG_MAX_EXPERTS}


@dataclass(frozen=True)
class GroupRouting:
    """The router's options beyond ModelConfig.moe (sizes, top k, norm_topk_prob)."""

    n_group: int = 1  # the routed experts in this many equal groups
    topk_group: int = 1  # the groups a token may choose its experts from
    routed_scaling_factor: float = 1.0  # the routed weights' scale, after normalising
    shared_intermediate_size: int = 0  # the shared experts' MLP width (0: none)


def checked_routing(
    moe: MoEConfig,
    groups: int,
    used: int,
    scale: Any,
    shared: int,
    path: str,
    keys: tuple[str, str, str],
) -> GroupRouting:
    """GroupRouting for the experts `moe`, its values checked; `keys` name the file's fields
    of the group count, the groups used and the scale (in errors)."""
    e, k = moe.num_experts, moe.num_experts_per_tok
    if groups < 1 or e % groups or not 1 <= used <= groups:
        raise ConfigError(f"{e} experts in {groups} groups, {used} used", path=path, field=keys[0])
    if used < groups and (e // groups < 2 or used * (e // groups) < k):
        # a group's worth is its two best scores; the groups used must hold the top k
        raise ConfigError(
            f"{used} of {groups} groups cannot hold {k} experts", path=path, field=keys[1]
        )
    if not (number(scale) and 0 < scale < 1e6):
        raise ConfigError(
            f"expected a positive scale, got {scale!r}"[:200], path=path, field=keys[2]
        )
    return GroupRouting(groups, used, float(scale), shared)


def read_hf(
    cfg: dict, base: ModelConfig, path: str, defaults: dict[str, Any]
) -> tuple[ModelConfig, GroupRouting]:
    """`base` with its experts (the first first_k_dense_replace layers dense) and the router's
    options, from config.json's keys (`defaults`: the family config's, for those absent)."""
    n, d = base.num_hidden_layers, {**defaults, **cfg}
    experts = cfg.get("num_local_experts", defaults["n_routed_experts"])
    experts = cfg.get("n_routed_experts", experts)
    keys = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    sizes = {
        "num_experts": (keys[0], experts),
        "num_experts_per_tok": (keys[1], d[keys[1]]),
        "moe_intermediate_size": (keys[2], d[keys[2]]),
        "n_group": ("n_group", d["n_group"]),
        "topk_group": ("topk_group", d["topk_group"]),
    }
    size = expert_sizes(sizes, path, BOUNDS)
    shared = d["n_shared_experts"] or 0
    if shared:
        shared = check_sizes({"n_group": ("n_shared_experts", shared)}, path, BOUNDS)["n_group"]
    dense = d["first_k_dense_replace"]
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= n:
        raise ConfigError(
            f"expected 0 to {n}, got {dense!r}"[:200], path=path, field="first_k_dense_replace"
        )
    norm = flag({"norm_topk_prob": True, **cfg}, "norm_topk_prob", path)  # True by default
    sparse = tuple(i >= dense for i in range(n))
    base = base.with_(moe=moe_config(size, sparse, norm_topk_prob=norm))
    keys = ("n_group", "topk_group", "routed_scaling_factor")
    shared *= size["moe_intermediate_size"]
    return base, checked_routing(
        base.moe, size["n_group"], size["topk_group"], d[keys[2]], shared, path, keys
    )


def read_gguf(base: ModelConfig, m: GGUFMeta, dense: int) -> tuple[ModelConfig, GroupRouting]:
    """read_hf's result from llama.cpp's keys (`dense`: leading_dense_block_count's default)."""
    size = gguf_expert_sizes(m)
    dense = m.get("leading_dense_block_count", dense)
    sparse = tuple(i >= dense for i in range(base.num_hidden_layers))
    norm = bool(m.md.get(m.key("expert_weights_norm"), False))
    base = base.with_(moe=moe_config(size, sparse, norm_topk_prob=norm))
    keys = ("expert_group_count", "expert_group_used_count", "expert_weights_scale")
    routing = checked_routing(
        base.moe,
        m.get(keys[0], 1),
        m.get(keys[1], 1),
        m.get(keys[2], 1.0, float),
        m.get("expert_shared_count", 0) * size["moe_intermediate_size"],
        m.path,
        tuple(m.key(k) for k in keys),
    )
    return base, routing


def read_routing(
    moe: MoEConfig, cfg: dict, keys: tuple[str, str, str, str], defaults: tuple, path: str
) -> GroupRouting:
    """GroupRouting from config.json: `keys` name the group count, the groups used, the scale
    and the shared experts' width (`defaults` where absent), each checked."""
    bound = {"n_group": limits.CONFIG_MAX_EXPERTS, "shared": limits.CONFIG_MAX_DIM}
    bound["topk_group"] = limits.CONFIG_MAX_EXPERTS
    names = ("n_group", "topk_group", None, "shared")
    got = {n: (k, cfg.get(k, d)) for n, k, d in zip(names, keys, defaults, strict=True) if n}
    size = check_sizes(got, path, bound)
    scale = cfg.get(keys[2], defaults[2])
    g, used, shared = size["n_group"], size["topk_group"], size["shared"]
    return checked_routing(moe, g, used, scale, shared, path, keys[:3])


class GroupRouter(nn.Module, Float32Parameters):
    """weight (E, hidden) and e_score_correction_bias (E,), under the checkpoints' names,
    held in float32 whatever the compute dtype (transformers keeps both so: in bfloat16 a
    near-tie between two experts' biased scores can go the other way);
    x (B, T, hidden) -> (indices (B, T, k), weights (B, T, k) float32)."""

    float32 = ("weight", "e_score_correction_bias")

    def __init__(self, cfg: ModelConfig, routing: GroupRouting):
        super().__init__()
        e = cfg.moe.num_experts
        self.weight = mx.zeros((e, cfg.hidden_size))
        self.e_score_correction_bias = mx.zeros((e,))
        self._k, self._norm = cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob
        self._routing = routing

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        # the input widened, as the reference's router does: every product in float32
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # (B, T, E)
        return sigmoid_route(
            logits, self.e_score_correction_bias, self._k, self._norm, self._routing
        )


def sigmoid_route(
    logits: mx.array, bias: mx.array, k: int, norm: bool, r: GroupRouting
) -> tuple[mx.array, mx.array]:
    """The router's logits (B, T, E) and correction bias (E,) -> the k chosen experts (B, T, k)
    and their weights (B, T, k) float32: sigmoid scores, the bias added for the choice only,
    the choice within the best groups, the weights renormalised when `norm`, then scaled."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + bias.astype(mx.float32)  # for the choice only
    if r.topk_group < r.n_group:
        *lead, e = choice.shape
        groups = choice.reshape(*lead, r.n_group, e // r.n_group)  # (B, T, G, E / G)
        worth = mx.topk(groups, 2, axis=-1).sum(axis=-1)  # (B, T, G): the best two's sum
        # the topk_group-th best worth and those above it (a tie admits both groups)
        floor = mx.topk(worth, r.topk_group, axis=-1).min(axis=-1, keepdims=True)
        kept = (worth >= floor)[..., None]  # (B, T, G, 1)
        groups = mx.where(kept, groups, mx.array(-mx.inf, mx.float32))
        choice = groups.reshape(*lead, e)
    inds = mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k]  # (B, T, k), any order
    weights = mx.take_along_axis(scores, inds, axis=-1)  # uncorrected scores
    if norm:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return mx.stop_gradient(inds), weights * r.routed_scaling_factor


class GroupedMoE(nn.Module):
    """The routed experts weighted by GroupRouter, plus the shared experts:
    x (B, T, hidden) -> (B, T, hidden)."""

    def __init__(self, cfg: ModelConfig, routing: GroupRouting):
        super().__init__()
        self.gate = GroupRouter(cfg, routing)
        self.switch_mlp = SwitchGLU(cfg)
        if routing.shared_intermediate_size:
            self.shared_experts = MLP(cfg, routing.shared_intermediate_size)

    def expert_stacks(self, prefix: str) -> dict[str, ExpertSource]:
        return expert_stacks(prefix, self.gate.weight.shape[0])

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.gate(x)
        y = self.switch_mlp(x, inds)  # (B, T, k, hidden)
        y = (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class ReluSquaredMoE(nn.Module):
    """Nemotron-H's experts: the routed relu² experts (in the latent width, when `latent`)
    weighted by GroupRouter, plus the shared relu² MLP on the block's input; the router
    `gate`, the experts under mlx-lm's `switch_mlp.fc1` / `fc2`."""

    def __init__(self, cfg: ModelConfig, routing: GroupRouting, latent: int = 0):
        super().__init__()
        moe, d, bias = cfg.moe, cfg.hidden_size, cfg.mlp.bias
        self.gate = GroupRouter(cfg, routing)
        self.switch_mlp = SwitchMLP(moe.num_experts, latent or d, moe.intermediate_size, relu2)
        if latent:
            self.fc1_latent_proj = nn.Linear(d, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, d, bias=bias)
        self.shared_experts = UpDownMLP(d, routing.shared_intermediate_size, bias, relu2)

    def expert_stacks(self, prefix: str) -> dict[str, ExpertSource]:
        """One tensor per expert (experts.{e}.up_proj / down_proj), or transformers 5's
        stacked experts.up_proj / down_proj."""
        n = self.gate.weight.shape[0]
        return {
            f"{prefix}.switch_mlp.{ours}.weight": ExpertSource(
                tuple(f"{prefix}.experts.{e}.{theirs}.weight" for e in range(n)),
                f"{prefix}.experts.{theirs}",
                None,
            )
            for ours, theirs in (("fc1", "up_proj"), ("fc2", "down_proj"))
        }

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.gate(x)
        h = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        y = self.switch_mlp(h, inds)  # (B, T, k, width)
        y = (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)
        y = self.fc2_latent_proj(y) if "fc2_latent_proj" in self else y
        return y + self.shared_experts(x)
