"""Qwen3.5's tower from llama.cpp's mmproj file (projector type "qwen3vl_merger"): its ViT and
merger, as mmproj.py says what the converter changed."""

from __future__ import annotations

from mlxlis.errors import UnsupportedError
from mlxlis.models.base import Projector
from mlxlis.models.mmproj import image_markers, mean_std, need, u32
from mlxlis.models.multimodal import Vision, bind_vision
from mlxlis.models.qwen3_5_vision import Processing, Qwen35Images, Qwen35Vision, VisionConfig

import mlx.core as mx
import numpy as np


def build(path, md, tensors, cfg, tokenizer, meta, dtype) -> Vision:
    """The tower and its image processing from the mmproj file's metadata and tensors."""
    if any(md.get("clip.vision.is_deepstack_layers", [])):
        raise UnsupportedError(
            "deepstack layers (Qwen3-VL) are not implemented",
            path=path,
            field="clip.vision.is_deepstack_layers",
        )
    fc2 = need(tensors, "mm.2.weight", path)
    patch = u32(md, "clip.vision.patch_size", path)
    merge = u32(md, "clip.vision.spatial_merge_size", path, 2)
    vcfg = VisionConfig.from_hf(
        {
            "vision_config": {
                "depth": u32(md, "clip.vision.block_count", path),
                "hidden_size": u32(md, "clip.vision.embedding_length", path),
                "intermediate_size": u32(md, "clip.vision.feed_forward_length", path),
                "num_heads": u32(md, "clip.vision.attention.head_count", path),
                "patch_size": patch,
                "spatial_merge_size": merge,
                "temporal_patch_size": 2,
                "out_hidden_size": fc2.shape[0],
                "num_position_embeddings": need(tensors, "v.position_embd.weight", path).shape[0],
            },
            "text_config": {"hidden_size": cfg.hidden_size},
        },
        str(path),
    )
    frames = [
        need(tensors, "v.patch_embd.weight", path),
        need(tensors, "v.patch_embd.weight.1", path),
    ]
    hf = {
        "patch_embed.proj.weight": np.stack(frames, axis=2),
        "patch_embed.proj.bias": need(tensors, "v.patch_embd.bias", path),
        "pos_embed.weight": tensors["v.position_embd.weight"],
        "merger.norm.weight": need(tensors, "v.post_ln.weight", path),
        "merger.norm.bias": need(tensors, "v.post_ln.bias", path),
        "merger.linear_fc1.weight": need(tensors, "mm.0.weight", path),
        "merger.linear_fc1.bias": need(tensors, "mm.0.bias", path),
        "merger.linear_fc2.weight": fc2,
        "merger.linear_fc2.bias": need(tensors, "mm.2.bias", path),
    }
    names = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}
    names |= {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
    for i in range(vcfg.depth):
        for g, h in names.items():
            for part in ("weight", "bias"):
                hf[f"blocks.{i}.{h}.{part}"] = need(tensors, f"v.blk.{i}.{g}.{part}", path)
    net = Qwen35Vision(vcfg)
    bind_vision(net, {k: mx.array(v) for k, v in hf.items()}, path, dtype)
    mean, std = mean_std(md)
    processing = Processing.from_config(
        {"patch_size": patch, "merge_size": merge, "image_mean": mean, "image_std": std}, str(path)
    )
    (pad,), (image_id,) = image_markers(tokenizer, (("<|image_pad|>", 248056),), path)
    arch = meta.get("general.architecture", "qwen35")
    sections = [int(x) for x in meta.get(f"{arch}.rope.dimension_sections", [11, 11, 10])][:3]
    rotary = cfg.attention.rotary_dim or cfg.head_dim
    return Qwen35Images(net, processing, pad, image_id, rotary, tuple(sections), dtype)


PROJECTOR = Projector("qwen3vl_merger", build)
