"""Load a GGUF file: metadata -> config, tensors -> module names, conventions undone,
quantized blocks -> MLX affine arrays (or dense), one tensor at a time."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import UnexpectedTensorError
from ..families import build_model
from .binding import bind, quantize_like
from .conventions import undo
from .gguf import read_gguf
from .gguf_config import config_from_gguf
from .gguf_names import SPECIAL, module_name
from .quants import convert_tensor


def load_gguf(path: Path, dtype: mx.Dtype, *, dequantize: bool = False,
              chat_template: str | None = None):
    from ..model import Model
    from ..tokenizer import Tokenizer
    from . import _discover

    with read_gguf(path) as gf:
        md = gf.metadata
        shapes = {name: t.shape for name, t in gf.tensors.items()}
        cfg = config_from_gguf(md, shapes, str(path))
        weights: dict[str, mx.array] = {}
        quant: dict[str, dict] = {}
        rope_freqs = None
        types: dict[str, int] = {}
        for name, t in gf.tensors.items():
            types[t.type_name] = types.get(t.type_name, 0) + 1
            if name in SPECIAL:
                rope_freqs = convert_tensor(t, gf.raw(name), mx.float32, dequantize=True,
                                            path=str(path)).weight.reshape(-1)
                continue
            target = module_name(cfg.family, name)
            if target is None:
                raise UnexpectedTensorError(f"no {cfg.family} module takes this tensor",
                                            path=path, field=name)
            # 1-D tensors (norms, biases) convert in fp32 so `w - 1` happens before rounding
            conv_dtype = mx.float32 if len(t.shape) == 1 else dtype
            conv = convert_tensor(t, gf.raw(name), conv_dtype, dequantize=dequantize,
                                  path=str(path))
            module = target.rsplit(".", 1)[0]
            if conv.scales is not None:
                parts = {"weight": conv.weight, "scales": conv.scales, "biases": conv.biases}
                quant[module] = {"group_size": conv.group_size, "bits": conv.bits}
            else:
                parts = {target.rsplit(".", 1)[1]: conv.weight}
            for part, arr in parts.items():
                arr = undo(target, arr, cfg, "gguf", part)
                if arr.dtype in (mx.float32, mx.float16, mx.bfloat16) and arr.dtype != dtype:
                    arr = arr.astype(dtype)
                mx.eval(arr)  # stream: materialise now so the numpy/raw temporaries go
                weights[f"{module}.{part}"] = arr
        net = build_model(cfg, rope_freq_factors=rope_freqs) if rope_freqs is not None \
            else build_model(cfg)
        if quant:
            quantize_like(net, weights, quant)
        bind(net, weights, path, dtype)
        tokenizer = Tokenizer.from_gguf(md, path)
        template = _discover(chat_template, gguf_metadata=md, gguf_path=path)
        diagnosis = None
        if template is None:
            diagnosis = _diagnose(path, md)
    summary = ", ".join(f"{k}×{v}" for k, v in sorted(types.items()))
    kept = "dense" if dequantize or not quant else f"{len(quant)} quantized modules"
    return Model(cfg, net, tokenizer, dtype=dtype, path=path, fmt="gguf",
                 template=template, quant_summary=f"{summary} ({kept})", diagnosis=diagnosis)


def _diagnose(path: Path, md: dict) -> str | None:
    try:
        from ..chat_template import diagnose_missing_template
    except ImportError:
        return None
    return diagnose_missing_template(model_name=path.name, folder=None, gguf_metadata=md)
