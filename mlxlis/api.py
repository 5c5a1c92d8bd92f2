"""The public API's assembly: `load` (a reference resolved, the model built from its files,
placed across the ranks under mlx.launch) and `load_tokenizer`. It sits above the pipeline
layer, which it hands to the model builders as their Placement (the generation core finds a
pipelined model's steps by its placement: mlxlis.distributed registers them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mlxlis.bounded import check_folder_json, read_json_file
from mlxlis.cache import KVFormat
from mlxlis.distributed import Pipeline, Tensor, placement_from_env
from mlxlis.errors import (
    AdapterError,
    BindingError,
    TokenizerError,
    UnsupportedError,
    UnsupportedFormatError,
)
from mlxlis.loading.adapters import Adapter, read_adapter
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.manifest import as_manifest
from mlxlis.loading.resolve import gguf_tensor_count, resolve
from mlxlis.models import family
from mlxlis.models.from_folder import load_folder
from mlxlis.models.from_gguf import load_gguf
from mlxlis.models.lora import adapt, fuse, naming
from mlxlis.models.model import Model
from mlxlis.runtime import backend
from mlxlis.runtime.device import resolve_dtype, select_device
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx

__all__ = ["LoadOptions", "load", "load_tokenizer"]


@dataclass
class LoadOptions:
    """`load`'s keyword arguments, as a surface collects them (the command line, the app):
    `load(ref, **options.kwargs())`. The defaults are `load`'s."""

    dtype: str | mx.Dtype | None = None
    dequantize: bool | None = None
    chat_template: str | None = None
    bindings: str | Path | dict | None = None
    strict: bool = True
    layers_split: str | list[int] | None = None
    tensor: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    mmproj: str | Path | bool | None = None
    adapters: tuple[str | Path, ...] = ()
    adapter_scale: float = 1.0
    fuse: bool = False
    task: str | None = None

    def kwargs(self) -> dict[str, Any]:
        """The options by `load`'s keyword names (a subclass's own fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(LoadOptions)}


def load(
    path_or_name: str | Path,
    dtype: str | mx.Dtype | None = None,
    *,
    dequantize: bool | None = None,
    chat_template: str | None = None,
    bindings: str | Path | dict | None = None,
    strict: bool = True,
    layers_split: str | list[int] | None = None,
    tensor: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    mmproj: str | Path | bool | None = None,
    adapters: Sequence[str | Path] = (),
    adapter_scale: float = 1.0,
    fuse: bool = False,
    task: str | None = None,
) -> Model:
    """Load a model folder, GGUF file or catalog name. dtype None = the device default. The
    keyword arguments, gathered: LoadOptions (`load(ref, **options.kwargs())`).

    `dequantize` (GGUF): True = every weight dense, False = quantized blocks kept as MLX
    quantized arrays, None = per device (dense matmul weights on CPU when they fit comfortably,
    quantized on Metal / CUDA; measurements in models/from_gguf.py).

    `bindings`: a binding manifest (JSON/YAML file path, or a dict) mapping the model's
    parameter paths to the checkpoint's tensor keys (see `mlxlis.loading.manifest`).
    `strict`: tensors no parameter takes are an error (default); False warns
    (`UnboundTensorsWarning`) and ignores them. Both apply to safetensors folders.

    Under `mlx.launch` with several ranks, each rank loads only its share of the layers and
    the model runs pipelined (mlxlis.distributed); `layers_split` (e.g. "14,14": layers per
    rank, in rank order) fixes the shares, else they are balanced by weight bytes. `tensor`
    (else MLXLIS_TENSOR): split every layer across that many launched ranks instead (tensor
    parallelism, mlxlis/distributed/tensor.py: attention heads, MLP rows, vocabulary).

    `kv_bits` (8 or 4): every request's keys and values are stored quantized (MLX affine,
    one scale and bias per `kv_group_size` elements) and attended in that form; None: dense.
    `Model.set_kv_format` changes it later.

    `mmproj` (GGUF): llama.cpp's vision file for a model that sees; None: one found beside
    the model file (a .gguf whose name holds "mmproj"); False: text only.

    `adapters`: LoRA adapters (PEFT's or mlx-lm's folders, llama.cpp's .gguf files, or Hub
    names of them) applied unmerged, in order: y = W x + s·B(A x),
    W as the file holds it (quantized stays quantized). Each is read and checked before the
    model is; one that does not fit the model (a module it lacks, shapes of another base) is
    an AdapterError naming the file and the module, and nothing of it applies.
    `adapter_scale`: a multiplier on every adapter's scale (above 0, finite). `fuse`: the
    adapters merged into the weights once applied (lora.fuse: a quantized weight requantized
    with its bits and group size, or made dense where MLX has no such format); the model's
    `fused` says how.

    `task` (folders): None = what the folder says (an encoder embeds or reranks by its head; a
    decoder's sentence-transformers folder with a Pooling module embeds; a causal LM
    generates); "rerank" makes a causal LM a yes / no reranker (Qwen3-Reranker's recipe:
    models/decoder_rerank.py); "generate" / "embed" insist, refused where the folder is not so.
    """
    scale_ok = isinstance(adapter_scale, (int, float)) and math.isfinite(adapter_scale)
    if not scale_ok or adapter_scale <= 0:
        raise AdapterError("must be a finite number above 0", field="--adapter-scale")
    read = [read_adapter(a) for a in adapters]  # a bad adapter fails before the model is read
    if adapter_scale != 1.0:
        read = [a.scaled(adapter_scale) for a in read]
    kv = KVFormat(kv_bits, kv_group_size) if kv_bits is not None else None  # checked first
    select_device()  # the GPU when MLX has a usable one, else the CPU; MLXLIS_DEVICE overrides
    backend.select()  # the operations around the products, for that device and the settings
    dt = dtype if isinstance(dtype, mx.Dtype) else resolve_dtype(dtype)
    manifest = as_manifest(bindings)  # a bad manifest fails before anything else is read
    # a bad split fails before the file is read
    pipeline = placement_from_env(layers_split, tensor)
    path = resolve(path_or_name, vision=mmproj is not False)
    if path.is_file() and path.suffix.lower() == ".gguf":
        if task not in (None, "generate"):
            raise UnsupportedError(f"task {task!r} applies to folders", path=path, field="task")
        if bindings is not None:
            raise BindingError(
                "binding manifests apply to safetensors folders, not GGUF files", path=path
            )
        if gguf_tensor_count(path) == 0:
            raise UnsupportedFormatError(
                "a vocabulary-only GGUF (no tensors): open its tokenizer with "
                "mlxlis.load_tokenizer(path)",
                path=path,
                field="tensor_count",
            )
        model = load_gguf(
            path,
            dt,
            dequantize=dequantize,
            chat_template=chat_template,
            placement=pipeline,
            mmproj=mmproj,
        )
        return _ready(model, pipeline, kv, read, fuse)
    if path.is_file():
        raise UnsupportedFormatError("expected a model folder or a .gguf file", path=path)
    if mmproj not in (None, False):
        raise UnsupportedError(
            "--mmproj applies to GGUF files; a folder's vision tower loads from the folder",
            path=path,
            field="mmproj",
        )
    if dequantize is not None:
        raise UnsupportedError(
            "--dequantize / --quantized apply to GGUF files; a folder's weights load as stored",
            path=path,
            field="dequantize",
        )
    model = load_folder(
        path,
        dt,
        chat_template=chat_template,
        bindings=manifest,
        strict=strict,
        placement=pipeline,
        task=task,
    )
    return _ready(model, pipeline, kv, read, fuse)


def _ready(
    model: Model,
    pipeline: Pipeline | Tensor,
    kv: KVFormat | None,
    adapters: list[Adapter],
    merge: bool,
) -> Model:
    """The adapters applied (merged when `merge`); every rank has its share (a pipelined
    model's generation steps are led from rank 0: generation.steps_for)."""
    if adapters and model.part is not None:
        raise UnsupportedError("adapters on a pipelined model", field="adapters")
    if model.task != "generate":  # an encoder keeps no KV cache and takes no adapter yet
        if adapters or kv is not None:
            what = "adapters" if adapters else "kv_bits"
            raise UnsupportedError(f"{what} on an {model.task} model", field=what)
        pipeline.ready()
        return model
    for adapter in adapters:
        names, undo = naming(adapter, family(model.config.family), model.config)
        adapt(model.net, adapter, names, model.dtype, undo)
        model.adapters.append(adapter)
    if merge and adapters:
        model.fused = fuse(model.net, model.dtype)
    model.set_kv_format(kv)
    pipeline.ready()
    return model


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """A model's tokenizer alone, the one `load(path_or_name).tokenizer` would be: from a GGUF
    file's metadata (no tensor is read; a vocabulary-only GGUF such as llama.cpp's
    ggml-vocab-*.gguf too), a folder's tokenizer files (tokenizer.json, else tokenizer.model,
    with tokenizer_config.json and the config files beside them) or a catalog name."""
    path = resolve(path_or_name)
    if path.is_dir():
        check_folder_json(path)
        for name in ("config.json", "generation_config.json"):  # from_folder reads them too
            if (path / name).is_file():
                read_json_file(path / name, error=TokenizerError, what=name)
        return Tokenizer.from_folder(path)
    if path.suffix.lower() != ".gguf":
        raise UnsupportedFormatError(
            "expected a .gguf file or a folder with tokenizer.json / tokenizer.model", path=path
        )
    with read_gguf(path) as gf:
        return Tokenizer.from_gguf(gf.metadata, path)
