"""Gemma 3's tower from llama.cpp's mmproj file (projector type "gemma3"): the SigLIP encoder
and Gemma 3's projector, as mmproj.py says what the converter changed."""

from __future__ import annotations

from mlxlis.models.base import Projector
from mlxlis.models.gemma3_vision import Gemma3Images, Gemma3Vision, VisionConfig
from mlxlis.models.mmproj import image_markers, mean_std, need, u32
from mlxlis.models.multimodal import Vision, bind_vision
from mlxlis.prompt.images import ImageProcessing

import mlx.core as mx


def build(path, md, tensors, cfg, tokenizer, meta, dtype) -> Vision:
    """The tower and its image processing from the mmproj file's metadata and tensors."""
    size, patch = u32(md, "clip.vision.image_size", path), u32(md, "clip.vision.patch_size", path)
    merge = u32(md, "clip.vision.projector.scale_factor", path, 4)
    d = u32(md, "clip.vision.embedding_length", path)
    vcfg = VisionConfig.from_hf(
        {
            "vision_config": {
                "hidden_size": d,
                "intermediate_size": u32(md, "clip.vision.feed_forward_length", path),
                "num_hidden_layers": u32(md, "clip.vision.block_count", path),
                "num_attention_heads": u32(md, "clip.vision.attention.head_count", path),
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
        pre + "embeddings.patch_embedding.weight": need(tensors, "v.patch_embd.weight", path),
        pre + "embeddings.patch_embedding.bias": need(tensors, "v.patch_embd.bias", path),
        pre + "embeddings.position_embedding.weight": need(tensors, "v.position_embd.weight", path),
        pre + "post_layernorm.weight": need(tensors, "v.post_ln.weight", path),
        pre + "post_layernorm.bias": need(tensors, "v.post_ln.bias", path),
        "multi_modal_projector.mm_input_projection_weight": need(
            tensors, "mm.input_projection.weight", path
        ),
        # the converter stored Gemma's x̂·(1 + w) as x̂·w'
        "multi_modal_projector.mm_soft_emb_norm.weight": need(
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
        down = need(tensors, f"v.blk.{i}.ffn_down.weight", path)
        if down.shape[-1] == d and vcfg.intermediate_size != d:  # the old script's swap
            blk["ffn_up"], blk["ffn_down"] = "mlp.fc2", "mlp.fc1"
        for g, h in blk.items():
            for part in ("weight", "bias"):
                hf[f"{pre}encoder.layers.{i}.{h}.{part}"] = need(
                    tensors, f"v.blk.{i}.{g}.{part}", path
                )
    net = Gemma3Vision(vcfg)
    bind_vision(net, Gemma3Vision.sanitize({k: mx.array(v) for k, v in hf.items()}), path, dtype)
    mean, std = mean_std(md)
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
    markers, ids = image_markers(tokenizer, wanted, path)
    return Gemma3Images(net, processing, markers, ids[1], dtype)


PROJECTOR = Projector("gemma3", build)
