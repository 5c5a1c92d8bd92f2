"""`make bench` (MoE part): a mixture of experts decodes at the speed of its active parameters.

Three random float32 networks on the shared decoder, equal attention, built in this process:
  moe           32 experts, top-2, expert width 512 (the Qwen3-MoE block)
  dense-active  a dense SwiGLU as wide as the two active experts together (1024)
  dense-total   a dense SwiGLU holding as many MLP weights as all 32 experts (16384)
Decode should track dense-active, not dense-total: the experts run through mx.gather_mm,
which reads only the selected experts' matrices. Prints a Markdown table, writes
bench-results/moe.json.

usage: python scripts/bench_moe.py [--layers N] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402,F401  (importing mlxlis preloads the BLAS first)
from mlxlis.models import build_model  # noqa: E402
from mlxlis.models.config import (  # noqa: E402
    AttentionConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RopeConfig,
)
from mlxlis.runtime.device import select_device, setup_process  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH = 1024, 32, 2, 512
PROMPT, DECODE = 128, 64


def config(kind: str, layers: int) -> ModelConfig:
    common = dict(
        vocab_size=4096,
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        rope=RopeConfig(theta=1e6),
        norms=NormConfig(1e-6),
        attention=AttentionConfig(qk_norm=True),
        max_position_embeddings=4096,
    )
    if kind == "moe":
        return ModelConfig(
            family="qwen3_moe",
            mlp=MLPConfig(TOP_K * EXPERT_WIDTH),
            moe=MoEConfig(EXPERTS, TOP_K, EXPERT_WIDTH, (True,) * layers, norm_topk_prob=True),
            **common,
        )
    width = TOP_K * EXPERT_WIDTH if kind == "dense-active" else EXPERTS * EXPERT_WIDTH
    return ModelConfig(family="qwen3", mlp=MLPConfig(width), **common)


def build(kind: str, layers: int):
    net = build_model(config(kind, layers))
    mx.random.seed(0)
    net.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, net.parameters()))
    mx.eval(net.parameters())
    params = sum(p.size for _, p in tree_flatten(net.parameters()))
    return net, params


def measure(net) -> tuple[float, float]:
    """(prefill tok/s over PROMPT tokens, decode tok/s over DECODE greedy tokens)."""
    ids = mx.random.randint(0, 4096, (1, PROMPT))
    cache = net.make_cache()
    t0 = time.perf_counter()
    logits = net(ids, cache=cache, last_only=True)
    mx.eval(logits)
    prefill = PROMPT / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(DECODE):
        logits = net(logits.argmax(-1).reshape(1, 1), cache=cache, last_only=True)
        mx.eval(logits)
    return prefill, DECODE / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    setup_process()
    select_device()
    rows = []
    for kind in ("moe", "dense-active", "dense-total"):
        net, params = build(kind, args.layers)
        measure(net)  # warm-up: compiled kernels, allocator
        best = [max(x) for x in zip(*(measure(net) for _ in range(args.rounds)), strict=True)]
        rows.append(
            {
                "model": kind,
                "params": params,
                "prefill_tok_s": round(best[0], 1),
                "decode_tok_s": round(best[1], 1),
            }
        )
        del net
    print(
        f"| model ({args.layers} layers, hidden {HIDDEN}) | params | prefill tok/s "
        f"({PROMPT}) | decode tok/s ({DECODE}) |"
    )
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.0f} M | {r['prefill_tok_s']} | "
            f"{r['decode_tok_s']} |"
        )
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "moe.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
