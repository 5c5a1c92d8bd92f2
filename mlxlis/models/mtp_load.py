"""A model's multi-token-prediction (MTP) block as a drafter (`--speculative mtp`), read from
the file the model was loaded from on first use: the main load skips the block (`Model.skipped`
names its tensors), so a model that never drafts with it spends no memory on it. Loaded once
per model (then shared by every request's drafter: each has its own KV cache), in the model's
dtype; from a GGUF, kept quantized where the model's layers are.

What the block families share (vLLM, SGLang and llama.cpp run them alike): for the pair
(x_{t+1}, g_t), g_t the target's last-layer output at t AFTER its final norm (llama.cpp:
"post-norm hidden state feeds both the LM head and the MTP"), the block returns a state after
its own final norm whose head gives the distribution of x_{t+2}; the next draft chains on that
state. llama.cpp writes a block as block N = the model's layer count: a decoder layer `blk.N.*`
plus `blk.N.nextn.*` (eh_proj, enorm, hnorm, shared_head_norm; embed_tokens and
shared_head_head where the checkpoint has them).

A family's block (a DraftBlock) and its names (a BlockFormat) are its own: qwen3_5_mtp.py,
nextn.py.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mlxlis.errors import UnexpectedTensorError, UnsupportedError
from mlxlis.loading.binding import bind, quantize_like
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.manifest import as_manifest
from mlxlis.loading.plan import plan_bindings
from mlxlis.loading.quants import convert_tensor
from mlxlis.models.base import Family
from mlxlis.models.experts import ExpertSource, QuantizedSwitchLinear
from mlxlis.models.layers import Cache
from mlxlis.models.model import Model
from mlxlis.models.network import Network, NoDraftHead

import mlx.core as mx
import mlx.nn as nn

_GGUF_FC = re.compile(r"^blk\.(\d+)\.nextn\.eh_proj\.weight$")


class DraftBlock(Protocol):
    """A family's MTP block: an nn.Module whose parameter names a BlockFormat maps to."""

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[Cache]) -> mx.array:
        """(B, T, hidden) embeddings of x_{t+1} and normed target states g_t -> (B, T, hidden)
        states after the block's final norm."""
        ...

    def make_cache(self) -> list[Cache]: ...

    def project(self, out: mx.array, net: Network) -> mx.array:
        """(T, hidden) block states -> (T, vocab) logits (its own head, or the target's)."""
        ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A folder's tensor names -> the block's (the block's own only)."""
        ...

    def expert_stacks(self) -> dict[str, ExpertSource]: ...


@dataclass(frozen=True)
class BlockFormat:
    """How a family's block is built and named in its files."""

    build: Callable[[Model], DraftBlock]  # the empty block for a model
    hf_layers: Callable[[list[str]], int]  # how many MTP layers a folder's skipped names hold
    # a GGUF tensor of the block at index N -> its name in the block (None: the tensor is not
    # the block's); (GGUF name, N, the family's GGUF name -> module name)
    gguf_name: Callable[[str, int, Callable[[str], str | None]], str | None]
    gguf_copies: tuple[str, ...] = ()  # nextn.* copies of the target's own tensors: not read
    # what a GGUF tensor needs undone, by its block name: (name, array) -> array
    gguf_undo: Callable[[str, mx.array], mx.array] | None = None
    gguf_reason: str = "converted without it, e.g. --no-mtp"  # why a GGUF may lack the block


class MTPHead:
    """The block on its target: the target's embedding and final norm around it."""

    def __init__(self, block: DraftBlock, net: Network):
        self.block = block
        self.net = net

    def make_cache(self) -> list[Cache]:
        return self.block.make_cache()

    def target_states(self, hidden: mx.array) -> mx.array:
        """The target's last-layer outputs (T, hidden), before its final norm -> after it
        (what the block reads)."""
        return self.net.model.norm(hidden)

    def step(self, ids: list[int], states: mx.array, cache: list[Cache]) -> mx.array:
        """Pairs (ids[i], states[i]) (states (T, hidden)) through the block: (T, hidden)."""
        embeds = self.net.embed(mx.array([ids], mx.int32))  # (1, T, hidden)
        return self.block(embeds, states[None].astype(embeds.dtype), cache)[0]

    def logits(self, out: mx.array) -> mx.array:
        """(T, hidden) block states -> (T, vocab) float32 logits (no norm: the block normed
        them)."""
        return self.block.project(out, self.net).astype(mx.float32)


def target_head(out: mx.array, net: Network) -> mx.array:
    """The target's own head over (T, hidden) states: its lm_head, or its tied embedding."""
    if net.config.tie_word_embeddings:
        return net.model.embed_tokens.as_linear(out)
    return net.lm_head(out)


_LOADED: weakref.WeakKeyDictionary[Model, MTPHead] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def drafter(fmt: BlockFormat) -> Callable[[Any, Family], MTPHead]:
    """A family's `mtp`: (model, family) -> the model's block on the model (loaded on the first
    call), or NoDraftHead saying why there is none."""

    def mtp_head(model: Model, spec: Family) -> MTPHead:
        with _LOCK:
            head = _LOADED.get(model)
            if head is None:
                head = MTPHead(_load(model, spec, fmt), model.net)
                _LOADED[model] = head
            return head

    return mtp_head


def _load(model: Model, spec: Family, fmt: BlockFormat) -> DraftBlock:
    if model.part is not None:
        raise NoDraftHead(
            f"{model.name} (pipelined) has no multi-token-prediction block to draft with"
        )
    if model.format == "gguf":
        return _from_gguf(model, spec, fmt)
    layers = fmt.hf_layers(model.skipped)
    if layers == 0:
        raise NoDraftHead(
            f"{model.name} has no multi-token-prediction block (none of its tensors: a "
            "conversion such as mlx-lm's drops them)"
        )
    if layers > 1:
        raise UnsupportedError(
            f"{layers} MTP layers: only a one-layer block is supported", path=model.path
        )
    block = fmt.build(model)
    plan = plan_bindings(
        block, model.config, as_manifest(None), model.path, layouts=spec.mlx.layouts
    )
    bind(block, plan.load(), plan.origin or model.path, model.dtype)
    return block


def gguf_block_index(names: list[str]) -> int | None:
    """The block index N of a GGUF's nextn tensors (None: no block)."""
    found = [int(m.group(1)) for n in names if (m := _GGUF_FC.match(n))]
    return min(found) if found else None


def _quantized(net: nn.Module) -> bool:
    """Whether the model's layers were kept quantized (the block follows them)."""
    kinds = (nn.QuantizedLinear, QuantizedSwitchLinear)
    return any(isinstance(m, kinds) for _, m in net.model.named_modules())


def _from_gguf(model: Model, spec: Family, fmt: BlockFormat) -> DraftBlock:
    cfg, path, dtype = model.config, model.path, model.dtype
    first = gguf_block_index(model.skipped)
    if first is None or first != cfg.num_hidden_layers:
        raise NoDraftHead(
            f"{model.name} has no multi-token-prediction block (no blk.N.nextn.* tensors: "
            f"{fmt.gguf_reason})"
        )
    if any(n.startswith(f"blk.{first + 1}.") for n in model.skipped):
        raise UnsupportedError("more than one MTP layer: only one is supported", path=path)
    dense = not _quantized(model.net)
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}
    with read_gguf(path) as gf:
        for name, t in gf.tensors.items():
            if not name.startswith(f"blk.{first}."):
                continue
            ours = fmt.gguf_name(name, first, spec.gguf.module_name)
            if ours is None:
                if ".nextn." in name and name.split(".")[3] in fmt.gguf_copies:
                    continue
                raise UnexpectedTensorError(
                    "no MTP module takes this tensor", path=path, field=name
                )
            flat = len(t.shape) == 1  # norms convert in float32: a fix-up before rounding
            conv = convert_tensor(
                t, gf.raw(name), mx.float32 if flat else dtype, dequantize=dense, path=str(path)
            )
            gf.release(name)
            module, part = ours.rsplit(".", 1)
            parts = conv.parts(part)
            if conv.quantized:
                quant[module] = conv.quant_block()
            for p, arr in parts.items():
                if fmt.gguf_undo is not None:
                    arr = fmt.gguf_undo(ours, arr)
                weights[f"{module}.{p}"] = arr.astype(dtype) if flat else arr
    block = fmt.build(model)
    if quant:
        quantize_like(block, weights, quant)
    bind(block, weights, path, dtype)
    return block
