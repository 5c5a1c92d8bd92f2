"""Reading a Qwen3.5 / Qwen3.6 model's MTP block (qwen3_5_mtp.py) from the file it was loaded
from, on first use: the main load skips the block (`Model.skipped` names its tensors), so a
model that never drafts with it spends no memory on it. Loaded once per model (then shared by
every request's drafter: each has its own KV cache), in the model's dtype; from a GGUF, kept
quantized where the model's layers are, with llama.cpp's +1 on the norms undone.
"""

from __future__ import annotations

import threading
import weakref

from mlxlis.errors import UnexpectedTensorError, UnsupportedError
from mlxlis.loading.binding import bind, quantize_like
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.manifest import as_manifest
from mlxlis.loading.plan import plan_bindings
from mlxlis.loading.quants import convert_tensor
from mlxlis.models.base import Family
from mlxlis.models.conventions import gemma_norm_minus_one
from mlxlis.models.experts import QuantizedSwitchLinear
from mlxlis.models.model import Model
from mlxlis.models.network import NoDraftHead
from mlxlis.models.qwen3_5_mtp import (
    GGUF_NEXTN_COPIES,
    MTPBlock,
    MTPHead,
    gguf_block_index,
    gguf_name,
    hf_block_layers,
    is_mtp_norm,
)

import mlx.core as mx
import mlx.nn as nn

_LOADED: weakref.WeakKeyDictionary[Model, MTPHead] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def mtp_head(model: Model, spec: Family) -> MTPHead:
    """The model's MTP block on the model (loaded on the first call; `spec` its family), or
    NoDraftHead saying why there is none."""
    with _LOCK:
        head = _LOADED.get(model)
        if head is None:
            head = MTPHead(_load(model, spec), model.net)
            _LOADED[model] = head
        return head


def _load(model: Model, spec: Family) -> MTPBlock:
    cfg = model.config
    if model.part is not None:
        raise NoDraftHead(
            f"{model.name} (pipelined) has no multi-token-prediction block to draft with"
        )
    if model.format == "gguf":
        return _from_gguf(model, spec)
    layers = hf_block_layers(model.skipped)
    if layers == 0:
        raise NoDraftHead(
            f"{model.name} has no multi-token-prediction block (no mtp.* tensors: a conversion "
            "such as mlx-lm's drops them)"
        )
    if layers > 1:
        raise UnsupportedError(
            f"{layers} MTP layers: only a one-layer block is supported", path=model.path
        )
    block = MTPBlock(cfg)
    plan = plan_bindings(block, cfg, as_manifest(None), model.path, layouts=spec.mlx.layouts)
    bind(block, plan.load(), plan.origin or model.path, model.dtype)
    return block


def _quantized(net) -> bool:
    """Whether the model's layers were kept quantized (the block follows them)."""
    kinds = (nn.QuantizedLinear, QuantizedSwitchLinear)
    return any(isinstance(m, kinds) for _, m in net.model.named_modules())


def _from_gguf(model: Model, spec: Family) -> MTPBlock:
    cfg, path, dtype = model.config, model.path, model.dtype
    first = gguf_block_index(model.skipped)
    if first is None or first != cfg.num_hidden_layers:
        raise NoDraftHead(
            f"{model.name} has no multi-token-prediction block (no blk.N.nextn.* tensors: "
            "converted without it, e.g. --no-mtp)"
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
            ours = gguf_name(name, first, spec.gguf.module_name)
            if ours is None:
                if ".nextn." in name and name.split(".")[3] in GGUF_NEXTN_COPIES:
                    continue
                raise UnexpectedTensorError(
                    "no MTP module takes this tensor", path=path, field=name
                )
            flat = len(t.shape) == 1  # norms convert in float32, so 1 comes off before rounding
            conv = convert_tensor(
                t, gf.raw(name), mx.float32 if flat else dtype, dequantize=dense, path=str(path)
            )
            gf.release(name)
            module, part = ours.rsplit(".", 1)
            parts = conv.parts(part)
            if conv.quantized:
                quant[module] = conv.quant_block()
            for p, arr in parts.items():
                if is_mtp_norm(ours):  # llama.cpp adds 1 to the zero-centred norms
                    arr = gemma_norm_minus_one(arr)
                weights[f"{module}.{p}"] = arr.astype(dtype) if flat else arr
    block = MTPBlock(cfg)
    if quant:
        quantize_like(block, weights, quant)
    bind(block, weights, path, dtype)
    return block
