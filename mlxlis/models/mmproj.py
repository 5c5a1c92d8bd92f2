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
from collections.abc import Callable
from pathlib import Path

from mlxlis.errors import FileFormatError, MlxlisError, UnsupportedError
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.quants import convert_tensor
from mlxlis.models.config import ModelConfig
from mlxlis.models.multimodal import Vision, bind_vision
from mlxlis.prompt.images import ImageProcessing
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx
import numpy as np

PROJECTORS = {"gemma3": "gemma3", "gemma4v": "gemma4", "qwen3vl_merger": "qwen3_5"}
FAMILY_PROJECTOR = {"gemma3": "gemma3", "gemma4": "gemma4v", "qwen3_5": "qwen3vl_merger"}
FAMILY_PROJECTOR["qwen3_5_moe"] = "qwen3vl_merger"


def is_mmproj(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and "mmproj" in path.name.lower()


def beside(model_path: Path, cfg: ModelConfig) -> Path | None:
    """The mmproj file beside a text GGUF, as llama.cpp finds one: a `.gguf` in its folder
    (else the folder above: a Hub repo's per-quant folders share the top's) whose name holds
    "mmproj" — here also of the model's family and width (a folder may hold several models'
    files) — and of several, the one whose precision is nearest the model's."""
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
        kind = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
        if kind == FAMILY_PROJECTOR.get(cfg.family):
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


def load_mmproj(path: Path, cfg: ModelConfig, tokenizer: Tokenizer, meta: dict, dtype) -> Vision:
    """The model's way of seeing from the mmproj file at `path` (for the text model of config
    `cfg`, tokenizer and text GGUF metadata `meta`); a file that is not one, of another family
    or of another width is an MlxlisError naming it."""
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
        if kind not in PROJECTORS:
            raise UnsupportedError(
                f"projector {kind!r} is not implemented (supported: {', '.join(PROJECTORS)})",
                path=path,
                field="clip.projector_type",
            )
        if FAMILY_PROJECTOR.get(cfg.family) != kind:
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
        return BUILDERS[kind](path, md, tensors, cfg, tokenizer, meta, dtype)


def _u32(md: dict, key: str, path: Path, default: int | None = None) -> int:
    v = md.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise FileFormatError(f"expected a positive integer, got {v!r}", path=path, field=key)
    return int(v)


def _need(tensors: dict, name: str, path: Path) -> np.ndarray:
    if name not in tensors:
        raise FileFormatError(f"no tensor {name}", path=path, field=name)
    return tensors[name]


def _markers(
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


def _mean_std(md: dict) -> tuple[list[float], list[float]]:
    mean = [float(x) for x in md.get("clip.vision.image_mean", [0.5] * 3)]
    std = [float(x) for x in md.get("clip.vision.image_std", [0.5] * 3)]
    return mean, std


def _gemma3(path, md, tensors, cfg, tokenizer, meta, dtype) -> Vision:
    from mlxlis.models.gemma3_vision import Gemma3Images, Gemma3Vision, VisionConfig

    size, patch = _u32(md, "clip.vision.image_size", path), _u32(md, "clip.vision.patch_size", path)
    merge = _u32(md, "clip.vision.projector.scale_factor", path, 4)
    d = _u32(md, "clip.vision.embedding_length", path)
    vcfg = VisionConfig.from_hf(
        {
            "vision_config": {
                "hidden_size": d,
                "intermediate_size": _u32(md, "clip.vision.feed_forward_length", path),
                "num_hidden_layers": _u32(md, "clip.vision.block_count", path),
                "num_attention_heads": _u32(md, "clip.vision.attention.head_count", path),
                "image_size": size,
                "patch_size": patch,
                "layer_norm_eps": float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            },
            "mm_tokens_per_image": ((size // patch) // merge) ** 2,
            "text_config": {"hidden_size": cfg.hidden_size},
        },
        str(path),
    )
    pre = "vision_tower.vision_model."
    hf = {
        pre + "embeddings.patch_embedding.weight": _need(tensors, "v.patch_embd.weight", path),
        pre + "embeddings.patch_embedding.bias": _need(tensors, "v.patch_embd.bias", path),
        pre + "embeddings.position_embedding.weight": _need(
            tensors, "v.position_embd.weight", path
        ),
        pre + "post_layernorm.weight": _need(tensors, "v.post_ln.weight", path),
        pre + "post_layernorm.bias": _need(tensors, "v.post_ln.bias", path),
        "multi_modal_projector.mm_input_projection_weight": _need(
            tensors, "mm.input_projection.weight", path
        ),
        # the converter stored Gemma's x̂·(1 + w) as x̂·w'
        "multi_modal_projector.mm_soft_emb_norm.weight": _need(
            tensors, "mm.soft_emb_norm.weight", path
        )
        - 1.0,
    }
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
    }
    names |= {"attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2"}
    names |= {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
    for i in range(vcfg.num_hidden_layers):
        blk = {k: v for k, v in names.items()}
        down = _need(tensors, f"v.blk.{i}.ffn_down.weight", path)
        if down.shape[-1] == d and vcfg.intermediate_size != d:  # the old script's swap
            blk["ffn_up"], blk["ffn_down"] = "mlp.fc2", "mlp.fc1"
        for g, h in blk.items():
            for part in ("weight", "bias"):
                hf[f"{pre}encoder.layers.{i}.{h}.{part}"] = _need(
                    tensors, f"v.blk.{i}.{g}.{part}", path
                )
    net = Gemma3Vision(vcfg)
    bind_vision(net, Gemma3Vision.sanitize({k: mx.array(v) for k, v in hf.items()}), path, dtype)
    mean, std = _mean_std(md)
    processing = ImageProcessing.from_config(
        {
            "size": {"height": size, "width": size},
            "resample": 2,
            "image_mean": mean,
            "image_std": std,
        },
        str(path),
    )
    wanted = (
        ("<start_of_image>", 255999),
        ("<image_soft_token>", 262144),
        ("<end_of_image>", 256000),
    )
    markers, ids = _markers(tokenizer, wanted, path)
    return Gemma3Images(net, processing, markers, ids[1], dtype)


def _gemma4(path, md, tensors, cfg, tokenizer, meta, dtype) -> Vision:
    from mlxlis.models.gemma4_vision import Gemma4Images, Gemma4Vision, Processing, VisionConfig

    d = _u32(md, "clip.vision.embedding_length", path)
    head_dim = _need(tensors, "v.blk.0.attn_q_norm.weight", path).shape[0]
    kv = _need(tensors, "v.blk.0.attn_k.weight", path).shape[0] // head_dim
    kernel = _u32(md, "clip.vision.projector.scale_factor", path, 3)
    patch = _u32(md, "clip.vision.patch_size", path)
    clipped = any(n.endswith(".input_min") for n in tensors)
    standard = "v.std_bias" in tensors
    vcfg = VisionConfig.from_hf(
        {
            "vision_config": {
                "hidden_size": d,
                "intermediate_size": _u32(md, "clip.vision.feed_forward_length", path),
                "num_hidden_layers": _u32(md, "clip.vision.block_count", path),
                "num_attention_heads": _u32(md, "clip.vision.attention.head_count", path),
                "num_key_value_heads": kv,
                "head_dim": head_dim,
                "rms_norm_eps": float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                "pooling_kernel_size": kernel,
                "patch_size": patch,
                "position_embedding_size": _need(tensors, "v.position_embd.weight", path).shape[1],
                "use_clipped_linears": clipped,
                "standardize": standard,
            },
            "text_config": {"hidden_size": cfg.hidden_size},
        },
        str(path),
    )
    w = _need(tensors, "v.patch_embd.weight", path)  # (D, 3, p, p), a conv's
    pre = "vision_tower."
    hf = {
        pre + "patch_embedder.input_proj.weight": w.transpose(0, 2, 3, 1).reshape(d, -1),
        pre + "patch_embedder.position_embedding_table": tensors["v.position_embd.weight"],
        "embed_vision.embedding_projection.weight": _need(
            tensors, "mm.input_projection.weight", path
        ),
    }
    if standard:
        hf[pre + "std_bias"] = tensors["v.std_bias"]
        hf[pre + "std_scale"] = _need(tensors, "v.std_scale", path)
    linears = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
    }
    linears |= {"attn_out": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj"}
    linears |= {"ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    norms = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    norms |= {"ln1": "input_layernorm", "attn_post_norm": "post_attention_layernorm"}
    norms |= {"ln2": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}
    for i in range(vcfg.num_hidden_layers):
        at = f"{pre}encoder.layers.{i}."
        for g, h in linears.items():
            hf[f"{at}{h}.linear.weight"] = _need(tensors, f"v.blk.{i}.{g}.weight", path)
            if clipped:
                for b in ("input_min", "input_max", "output_min", "output_max"):
                    hf[f"{at}{h}.{b}"] = _need(tensors, f"v.blk.{i}.{g}.{b}", path).reshape(())
        for g, h in norms.items():
            hf[f"{at}{h}.weight"] = _need(tensors, f"v.blk.{i}.{g}.weight", path)
    net = Gemma4Vision(vcfg)
    bind_vision(net, Gemma4Vision.sanitize({k: mx.array(v) for k, v in hf.items()}), path, dtype)
    mean, std = _mean_std(md)
    normalize = mean != [0.0] * 3 or std != [1.0] * 3
    processing = Processing.from_config(
        {
            "patch_size": patch,
            "pooling_kernel_size": kernel,
            "do_normalize": normalize,
            "image_mean": mean,
            "image_std": std,
        },
        str(path),
    )
    wanted = (("<|image>", 255999), ("<|image|>", 258880), ("<image|>", 258882))
    markers, ids = _markers(tokenizer, wanted, path)
    pad = meta.get("tokenizer.ggml.padding_token_id", 0)
    return Gemma4Images(net, processing, markers, ids[1], int(pad), dtype)


def _qwen3_5(path, md, tensors, cfg, tokenizer, meta, dtype) -> Vision:
    from mlxlis.models.qwen3_5_vision import Processing, Qwen35Images, Qwen35Vision, VisionConfig

    if any(md.get("clip.vision.is_deepstack_layers", [])):
        raise UnsupportedError(
            "deepstack layers (Qwen3-VL) are not implemented",
            path=path,
            field="clip.vision.is_deepstack_layers",
        )
    fc2 = _need(tensors, "mm.2.weight", path)
    patch = _u32(md, "clip.vision.patch_size", path)
    merge = _u32(md, "clip.vision.spatial_merge_size", path, 2)
    vcfg = VisionConfig.from_hf(
        {
            "vision_config": {
                "depth": _u32(md, "clip.vision.block_count", path),
                "hidden_size": _u32(md, "clip.vision.embedding_length", path),
                "intermediate_size": _u32(md, "clip.vision.feed_forward_length", path),
                "num_heads": _u32(md, "clip.vision.attention.head_count", path),
                "patch_size": patch,
                "spatial_merge_size": merge,
                "temporal_patch_size": 2,
                "out_hidden_size": fc2.shape[0],
                "num_position_embeddings": _need(tensors, "v.position_embd.weight", path).shape[0],
            },
            "text_config": {"hidden_size": cfg.hidden_size},
        },
        str(path),
    )
    frames = [
        _need(tensors, "v.patch_embd.weight", path),
        _need(tensors, "v.patch_embd.weight.1", path),
    ]
    hf = {
        "patch_embed.proj.weight": np.stack(frames, axis=2),
        "patch_embed.proj.bias": _need(tensors, "v.patch_embd.bias", path),
        "pos_embed.weight": tensors["v.position_embd.weight"],
        "merger.norm.weight": _need(tensors, "v.post_ln.weight", path),
        "merger.norm.bias": _need(tensors, "v.post_ln.bias", path),
        "merger.linear_fc1.weight": _need(tensors, "mm.0.weight", path),
        "merger.linear_fc1.bias": _need(tensors, "mm.0.bias", path),
        "merger.linear_fc2.weight": fc2,
        "merger.linear_fc2.bias": _need(tensors, "mm.2.bias", path),
    }
    names = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}
    names |= {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
    for i in range(vcfg.depth):
        for g, h in names.items():
            for part in ("weight", "bias"):
                hf[f"blocks.{i}.{h}.{part}"] = _need(tensors, f"v.blk.{i}.{g}.{part}", path)
    net = Qwen35Vision(vcfg)
    bind_vision(net, {k: mx.array(v) for k, v in hf.items()}, path, dtype)
    mean, std = _mean_std(md)
    processing = Processing.from_config(
        {"patch_size": patch, "merge_size": merge, "image_mean": mean, "image_std": std}, str(path)
    )
    (pad,), (image_id,) = _markers(tokenizer, (("<|image_pad|>", 248056),), path)
    arch = meta.get("general.architecture", "qwen35")
    sections = [int(x) for x in meta.get(f"{arch}.rope.dimension_sections", [11, 11, 10])][:3]
    rotary = cfg.rotary_dim or cfg.head_dim
    return Qwen35Images(net, processing, pad, image_id, rotary, tuple(sections), dtype)


BUILDERS: dict[str, Callable[..., Vision]] = {
    "gemma3": _gemma3,
    "gemma4v": _gemma4,
    "qwen3vl_merger": _qwen3_5,
}
