"""The newer families' shapes for scripts/bench_families.py: config.json dicts at a realistic
width (hidden 2048 by default, a few layers), each family's own head and expert layout.

OLMo 3 (7B-like heads: 16 of 128, three sliding layers then a full one), LFM2 (1.2B-like: short
convolutions on most layers, GQA on the rest), GLM-4.5 (Air-like heads: 16 query / 2 KV of 128,
half rotated, a dense first layer, then 32 experts of which 4 a token in 4 groups with 2 used,
a shared expert), MiniMax-M2 (24 query / 4 KV heads of 128, half rotated, 32 experts of which 4
a token); and, when the registry has them, DeepSeek-V3 (MLA: 16 heads, kv_lora_rank 512,
q_lora_rank 768, 128 + 64 query-key and 128 value dims per head, 32 experts in 4 groups),
Granite 4.0-H (Mamba-2 layers and one attention layer in four, experts and a shared MLP) and
Nemotron-H (Mamba-2, attention and expert layers by its pattern).

`write_model` writes a shape as a Hugging Face folder both engines load. `expanded_kv_bytes`
is the hook for the MLA families: the K/V bytes a token would take were
its latent expanded to per-head keys and values (what `bench_families` sets beside the cache
bytes each engine measures); None for the families whose cache holds per-head K/V already.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

S, F = "sliding_attention", "full_attention"


def new_family_configs(layers: int, hidden: int) -> dict[str, dict[str, Any]]:
    """name -> config.json dict (its model_type the registry's name for it)."""
    n = layers
    return {
        "olmo3": {
            "model_type": "olmo3",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "sliding_window": 128,  # the window ends inside the prompt
            "layer_types": [F if (i + 1) % 4 == 0 else S for i in range(n)],
            "rope_theta": 500000.0,
            "max_position_embeddings": 4096,
        },
        "lfm2": {
            "model_type": "lfm2",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "block_ff_dim": 3 * hidden,
            "block_auto_adjust_ff_dim": False,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "conv_L_cache": 3,
            "layer_types": ["full_attention" if i % 3 == 2 else "conv" for i in range(n)],
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
        },
        "glm4_moe": {
            "model_type": "glm4_moe",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": False,
            "n_routed_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": hidden // 2,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 1,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
        },
        "minimax_m2": {
            "model_type": "minimax_m2",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": hidden // 2,  # each expert's width
            "num_hidden_layers": n,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "rotary_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "rope_theta": 5000000.0,
            "max_position_embeddings": 4096,
        },
        "deepseek_v3": {
            "model_type": "deepseek_v3",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "moe_intermediate_size": hidden // 2,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": 768,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 32,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
        },
        "granitemoehybrid": {
            "model_type": "granitemoehybrid",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": hidden // 2,
            "shared_intermediate_size": 2 * hidden,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "layer_types": ["attention" if i % 4 == 3 else "mamba" for i in range(n)],
            "mamba_n_heads": 64,
            "mamba_d_head": 2 * hidden // 64,
            "mamba_d_state": 128,
            "mamba_n_groups": 1,
            "position_embedding_type": "nope",
            "max_position_embeddings": 4096,
        },
        "nemotron_h": {
            "model_type": "nemotron_h",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": n,
            "hybrid_override_pattern": "".join(
                "*" if i % 4 == 3 else "ME"[i % 2] for i in range(n)
            ),
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "mamba_num_heads": 64,
            "mamba_head_dim": 2 * hidden // 64,
            "ssm_state_size": 128,
            "n_groups": 8,
            "n_routed_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": hidden // 2,
            "moe_shared_expert_intermediate_size": hidden,
            "max_position_embeddings": 4096,
        },
    }


def expanded_kv_bytes(raw: dict[str, Any], itemsize: int = 4) -> int | None:
    """Bytes per token of K and V expanded per head over every layer (an MLA config: one with
    kv_lora_rank), in `itemsize`-byte floats; None for any other config."""
    if "kv_lora_rank" not in raw:
        return None
    k = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
    return layers * heads * (k + raw["v_head_dim"]) * itemsize


def write_model(folder: Path, raw: dict) -> None:
    """Random weights under Hugging Face names, config.json as `convert` writes it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(ROOT))
    from mlxlis.commands.convert import hf_config
    from mlxlis.models import build_model, config_from_hf, family

    folder.mkdir()
    cfg = config_from_hf(raw)
    net = build_model(cfg)
    mx.random.seed(0)
    spec = family(cfg.family)  # the tensors named as `convert` writes them
    params = dict(tree_flatten(net.parameters()))
    for copy, src in (spec.export.copies(cfg) if spec.export.copies else {}).items():
        params.update({copy + k[len(src) :]: v for k, v in params.items() if k.startswith(src)})
    params = {  # integer buffers (Qwen4-Exp's hash constants) as the model computes them
        k: (mx.random.normal(v.shape) * 0.02 if v.ndim > 1 else mx.ones(v.shape) * 0.5)
        if mx.issubdtype(v.dtype, mx.floating)
        else v
        for k, v in params.items()
    }
    for k in params:
        if k.endswith("A_log"):
            params[k] = mx.log(mx.random.uniform(0.5, 4.0, params[k].shape))
    if spec.export.layout is not None:
        params = {k: spec.export.layout(k, v) for k, v in params.items()}
    params = {spec.export.name(k): v for k, v in params.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), params, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, mx.float32, None)))
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())  # mlxlis opens a folder with its tokenizer; any will do
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["a small text for a tokenizer"] * 4, trainers.BpeTrainer())
    tok.save(str(folder / "tokenizer.json"))
