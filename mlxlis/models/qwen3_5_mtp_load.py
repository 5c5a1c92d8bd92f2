"""Reading a Qwen3.5 / Qwen3.6 model's MTP block (qwen3_5_mtp.py) on first use, through the
shared MTP loader (mtp_load.py): the block's names in folders and GGUF files; from a GGUF,
llama.cpp's +1 on the block's zero-centred norms undone.
"""

from __future__ import annotations

from mlxlis.models.conventions import gemma_norm_minus_one
from mlxlis.models.mtp_load import BlockFormat, drafter
from mlxlis.models.qwen3_5_mtp import (
    GGUF_NEXTN_COPIES,
    MTPBlock,
    gguf_name,
    hf_block_layers,
    is_mtp_norm,
)

import mlx.core as mx


def _undo(name: str, arr: mx.array) -> mx.array:
    return gemma_norm_minus_one(arr) if is_mtp_norm(name) else arr  # llama.cpp's +1


FORMAT = BlockFormat(
    build=lambda model: MTPBlock(model.config),
    hf_layers=hf_block_layers,
    gguf_name=gguf_name,
    gguf_copies=GGUF_NEXTN_COPIES,
    gguf_undo=_undo,
)
mtp_head = drafter(FORMAT)
