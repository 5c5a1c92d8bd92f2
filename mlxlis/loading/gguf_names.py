"""GGUF tensor names -> module names, one declarative table per family.

`{i}` stands for the block index. A GGUF tensor that no row matches is an error naming it.
"""

from __future__ import annotations

import re

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GEMMA2_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_GEMMA3_BLOCK = {
    **_GEMMA2_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

TABLES: dict[str, dict[str, str]] = {}
for _family, _block in (
    ("llama", _LLAMA_BLOCK),
    ("qwen2", _LLAMA_BLOCK),
    ("gemma", _LLAMA_BLOCK),
    ("gemma2", _GEMMA2_BLOCK),
    ("gemma3", _GEMMA3_BLOCK),
):
    table = {f"{k}.{{p}}": f"{v}.{{p}}" for k, v in _TOP.items()}
    table.update(
        {f"blk.{{i}}.{k}.{{p}}": f"model.layers.{{i}}.{v}.{{p}}" for k, v in _block.items()}
    )
    TABLES[_family] = table

# GGUF tensors that are not module parameters (used by the loader directly)
SPECIAL = {"rope_freqs.weight"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([^.]+)\.(weight|bias)$")


def module_name(family: str, gguf_name: str) -> str | None:
    """The module tensor name for a GGUF tensor, or None when the table has no row for it."""
    table = TABLES[family]
    m = _BLOCK_RE.match(gguf_name)
    if m:
        i, key, part = m.groups()
        target = table.get(f"blk.{{i}}.{key}.{{p}}")
        return target.format(i=int(i), p=part) if target else None
    m = _TOP_RE.match(gguf_name)
    if m:
        key, part = m.groups()
        target = table.get(f"{key}.{{p}}")
        return target.format(p=part) if target else None
    return None
