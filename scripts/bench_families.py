"""`make bench` (new families): Qwen3.5-, Qwen3-Next-, Gemma 4-, Gemma 3n-, Llama 4-, gpt-oss-,
Ministral 3-, SmolLM3- and Phi-4-mini-shaped models, mlxlis against mlx-lm; a Qwen4-Exp-shaped
one, which mlx-lm does not run, mlxlis alone.

Random float32 models with real head shapes at a small width: a Qwen3.5 (3 Gated DeltaNet
layers per gated-attention layer; 16 key / 32 value heads of 128 for DeltaNet, 8 query / 2 KV
heads of 256, a quarter rotated), a Gemma 4 E2B-like (sliding and full layers with head
dims 256 / 512, per-layer input embeddings, the last layers KV-shared with double-wide MLPs,
proportional RoPE), a Gemma 3n E2B-like (4 AltUp streams, LAuReL, per-layer inputs, a third
of the layers KV-shared, sparse gates in the first third), a Llama 4 Scout-like (16 experts,
top-1, a shared expert, chunked attention with NoPE every 4th layer), a gpt-oss 20B-like
(sinks, sliding and full layers, YaRN, 32 experts of which 4 a token) and a Ministral 3
8B-like (YaRN, the query temperature), a Qwen3-Next (Qwen3.5's heads, 32 experts of which 4
a token and a shared one), a SmolLM3-3B-like (NoPE every 4th layer) and a Phi-4-mini-like
(24 / 8 heads of 128, fused projections, 3/4 rotated, LongRoPE). Each is written once as a
Hugging Face folder (config.json and tensor names as `convert` writes them); each engine
loads it in a fresh process (mlxlis first, so both run on the same BLAS) and runs a
PROMPT-token prefill and DECODE greedy steps, best of --rounds. Prints a Markdown table and
writes bench-results/families.json.

The newer families (scripts/family_shapes.py: OLMo 3, LFM2, GLM-4.5, MiniMax-M2, and DeepSeek-V3,
Granite 4.0-H and Nemotron-H where the registry has them, found there by model_type) run the
same way at --wide width over --wide-layers layers, against mlx-lm where mlx-lm has the type;
their table also gives each engine's cache bytes per prompt token (its caches' state after the
prefill) and, for an MLA family, the bytes K and V would take expanded per head.

usage: python scripts/bench_families.py [--layers N] [--hidden N] [--wide N] [--wide-layers N]
       [--rounds N] [--models M ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from family_shapes import expanded_kv_bytes, new_family_configs, write_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT, DECODE = 256, 64
MLXLIS_ONLY = ("qwen4_exp",)  # types mlx-lm does not have

WORKER = r"""
import json, sys, time
sys.path.insert(0, {root!r})
engine, folder = sys.argv[1], sys.argv[2]
import mlxlis
from mlxlis.runtime.device import select_device, setup_process
import mlx.core as mx
from mlx.utils import tree_flatten
setup_process(); select_device()
if engine == "mlxlis":
    net = mlxlis.load(folder, "float32").net
    make_cache = net.make_cache
else:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    net, _ = load_model(__import__("pathlib").Path(folder))
    make_cache = lambda: make_prompt_cache(net)
def step(x, cache):
    out = net(x, cache=cache)
    return out[:, -1, :]
ids = mx.random.randint(0, 1000, (1, {prompt}))
best = (0.0, 0.0)
kv = 0.0
for _ in range(3):
    cache = make_cache()
    t0 = time.perf_counter(); logits = step(ids, cache); mx.eval(logits)
    prefill = {prompt} / (time.perf_counter() - t0)
    held = tree_flatten([c.state for c in cache])  # every cache's arrays after the prefill
    kv = sum(a.nbytes for _, a in held if isinstance(a, mx.array)) / {prompt}
    t0 = time.perf_counter()
    for _ in range({decode}):
        logits = step(logits.argmax(-1).reshape(1, 1), cache); mx.eval(logits)
    best = max(best[0], prefill), max(best[1], {decode} / (time.perf_counter() - t0))
print(json.dumps([*best, kv]))
"""


def raw_configs(layers: int, hidden: int) -> dict[str, dict]:
    s, f = "sliding_attention", "full_attention"
    return {
        "qwen3.5": {
            "model_type": "qwen3_5_text",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
        },
        "llama4": {  # Scout-like: 16 experts, top-1, a shared expert; NoPE every 4th layer
            "model_type": "llama4_text",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": hidden,
            "intermediate_size_mlp": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "num_local_experts": 16,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": 128,  # chunks end inside the prompt and the decode
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "max_position_embeddings": 4096,
        },
        "gpt_oss": {  # 20B-like heads (64 query / 8 KV of 64), 32 experts, top-4, window 128
            "model_type": "gpt_oss",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "max_position_embeddings": 4096,
        },
        "ministral3": {  # Ministral 3 8B-like heads (32 query / 8 KV of 128), YaRN, temperature
            "model_type": "ministral3",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 16.0,
                "original_max_position_embeddings": 16384,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
            "max_position_embeddings": 262144,
        },
        "qwen3_next": {  # 80B-A3B-like heads, 32 experts of which 4 a token, a shared expert
            "model_type": "qwen3_next",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": hidden // 2,
            "shared_expert_intermediate_size": hidden // 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
            "max_position_embeddings": 4096,
        },
        "qwen4_exp": {  # Qwen3-Next's heads plus 4 hyper-connection streams, 16 n-gram heads
            # in two DeltaNet layers (tables cut to ~20k rows a head), a QSA indexer
            "model_type": "qwen4_exp_text",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": hidden // 2,
            "shared_expert_intermediate_size": hidden // 2,
            "hc_count": 4,
            "hc_lowrank": 320,
            "ple_layer_ids": [1, 2],
            "ngram_vocab_size_base": 20000,
            "eos_token_id": 2,
            "indexer_n_heads": 32,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 128,
            "indexer_budget": 128,
            "indexer_compress_ratio": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
            "max_position_embeddings": 4096,
        },
        "smollm3": {  # SmolLM3-3B-like heads (16 query / 4 KV of 128), NoPE every 4th layer
            "model_type": "smollm3",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "max_position_embeddings": 4096,
        },
        "phi4_mini": {  # Phi-4-mini-like: 24 query / 8 KV heads of 128, 3/4 rotated, LongRoPE
            "model_type": "phi3",
            "vocab_size": 32000,
            "hidden_size": 24 * 128,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0] * 48,
                "long_factor": [1.0 + i / 8 for i in range(48)],
                "original_max_position_embeddings": 4096,
            },
        },
        "gemma3n": {  # E2B-like: 4 streams, per-layer inputs, a third KV-shared, sparse gates
            "model_type": "gemma3n_text",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 4 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "sliding_window": 512,
            "layer_types": [f if (i + 1) % 5 == 0 else s for i in range(layers)],
            "num_kv_shared_layers": layers // 3,
            "activation_sparsity_pattern": [
                0.95 if i < layers // 3 else 0.0 for i in range(layers)
            ],
            "hidden_size_per_layer_input": 256,
            "vocab_size_per_layer_input": 32000,
            "laurel_rank": 64,
            "max_position_embeddings": 4096,
        },
        "gemma4": {
            "model_type": "gemma4_text",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "global_head_dim": 512,
            "sliding_window": 512,
            "layer_types": [f if (i + 1) % 4 == 0 else s for i in range(layers)],
            "num_kv_shared_layers": layers // 4,
            "hidden_size_per_layer_input": 256,
            "vocab_size_per_layer_input": 32000,
            "use_double_wide_mlp": True,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "rope_parameters": {
                s: {"rope_type": "default", "rope_theta": 10000.0},
                f: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
            },
            "max_position_embeddings": 4096,
        },
    }


def run(engine: str, folder: Path) -> tuple[float, float, float]:
    code = WORKER.format(root=str(ROOT), prompt=PROMPT, decode=DECODE)
    out = subprocess.run(
        [sys.executable, "-c", code, engine, str(folder)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"{engine} on {folder.name} failed:\n{out.stderr[-2000:]}")
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def mlx_lm_has(model_type: str) -> bool:
    """Whether mlx-lm has a module for config.json's `model_type` (its own remapping applied)."""
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def registered(raw: dict) -> bool:
    sys.path.insert(0, str(ROOT))
    from mlxlis.models import HF_MODEL_TYPES

    return raw["model_type"] in HF_MODEL_TYPES


def bench(shapes: dict[str, dict], rounds: int, tmp: Path, only) -> list[dict]:
    """Each shape written once, each engine run `rounds` times alternating: the best rows."""
    rows = []
    for model, raw in shapes.items():
        if only and model not in only:
            continue
        folder = tmp / model
        write_model(folder, raw)
        engines = ("mlxlis", "mlx-lm") if mlx_lm_has(raw["model_type"]) else ("mlxlis",)
        if model in MLXLIS_ONLY:
            engines = ("mlxlis",)
        best: dict[str, tuple[float, float, float]] = {}
        for _ in range(rounds):  # alternate the engines, best of rounds
            for engine in engines:
                p, d, kv = run(engine, folder)
                old = best.get(engine, (0.0, 0.0, kv))
                best[engine] = (max(old[0], p), max(old[1], d), kv)
        for engine, (p, d, kv) in best.items():
            rows.append(
                {
                    "model": model,
                    "engine": engine,
                    "prefill_tok_s": round(p, 1),
                    "decode_tok_s": round(d, 1),
                    "cache_bytes_per_token": round(kv),
                    "expanded_kv_bytes_per_token": expanded_kv_bytes(raw),
                }
            )
    return rows


def table(rows: list[dict], title: str, kv: bool) -> None:
    """A Markdown table of `rows`, each engine's speeds relative to mlx-lm's on its model."""
    extra = " | cache B/token | expanded K/V B/token" if kv else ""
    print(f"| {title} | engine | prefill tok/s ({PROMPT}) | decode tok/s ({DECODE}){extra} |")
    print("|---|---|---|---" + ("|---|---|" if kv else "|"))
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["engine"] == "mlx-lm"), r)
        p, d = r["prefill_tok_s"], r["decode_tok_s"]
        cells = f"{p} ({p / base['prefill_tok_s']:.2f}×) | {d} ({d / base['decode_tok_s']:.2f}×)"
        if kv:
            expanded = r["expanded_kv_bytes_per_token"]
            cells += f" | {r['cache_bytes_per_token']} | {expanded if expanded else '—'}"
        print(f"| {r['model']} | {r['engine']} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--wide", type=int, default=2048, help="the newer families' hidden size")
    ap.add_argument("--wide-layers", type=int, default=4, help="the newer families' layers")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", nargs="*", help="only these (default: all)")
    args = ap.parse_args()
    newer = {
        k: v for k, v in new_family_configs(args.wide_layers, args.wide).items() if registered(v)
    }
    with tempfile.TemporaryDirectory(prefix="mlxlis-bench-families-") as tmp:
        rows = bench(raw_configs(args.layers, args.hidden), args.rounds, Path(tmp), args.models)
        wide = bench(newer, args.rounds, Path(tmp), args.models)
    if rows:
        table(rows, f"model ({args.layers} layers, hidden {args.hidden}, float32)", False)
    if wide:
        print()
        table(wide, f"model ({args.wide_layers} layers, hidden {args.wide}, float32)", True)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "families.json").write_text(json.dumps(rows + wide, indent=2))


if __name__ == "__main__":
    main()
