"""Qwen3.5 / Qwen3.6 (dense and MoE): hybrid decoders of Gated DeltaNet layers (deltanet.py)
and gated full-attention layers, on the shared decoder.

  layers        `layer_types`: "linear_attention" (Gated DeltaNet) | "full_attention"; older
                configs give `full_attention_interval` (every n-th layer full, default 4)
  attention     q/k RMSNorm, a sigmoid output gate from a doubled q_proj, GQA, RoPE on the
                first head_dim·partial_rotary_factor dims (text positions: the multimodal RoPE
                sections all carry the same position, so it is plain RoPE)
  norms         x̂·(1 + w) in float32 (zero-centred weights), except DeltaNet's gated norm (x̂·w)
  MoE           every layer: softmax router, top-k renormalised, plus a shared expert scaled by
                sigmoid(shared_expert_gate)
HF `qwen3_5` / `qwen3_5_moe` (multimodal: the language model is read, and the vision tower
with it where the folder has its processor's settings: qwen3_5_vision.py) and `qwen3_5_text` /
`qwen3_5_moe_text`. The multi-token-prediction block (`mtp.*`,
GGUF `blk.N.nextn.*` + block N) is skipped here and read on its own when `--speculative mtp`
drafts with it (qwen3_5_mtp.py, qwen3_5_mtp_load.py).
Defaults are transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig.
"""

from __future__ import annotations

from mlxlis.models.base import LANGUAGE_MODEL_RENAMES, Export, Family, GGUFFormat, HFFormat
from mlxlis.models.conventions import QWEN35_GGUF
from mlxlis.models.hybrid import (
    DROPPED,
    GGUF_BLOCK,
    MLX,
    MOE_DEFAULTS,
    HybridDecoder,
    exporter,
    gguf_parser,
    hf_parser,
    mtp_tensor,
)
from mlxlis.models.qwen3_5_mmproj import PROJECTOR as MMPROJ
from mlxlis.models.qwen3_5_mtp_load import mtp_head
from mlxlis.models.qwen3_5_vision import load_images

# multimodal checkpoints: the language model under model.language_model.* (mlx-lm saves it
# as language_model.model.*: LANGUAGE_MODEL_RENAMES); the vision tower (read by `vision`:
# qwen3_5_vision.py) and the multi-token-prediction head (read on its own when drafting with
# it: qwen3_5_mtp_load.py) are the text plan's dropped names
QWEN3_5 = Family(
    name="qwen3_5",
    hf=HFFormat(
        model_types=("qwen3_5", "qwen3_5_text"),
        parse=hf_parser(False),
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=DROPPED,
    ),
    gguf=GGUFFormat(
        archs=("qwen35",),
        parse=gguf_parser(False),
        block=GGUF_BLOCK,
        conventions=QWEN35_GGUF,
        ignored=mtp_tensor,
    ),
    network=HybridDecoder,
    export=Export(
        model_type="qwen3_5_text",
        architecture="Qwen3_5ForCausalLM",
        wrapper="qwen3_5",  # mlx-lm reads the wrapper type only
        config=exporter(False),
    ),
    vision=load_images,  # the ViT and merger, where the folder has their processor
    mmproj=MMPROJ,  # llama.cpp's "qwen3vl_merger" projector
    mtp=mtp_head,  # `--speculative mtp` (qwen3_5_mtp.py, qwen3_5_mtp_load.py)
    mlx=MLX,
    warmup={  # Gated DeltaNet, a gated attention with partial RoPE
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.25,
        },
    },
)
QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    hf=HFFormat(
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        parse=hf_parser(True),
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=DROPPED,
        defaults={"intermediate_size": MOE_DEFAULTS["moe_intermediate_size"]},  # no dense MLP
    ),
    gguf=GGUFFormat(
        archs=("qwen35moe",),
        parse=gguf_parser(True),
        block=GGUF_BLOCK,
        conventions=QWEN35_GGUF,
        ignored=mtp_tensor,
    ),
    network=HybridDecoder,
    export=Export(
        model_type="qwen3_5_moe_text",
        wrapper="qwen3_5_moe",
        architecture="Qwen3_5MoeForCausalLM",
        config=exporter(True),
    ),
    vision=load_images,
    mmproj=MMPROJ,
    mtp=mtp_head,
    mlx=MLX,
)
