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
from mlxlis.models.activations import relu2
from mlxlis.models.config import ModelConfig, MoEConfig, number
from mlxlis.models.experts import ExpertSource, SwitchGLU, SwitchMLP, expert_stacks
from mlxlis.models.layers import MLP, UpDownMLP

import mlx.core as mx
import mlx.nn as nn


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


class GroupRouter(nn.Module):
    """weight (E, hidden) and e_score_correction_bias (E,), under the checkpoints' names;
    x (B, T, hidden) -> (indices (B, T, k), weights (B, T, k) float32)."""

    def __init__(self, cfg: ModelConfig, routing: GroupRouting):
        super().__init__()
        e = cfg.moe.num_experts
        self.weight = mx.zeros((e, cfg.hidden_size))
        self.e_score_correction_bias = mx.zeros((e,))
        self._k, self._norm = cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob
        self._routing = routing

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        r, k = self._routing, self._k
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # (B, T, E)
        scores = mx.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)  # for the choice only
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
        if self._norm:
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
