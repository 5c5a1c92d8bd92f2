"""Gemma 4's tower from llama.cpp's mmproj file (projector type "gemma4v"): its encoder and
embedder, as mmproj.py says what the converter changed."""

from __future__ import annotations

from mlxlis.models.base import Projector
from mlxlis.models.gemma4_vision import Gemma4Images, Gemma4Vision, Processing, VisionConfig
from mlxlis.models.mmproj import image_markers, mean_std, need, u32
from mlxlis.models.multimodal import Vision, bind_vision

import mlx.core as mx


def build(path, md, tensors, cfg, tokenizer, meta, dtype) -> Vision:
    """The tower and its image processing from the mmproj file's metadata and tensors."""
    d = u32(md, "clip.vision.embedding_length", path)
    head_dim = need(tensors, "v.blk.0.attn_q_norm.weight", path).shape[0]
    kv = need(tensors, "v.blk.0.attn_k.weight", path).shape[0] // head_dim
    kernel = u32(md, "clip.vision.projector.scale_factor", path, 3)
    patch = u32(md, "clip.vision.patch_size", path)
    clipped = any(n.endswith(".input_min") for n in tensors)
    standard = "v.std_bias" in tensors
    vcfg = VisionConfig.from_hf(
        {
            "vision_config": {
                "hidden_size": d,
                "intermediate_size": u32(md, "clip.vision.feed_forward_length", path),
                "num_hidden_layers": u32(md, "clip.vision.block_count", path),
                "num_attention_heads": u32(md, "clip.vision.attention.head_count", path),
                "num_key_value_heads": kv,
                "head_dim": head_dim,
                "rms_norm_eps": float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                "pooling_kernel_size": kernel,
                "patch_size": patch,
                "position_embedding_size": need(tensors, "v.position_embd.weight", path).shape[1],
                "use_clipped_linears": clipped,
                "standardize": standard,
            },
            "text_config": {"hidden_size": cfg.hidden_size},
        },
        str(path),
    )
    w = need(tensors, "v.patch_embd.weight", path)  # (D, 3, p, p), a conv's
    pre = "vision_tower."
    hf = {
        pre + "patch_embedder.input_proj.weight": w.transpose(0, 2, 3, 1).reshape(d, -1),
        pre + "patch_embedder.position_embedding_table": tensors["v.position_embd.weight"],
        "embed_vision.embedding_projection.weight": need(
            tensors, "mm.input_projection.weight", path
        ),
    }
    if standard:
        hf[pre + "std_bias"] = tensors["v.std_bias"]
        hf[pre + "std_scale"] = need(tensors, "v.std_scale", path)
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
            hf[f"{at}{h}.linear.weight"] = need(tensors, f"v.blk.{i}.{g}.weight", path)
            if clipped:
                for b in ("input_min", "input_max", "output_min", "output_max"):
                    hf[f"{at}{h}.{b}"] = need(tensors, f"v.blk.{i}.{g}.{b}", path).reshape(())
        for g, h in norms.items():
            hf[f"{at}{h}.weight"] = need(tensors, f"v.blk.{i}.{g}.weight", path)
    net = Gemma4Vision(vcfg)
    bind_vision(net, Gemma4Vision.sanitize({k: mx.array(v) for k, v in hf.items()}), path, dtype)
    mean, std = mean_std(md)
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
    markers, ids = image_markers(tokenizer, wanted, path)
    pad = meta.get("tokenizer.ggml.padding_token_id", 0)
    return Gemma4Images(net, processing, markers, ids[1], int(pad), dtype)


PROJECTOR = Projector("gemma4v", build)
