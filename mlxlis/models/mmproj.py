"""llama.cpp's `mmproj` GGUF files: the vision tower and projector of a multimodal model, kept
beside its text GGUF, read back as the Hugging Face tensors they were converted from.

A file is `general.architecture` "clip" with a projector type (`clip.projector_type`, else
`clip.vision.projector_type`, as clip.cpp reads it): "gemma3" (SigLIP + Gemma 3's projector),
"gemma4v" (Gemma 4's encoder + embedder), "qwen3vl_merger" (Qwen3.5's ViT + merger). What
llama.cpp's converter (convert_hf_to_gguf.py, conversion/gemma.py and qwen3vl.py) changed is
undone here as data, as for the text weights:
  Gemma 3: mm.soft_emb_norm stored as w + 1 (Gemma's x̂·(1 + w)); the pool per side is
    clip.vision.projector.scale_factor (4 when absent); files of the old converter script
    swapped ffn_up / ffn_down (told apart by shape, as clip.cpp does).
  Gemma 4: the patch embedding stored as a conv weight (D, 3, p, p) of HF's (D, p·p·3) rows
    (y, x, channel); clamp scalars as (1,); the kernel is scale_factor or 3; head_dim and the
    KV heads read from the tensors' shapes; the activation is not stored (HF's gelu tanh).
  Qwen3.5: the Conv3d patch embedding split into its two frames (.weight, .weight.1);
    mm.0 / mm.2 / v.post_ln are the merger's fc1 / fc2 / norm.
Every tensor comes out float32 whatever the file holds (F32, F16, BF16, Q8_0, mixed), then the
model's dtype. Neither file stores the image token ids: they are the tokenizer's (by their
strings, else transformers' default ids).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from mlxlis.errors import FileFormatError, MlxlisError, UnsupportedError
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.quants import convert_tensor
from mlxlis.models.base import Projector
from mlxlis.models.config import ModelConfig
from mlxlis.models.multimodal import Vision
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx
import numpy as np


def is_mmproj(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and "mmproj" in path.name.lower()


def beside(model_path: Path, cfg: ModelConfig, kind: str) -> Path | None:
    """The mmproj file beside a text GGUF, as llama.cpp finds one: a `.gguf` in its folder
    (else the folder above: a Hub repo's per-quant folders share the top's) whose name holds
    "mmproj" — here also of the model's family's projector `kind` and its width (a folder may
    hold several models' files) — and of several, the one whose precision is nearest the
    model's."""
    found = []
    folder = model_path.parent
    candidates = sorted(folder.glob("*.gguf"))
    if not any(is_mmproj(p) for p in candidates):  # a quant in a folder of its own: the top's
        candidates = sorted(folder.parent.glob("*.gguf"))
    for p in candidates:
        if p == model_path or not is_mmproj(p):
            continue
        try:
            with read_gguf(p) as gf:
                md = gf.metadata
        except MlxlisError:
            continue  # not readable as GGUF: not this model's (load it by --mmproj to see why)
        found_kind = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
        if found_kind == kind:
            if md.get("clip.vision.projection_dim") == cfg.hidden_size:
                found.append(p)
    if len(found) <= 1:
        return found[0] if found else None
    want = _bits(model_path.name)
    return min(found, key=lambda p: (abs(_bits(p.name) - want), p.name))


def _bits(name: str) -> int:
    """The precision a file name says (Q4_K_M -> 4, F16 / BF16 -> 16, F32 -> 32; else 16)."""
    m = re.search(r"(?:^|[-_.])(?:b?f|q|iq)(\d+)", name.lower())
    return int(m.group(1)) if m else 16


def load_mmproj(
    path: Path,
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    meta: dict,
    dtype,
    projectors: Mapping[str, Projector],
) -> Vision:
    """The model's way of seeing from the mmproj file at `path` (for the text model of config
    `cfg`, tokenizer and text GGUF metadata `meta`), built by its family's projector (of
    `projectors`, every family's by name: the registry's); a file that is not one, of another
    family or of another width is an MlxlisError naming it."""
    path = Path(path)
    with read_gguf(path) as gf:
        md = gf.metadata
        if md.get("general.architecture") != "clip":
            raise FileFormatError(
                f"not an mmproj file (architecture {md.get('general.architecture')!r})",
                path=path,
                field="general.architecture",
            )
        kind = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
        kinds = sorted({p.kind for p in projectors.values()})
        if kind not in kinds:
            raise UnsupportedError(
                f"projector {kind!r} is not implemented (supported: {', '.join(kinds)})",
                path=path,
                field="clip.projector_type",
            )
        own = projectors.get(cfg.family)
        if own is None or own.kind != kind:
            raise MlxlisError(
                f"a {kind!r} projector cannot serve a {cfg.family} model",
                path=path,
                field="clip.projector_type",
            )
        width = md.get("clip.vision.projection_dim")
        if width != cfg.hidden_size:
            raise MlxlisError(
                f"projects to {width}, the model's hidden size is {cfg.hidden_size}",
                path=path,
                field="clip.vision.projection_dim",
            )
        tensors = {
            name: np.array(
                convert_tensor(t, gf.raw(name), mx.float32, dequantize=True, path=str(path)).weight
            )
            for name, t in gf.tensors.items()
            if not name.startswith(("a.", "mm.a."))  # Gemma 4's audio encoder: not read
        }
        return own.build(path, md, tensors, cfg, tokenizer, meta, dtype)


def u32(md: dict, key: str, path: Path, default: int | None = None) -> int:
    v = md.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise FileFormatError(f"expected a positive integer, got {v!r}", path=path, field=key)
    return int(v)


def need(tensors: dict, name: str, path: Path) -> np.ndarray:
    if name not in tensors:
        raise FileFormatError(f"no tensor {name}", path=path, field=name)
    return tensors[name]


def image_markers(
    tokenizer: Tokenizer, wanted: tuple[tuple[str, int], ...], path: Path
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Each marker's (string, id): the string where the tokenizer has it as one special token,
    else transformers' default id where that is a special token."""
    strings, ids = [], []
    for text, default in wanted:
        got = tokenizer.encode(text, True, add_bos=False, add_eos=False)
        if len(got) == 1:
            strings.append(text)
            ids.append(got[0])
            continue
        token = tokenizer.id_to_token(default) if default < tokenizer.vocab_size else ""
        if not token or tokenizer.encode(token, True, add_bos=False, add_eos=False) != [default]:
            raise FileFormatError(
                f"the text model's vocabulary has no {text} token", path=path, field="tokenizer"
            )
        strings.append(token)
        ids.append(default)
    return tuple(strings), tuple(ids)


def mean_std(md: dict) -> tuple[list[float], list[float]]:
    mean = [float(x) for x in md.get("clip.vision.image_mean", [0.5] * 3)]
    std = [float(x) for x in md.get("clip.vision.image_std", [0.5] * 3)]
    return mean, std
