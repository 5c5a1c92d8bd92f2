"""What Ollama's /api/show and /api/ps say of a loaded model: its weights' type, its
parameter count and shape, the server's defaults."""

from __future__ import annotations

import json
from typing import Any

from mlxlis.models.experts import QuantizedSwitchLinear
from mlxlis.serve.listings import file_type
from mlxlis.serve.pool import Served

import mlx.nn as nn
from mlx.utils import tree_flatten

QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
DTYPES = {"mlx.core.float32": "F32", "mlx.core.float16": "F16", "mlx.core.bfloat16": "BF16"}


def tag(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def parameter_count(net: nn.Module) -> int:
    """The network's weights, packed quantized ones unpacked (pipelined: this rank's share)."""
    bits = {name: m.bits for name, m in net.named_modules() if isinstance(m, QUANTIZED)}
    total = 0
    for name, a in tree_flatten(net.parameters()):
        owner, _, leaf = name.rpartition(".")
        if owner not in bits or leaf not in ("weight", "scales", "biases", "super_scales"):
            total += a.size
        elif leaf == "weight":  # 32 // bits values in each uint32
            total += a.size * 32 // bits[owner]
    return total


def human(n: int) -> str:
    """A count as Ollama writes parameter_size: 135M, 494.03M, 7.6B."""
    for unit, size, digits in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= size:
            x = n / size
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{digits}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def quantization(model: Any) -> str:
    """The weights' type as Ollama names it: a GGUF's file type (Q4_K_M), MLX's bits (Q4),
    else the dtype they run in (F32, F16, BF16)."""
    if model.format == "gguf" and (ftype := file_type(model.path)):
        return ftype
    bits = (model.config.quantization or {}).get("bits")
    return f"Q{bits}" if bits else DTYPES.get(str(model.dtype), str(model.dtype))


def model_info(model: Any, context: int, count: int) -> dict[str, Any]:
    c, arch = model.config, model.config.family
    return {
        "general.architecture": arch,
        "general.parameter_count": count,
        # what a request may use, the server's bound: clients size their prompts by it
        f"{arch}.context_length": context,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.mlp.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.vocab_size": c.vocab_size,
    }


def parameters(served: Served) -> str:
    """The server's defaults as `ollama show` prints a model's parameters."""
    d = served.target.defaults
    rows: list[tuple[str, Any]] = [("num_ctx", served.target.max_context)]
    rows += [("num_predict", d.max_tokens), ("temperature", d.temperature), ("top_k", d.top_k)]
    rows += [("top_p", d.top_p), ("min_p", d.min_p), ("repeat_penalty", d.repetition_penalty)]
    rows += [("repeat_last_n", d.repetition_context)]
    stops = sorted(s for s in map(served.token_text, served.target.stop_ids) if s.strip())
    rows += [("stop", json.dumps(s, ensure_ascii=False)) for s in stops]
    return "\n".join(f"{k:<30} {v}" for k, v in rows)
