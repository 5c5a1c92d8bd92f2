"""Mixture-of-experts MLP (Qwen3-MoE): a router over stacked SwiGLU experts.

The experts' weights are stacked, (n_experts, out, in) per projection, under mlx-lm's
`switch_mlp` names; each token runs only its top-k experts through `mx.gather_mm` /
`mx.gather_qmm`, which read only the selected experts' matrices. Checkpoints in the Hugging
Face layouts load too (`SparseMoE.expert_stacks`): one tensor per expert (stacked at load), or
the fused 3-D `experts.gate_up_proj` (E, 2·F, hidden; gate rows then up rows) and
`experts.down_proj` (E, hidden, F) that Qwen3.5-MoE checkpoints ship (sliced at load).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxlis.models.activations import Gated, gated
from mlxlis.models.config import ModelConfig
from mlxlis.models.layers import MLP

import mlx.core as mx
import mlx.nn as nn

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertSource:
    """Where a stacked expert parameter may come from in a Hugging Face checkpoint: the
    per-expert tensors `parts` (in expert order), or the fused tensor `fused` (its `half`
    along `axis`: 0 = first, 1 = second, None = all of it), then transposed by `axes` when
    the checkpoint keeps the experts (E, in, out) (Llama 4). A family may give several,
    tried in order (gpt-oss: its MXFP4 blocks or dense tensors)."""

    parts: tuple[str, ...]
    fused: str
    half: int | None
    axis: int = 1
    axes: tuple[int, ...] | None = None
    # the halves interleaved along `axis` (gpt-oss: gate at even, up at odd indices)
    strided: bool = False
    # MXFP4 blocks (..., groups, 16) uint8, read as MLX's packed words (..., groups·4) uint32
    blocks: bool = False
    # the parts are consecutive rows, concatenated on axis 0 instead of stacked (Qwen4-Exp's
    # n-gram tables, saved in shards)
    joined: bool = False


# from this many (token, expert) pairs on, rows are sorted by expert first, so each expert's
# rows are contiguous (measured on CPU, 128 tokens × top-2 of 32: 2.7× faster than unsorted)
SORT_FROM = 64


def _add_bias(y: mx.array, module: nn.Module, indices: mx.array) -> mx.array:
    """y (..., 1, out) plus each row's expert's bias (gpt-oss), when the experts have one."""
    if "bias" not in module:
        return y
    return y + module.bias[indices][..., None, :]


class SwitchLinear(nn.Module):
    """n_experts linear maps, with a bias each when `bias` (gpt-oss); x (..., 1, in) and
    indices (...) -> (..., 1, out)."""

    def __init__(self, n_experts: int, in_dims: int, out_dims: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((n_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((n_experts, out_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_mm(
            x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
        )
        return _add_bias(y, self, indices)

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine"
    ) -> QuantizedSwitchLinear:
        """The nn.quantize hook: the same experts, quantized (as nn.Linear.to_quantized)."""
        return QuantizedSwitchLinear.from_dense(self, group_size or 64, bits or 4, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear over MLX-quantized experts: weight (E, out, in·bits/32) uint32, scales and
    (affine) biases (E, out, in/group_size); `bias` (E, out) unquantized, when the experts
    have one (gpt-oss: its MXFP4 experts, mode "mxfp4")."""

    def __init__(
        self,
        n_experts: int,
        in_dims: int,
        out_dims: int,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
        bias: bool = False,
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self._set(
            mx.quantize(mx.zeros((n_experts, out_dims, in_dims)), group_size, bits, mode=mode)
        )
        if bias:
            self.bias = mx.zeros((n_experts, out_dims))
        self.freeze()

    def _set(self, packed: tuple) -> None:
        """mx.quantize's output: (weight, scales, biases), or (weight, scales) in the modes
        without biases (mxfp4, nvfp4, ...), as nn.QuantizedLinear holds them."""
        self.weight, self.scales = packed[0], packed[1]
        if len(packed) > 2:
            self.biases = packed[2]

    @classmethod
    def from_dense(
        cls, dense: SwitchLinear, group_size: int, bits: int, mode: str
    ) -> QuantizedSwitchLinear:
        n, out_dims, in_dims = dense.weight.shape
        q = cls(n, in_dims, out_dims, group_size, bits, mode, "bias" in dense)
        q.unfreeze()
        if "biases" in q:
            del q["biases"]
        q._set(mx.quantize(dense.weight, group_size, bits, mode=mode))
        if "bias" in dense:
            q.bias = dense.bias
        q.freeze()
        return q

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        return _add_bias(y, self, indices)


def expert_stacks(
    prefix: str, n: int, fused: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
) -> dict[str, ExpertSource]:
    """The stacked `switch_mlp` parameters of the n experts under `prefix` -> their Hugging
    Face sources: one tensor per expert, or the `fused` gate|up (gate rows first) and down
    tensors (transformers 5's; Granite's block_sparse_moe.input_linear / output_linear)."""
    halves = {"gate_proj": (fused[0], 0), "up_proj": (fused[0], 1), "down_proj": (fused[1], None)}
    return {
        f"{prefix}.switch_mlp.{p}.weight": ExpertSource(
            tuple(f"{prefix}.experts.{e}.{p}.weight" for e in range(n)),
            f"{prefix}.{halves[p][0]}",
            halves[p][1],
        )
        for p in PROJECTIONS
    }


class SwitchGLU(nn.Module):
    """The experts: down(act(gate(x)) · up(x)) with each token's own k experts; `act` a
    family's own gated activation (gpt-oss), else cfg.mlp.hidden_act's."""

    def __init__(self, cfg: ModelConfig, bias: bool = False, act: Gated | None = None):
        super().__init__()
        e, d, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
        self.gate_proj = SwitchLinear(e, d, f, bias)
        self.up_proj = SwitchLinear(e, d, f, bias)
        self.down_proj = SwitchLinear(e, f, d, bias)
        self.act = act or gated(cfg.mlp.hidden_act)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (B, T, hidden), or (B, T, k, hidden) with each (token, expert) pair's own input
        (Llama 4 scales it by the router), indices (B, T, k) -> (B, T, k, hidden)."""
        pairs = x.ndim == indices.ndim + 1
        if indices.size < SORT_FROM:
            # (B, T, 1, 1, hidden): one row per token, broadcast over k; or (B, T, k, 1, hidden)
            x = x[..., None, :] if pairs else x[..., None, None, :]
            h = self.act(self.gate_proj(x, indices), self.up_proj(x, indices))  # (B, T, k, 1, F)
            return self.down_proj(h, indices)[..., 0, :]
        b, t, k = indices.shape
        flat = indices.reshape(-1)  # (B·T·k,)
        order = mx.argsort(flat)  # the (token, expert) pairs grouped by expert
        rows = x.reshape(b * t * k, 1, -1)[order] if pairs else x.reshape(b * t, 1, -1)[order // k]
        xs = rows  # (B·T·k, 1, hidden), sorted by expert
        idx = flat[order]
        h = self.act(self.gate_proj(xs, idx, True), self.up_proj(xs, idx, True))  # (N, 1, F)
        y = self.down_proj(h, idx, True)[mx.argsort(order)]  # back to (token, k) order
        return y.reshape(b, t, k, -1)


class SparseMoE(nn.Module):
    """Router softmax over all experts (float32), the top k kept, renormalised to sum 1 when
    norm_topk_prob (as transformers' Qwen3MoeTopKRouter), the experts' outputs weighted; plus,
    when configured, a shared expert every token runs, scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.switch_mlp = SwitchGLU(cfg)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def expert_stacks(self, prefix: str) -> dict[str, ExpertSource]:
        return expert_stacks(prefix, self.gate.weight.shape[0])

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1, precise=True)  # (B, T, E)
        inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]  # (B, T, k), any order
        weights = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, mx.stop_gradient(inds))  # (B, T, k, hidden)
        y = (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class LogitTopKMoE(nn.Module):
    """Mixtral-style routing: the top k of the router's logits, softmaxed among themselves (the
    full softmax renormalised over those k), weight the experts; the router under Granite's
    and JetMoE's name, `router.layer`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.moe.num_experts_per_tok
        self.router = nn.Module()
        self.router.layer = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(cfg)

    def expert_stacks(self, prefix: str) -> dict[str, ExpertSource]:
        """Granite's fused experts: input_linear (E, 2F, hidden), output_linear (E, hidden, F)."""
        fused = ("input_linear.weight", "output_linear.weight")
        return expert_stacks(prefix, self.router.layer.weight.shape[0], fused)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.top_k
        logits = self.router.layer(x).astype(mx.float32)  # (B, T, E)
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # (B, T, k)
        weights = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
        y = self.switch_mlp(x, mx.stop_gradient(inds))  # (B, T, k, hidden)
        return (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)


class SwitchMLP(nn.Module):
    """Experts without a gate (Nemotron-H): fc2(act(fc1(x))) with each token's own k experts,
    under mlx-lm's names; x (B, T, in), indices (B, T, k) -> (B, T, k, in)."""

    def __init__(self, n_experts: int, dims: int, hidden: int, act):
        super().__init__()
        self.fc1 = SwitchLinear(n_experts, dims, hidden)
        self.fc2 = SwitchLinear(n_experts, hidden, dims)
        self.act = act

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        x = x[..., None, None, :]  # (B, T, 1, 1, in): one row per token, broadcast over k
        return self.fc2(self.act(self.fc1(x, indices)), indices)[..., 0, :]
