"""`mlxlis inspect`: what a loaded model is, as text for people and JSON for scripts.

The JSON shape (`schema` 1) is stable: keys are only ever added, never renamed or removed.

    {"schema": 1,
     "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "path": "/…/SmolLM2-135M-Instruct.Q4_1.gguf",
     "format": "gguf", "family": "llama",
     "quant": "F32×61, Q4_1×210, Q8_0×1 (dense)",   # tensor types in the file, and the form used
     "dtype": "float32", "device": "cpu", "blas": "OpenBLAS 0.3.34 (…)",
     "blas_notice": null,                           # or why a faster BLAS is not in use
     "kernels": "mlxlis qmv (avx2, 2 threads)",     # quantized products on the CPU (or
                                                    # "MLX's own (…why…)")
     "template": "gguf:tokenizer.chat_template",    # or null: no chat template
     "skipped": null,                               # or what of the file a text-only load
                                                    # left out (a vision tower, an MTP head)
     "vision": null,                                # or how it sees ("SigLIP 896 px, 256
                                                    # tokens per image")
     "audio": null,                                 # or how it hears ("Whisper encoder, 32
                                                    # layers, 375 tokens per 30 s chunk")
     "config": {"layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                "attention_heads": 9, "kv_heads": 3, "head_dim": 64, "vocab_size": 49152,
                "context_length": 8192, "tie_word_embeddings": true,
                "rope": {"theta": 100000.0, "type": "default", "factor": 1.0},
                "sliding_window": null, "layer_types": [],
                "attention_chunk_size": null,      # Llama 4: chunked layers' span
                "no_rope_layers": [],              # layers without RoPE (NoPE)
                "attention_sinks": false,          # gpt-oss: a sink logit per head
                "query_temperature": null,         # Llama 4 / Ministral 3: {floor, scale, ...}
                "experts": null,                   # MoE: {"count", "per_token", "width",
                                                   #       "sparse_layers", "norm_topk_prob"}
                "streams": null,                   # Gemma 3n: {"count", "active",
                                                   #   "laurel_rank", "sparse_gate_layers"}
                "hyper_connections": null},        # Qwen4-Exp: {"count", "rank",
                                                   #   "ple_layers", "ngram_size", "qsa":
                                                   #   {"budget", "block", "heads"}}
                                                   # (a family's own keys: its Description)
     "weights": {"arrays": 272, "bytes": 538000000},  # as held in memory after loading
     "stop_ids": [2],
     "memory": {"kv_format": "dense",               # or e.g. "8-bit (groups of 64)" (--kv-bits)
                "kv_bytes_per_token": 184320,       # full-attention layers' K/V per position
                "kv_fixed_bytes": 0,                # recurrent states, whatever the length
                "budget_bytes": 25000000000,        # what mlxlis may fill (MLXLIS_MAX_MEMORY)
                "max_context": 8192}}               # the longest one sequence's caches fit
                                                    # beside the weights (≤ context_length)
    (a model pipelined across ranks reports "memory": null: each rank holds a share; so does
    an embedding or reranking model, which keeps no KV cache)
"""

from __future__ import annotations

from typing import Any

from mlxlis.models import REGISTRY, family
from mlxlis.models.footprint import footprint, weight_arrays
from mlxlis.models.model import Model
from mlxlis.runtime import process
from mlxlis.runtime.memory import memory_budget

SCHEMA = 1


def model_report(model: Model) -> dict[str, Any]:
    """The inspect report of a loaded Model (see the module docstring for the shape)."""
    d, run = model.describe(), process.describe()
    c = model.config
    seen = weight_arrays(model)
    return {
        "schema": SCHEMA,
        "model": d["model"],
        "path": str(model.path),
        "format": d["format"],
        "family": d["family"],
        "quant": d["quant"],
        "dtype": d["dtype"],
        "device": run["device"],
        "blas": run["blas"],
        "blas_notice": run.get("notice"),  # why a faster BLAS is not in use, or null
        "kernels": run["kernels"],  # what runs quantized products (the CPU: mlxlis qmv or MLX's)
        "template": model.template_source,
        "skipped": d.get("skipped"),
        "vision": d.get("vision"),
        "audio": d.get("audio"),
        "config": {
            "layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.mlp.intermediate_size,
            "attention_heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "context_length": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings,
            "rope": {"theta": c.rope.theta, "type": c.rope.type, "factor": c.rope.factor},
            "sliding_window": c.attention.sliding_window,
            "layer_types": list(c.layer_types),
            "attention_chunk_size": c.attention.chunk_size,
            "no_rope_layers": [i for i, x in enumerate(c.attention.no_rope_layers) if x],
            "attention_sinks": c.attention.sinks,
            "query_temperature": None  # q · (1 + scale·log(1 + ⌊(p + offset) / floor⌋))
            if c.attention.temperature is None
            else {
                "floor": c.attention.temperature[0],
                "scale": c.attention.temperature[1],
                "offset": c.attention.temperature_offset,
                "layers": "all" if c.attention.temperature_all else "nope",
            },
            "experts": {
                "count": c.moe.num_experts,
                "per_token": c.moe.num_experts_per_tok,
                "width": c.moe.intermediate_size,
                "sparse_layers": [i for i, s in enumerate(c.moe.sparse_layers) if s],
                "norm_topk_prob": c.moe.norm_topk_prob,
            }
            if c.moe is not None
            else None,
            # the families' own keys (models/*_describe.py), null but for the model's
            **{k: None for f in REGISTRY.values() for k in f.describe.keys},
            **family(c.family).describe.config(c),
        },
        "weights": {"arrays": len(seen), "bytes": sum(seen.values())},
        "stop_ids": sorted(model.stop_ids()),
        "memory": _memory(model),
    }


def _memory(model: Model) -> dict[str, Any] | None:
    if model.part is not None or model.task != "generate":  # an encoder keeps no KV cache
        return None
    fp, budget = footprint(model), memory_budget()
    room = budget - fp.weights
    return {
        "kv_format": str(model.kv_format or "dense"),
        "kv_bytes_per_token": fp.per_token,
        "kv_fixed_bytes": fp.kv_bytes(0),
        "budget_bytes": budget,
        "max_context": fp.max_context(room, model.context_length),
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as aligned lines of text."""
    c = r["config"]
    rope = c["rope"]
    rope_text = f"θ {rope['theta']:g}" + (
        f", {rope['type']} ×{rope['factor']:g}" if rope["type"] != "default" else ""
    )
    sliding = sum(t == "sliding_attention" for t in c["layer_types"])
    window = f", sliding window {c['sliding_window']}" if c["sliding_window"] else ""
    if c["sliding_window"] and sliding:
        window += f" in {sliding} of {c['layers']} layers"
    chunked = sum(t == "chunked_attention" for t in c["layer_types"])
    if chunked:
        window += f", attention chunks of {c['attention_chunk_size']} in {chunked} layers"
    if c.get("no_rope_layers"):
        rope_text += f"; none in layers {', '.join(map(str, c['no_rope_layers']))} (NoPE)"
    if t := c.get("query_temperature"):
        where = "every layer" if t["layers"] == "all" else "the NoPE layers"
        rope_text += f"; query temperature {t['scale']:g} per ⌊p / {t['floor']}⌋ on {where}"
    rows = [
        ("model", r["model"]),
        ("path", r["path"]),
        ("family", r["family"]),
        ("format", r["format"]),
        ("quant", r["quant"]),
        ("dtype", f"{r['dtype']} on {r['device']}"),
        ("blas", r["blas"] + (f" ({r['blas_notice']})" if r.get("blas_notice") else "")),
        ("kernels", r["kernels"]),
        ("template", r["template"] or "none (chat needs --chat-template, or use --no-chat)"),
        *([("vision", r["vision"])] if r.get("vision") else []),
        *([("audio", r["audio"])] if r.get("audio") else []),
        *([("skipped", r["skipped"])] if r.get("skipped") else []),
        ("layers", f"{c['layers']}, hidden {c['hidden_size']}, mlp {c['intermediate_size']}"),
        (
            "heads",
            f"{c['attention_heads']} ({c['kv_heads']} kv), head_dim {c['head_dim']}"
            + (", a sink logit each" if c.get("attention_sinks") else ""),
        ),
        *_experts_row(c.get("experts")),
        *family(r["family"]).describe.rows(c),
        ("vocab", str(c["vocab_size"])),
        ("context", f"{c['context_length']}{window}"),
        ("rope", rope_text),
        ("weights", f"{r['weights']['bytes'] / 2**20:.0f} MiB in {r['weights']['arrays']} arrays"),
        ("stop ids", ", ".join(map(str, r["stop_ids"]))),
        *_memory_row(r.get("memory")),
    ]
    return "\n".join(f"{k:>9}: {v}" for k, v in rows)


def _memory_row(m: dict[str, Any] | None) -> list[tuple[str, str]]:
    if m is None:
        return []
    per = m["kv_bytes_per_token"] / 1024
    text = (
        f"KV {m['kv_format']}, {per:.1f} KiB per token; {m['budget_bytes'] / 2**30:.1f} GiB "
        f"to fill: one sequence reaches {m['max_context']} tokens"
    )
    return [("memory", text)]


def _experts_row(e: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not e:
        return []
    n = len(e["sparse_layers"])
    return [
        (
            "experts",
            f"{e['per_token']} of {e['count']} per token, width {e['width']}, "
            f"in {n} layer{'s' if n != 1 else ''}",
        )
    ]
