"""Where a decoded token's time goes on the CPU, per catalog model (docs/performance.md,
"What a step costs"): the step as the generation core runs it (the next step's graph built
while this one evaluates), then apart: Python building a step's graph, MLX evaluating it, the
quantized products alone (the step's own weights and shapes, every thread and one), the rest of
the nodes, the graph's nodes by kind, and the kernels' thread pool per token (how often a
worker joined a product, how long the caller waited for one that was preempted).

usage: python scripts/profile_decode.py [--models NAME ...] [--context N] [--steps N]
Run it on a quiet machine: every figure is a best of several rounds in one process.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)
from mlxlis.generation.generate import generate  # noqa: E402
from mlxlis.generation.steps import StepKind, forward, prefill  # noqa: E402
from mlxlis.loading import catalog  # noqa: E402
from mlxlis.runtime import kernels  # noqa: E402

import mlx.core as mx  # noqa: E402
from bench import cpu_name, prompt_ids  # noqa: E402


def best_of(rounds: int, fn) -> float:
    best = float("inf")
    for _ in range(rounds):
        best = min(best, fn())
    return best


def core_step_ms(model, ids: list[int], steps: int) -> float:
    """A decoded token as the generation core gives it (pipelined), ms."""
    cache = model.make_cache()
    mx.eval(prefill(model.net, ids[:-1], cache))
    count, t0 = 0, 0.0
    events = generate(
        model, ids[-1:], max_tokens=steps, stop_ids=set(), cache=cache, history=ids[:-1]
    )
    for e in events:
        if e.token is None:
            continue
        count += 1
        if count == 1:
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / (count - 1) * 1e3


def profile(name: str, context: int, steps: int) -> dict:
    mod = kernels.load()
    path = catalog.model_path(name)
    ids = (prompt_ids(path) * (context // 64 + 2))[: context + 1]
    model = mlxlis.load(path)
    net = model.net
    out = {"model": name}
    s0 = mod.pool_stats()
    out["core_ms"] = min(core_step_ms(model, ids, steps) for _ in range(3))
    s1 = mod.pool_stats()
    tokens = 3 * (steps - 1)  # the pool's figures over all three rounds (prefill included)
    out["pool"] = {k: (s1[k] - s0[k]) / tokens for k in s1}

    cache = model.make_cache()
    mx.eval(prefill(net, ids[:-1], cache))
    tok = mx.array(ids[-1:], mx.int32)
    calls: list[tuple] = []  # (x's shape, w, scales, biases, group, bits, supers) a product
    real, real_many = kernels.matmul, mod.qmv_many

    def record(x, w, scales, biases, group, bits, mode="affine", supers=None):
        calls.append((x.shape, w, scales, biases, group, bits, supers))
        return real(x, w, scales, biases, group, bits, mode, supers)

    def record_many(x, *columns):  # a layer's q/k/v or gate/up as one node (products())
        calls.append((x.shape, *columns))
        return real_many(x, *columns)

    def step(record_products: bool = False):
        if record_products:
            kernels.matmul, mod.qmv_many = record, record_many
        try:
            return forward(net, [cache], tok, StepKind.DECODE)
        finally:
            kernels.matmul, mod.qmv_many = real, real_many

    builds, evals = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        logits = step(record_products=i == 0)
        nxt = logits.argmax(-1).astype(mx.int32)
        t1 = time.perf_counter()
        mx.eval(nxt)
        builds.append(t1 - t0)
        evals.append(time.perf_counter() - t1)
        tok = nxt
    out["build_ms"] = sorted(builds)[len(builds) // 2] * 1e3
    out["eval_ms"] = sorted(evals)[len(evals) // 2] * 1e3

    with tempfile.TemporaryDirectory() as d:
        dot = Path(d) / "step.dot"
        mx.export_to_dot(str(dot), step(), *[c.state for c in cache])
        kinds = collections.Counter(re.findall(r'label ="([A-Za-z_]+)', dot.read_text()))
    out["nodes"] = sum(kinds.values())
    out["node_kinds"] = dict(kinds.most_common())

    out["product_nodes"] = len(calls)
    xs = [mx.random.normal(c[0]) for c in calls]
    mx.eval(xs)
    out["products"] = sum(len(c[1]) if isinstance(c[1], list) else 1 for c in calls)
    held = []  # w, scales, biases, supers of every product
    for c in calls:
        for col in (c[1], c[2], c[3], c[6]):
            held += [a for a in (col if isinstance(col, list) else [col]) if a is not None]
    out["product_mib"] = sum(a.nbytes for a in held) / 2**20

    def node(x: mx.array, c: tuple):
        if isinstance(c[1], list):
            return real_many(x, *c[1:])
        return real(x, c[1], c[2], c[3], c[4], c[5], "affine", c[6])

    def products() -> float:
        ys = [node(x, c) for x, c in zip(xs, calls, strict=True)]
        t = time.perf_counter()
        mx.eval(ys)
        return time.perf_counter() - t

    out["products_ms"] = best_of(7, products) * 1e3
    threads = mod.num_threads()
    mod.set_num_threads(1)
    out["products_1thread_ms"] = best_of(7, products) * 1e3
    mod.set_num_threads(threads)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pulled = [  # the decoders' GGUF files (not the embedding model's folder)
        n for n in catalog.CATALOG if catalog.is_pulled(n) and catalog.model_path(n).is_file()
    ]
    ap.add_argument("--models", nargs="*", default=pulled)
    ap.add_argument("--context", type=int, default=512, help="tokens in the cache before decoding")
    ap.add_argument("--steps", type=int, default=64, help="tokens decoded a round")
    a = ap.parse_args()
    mlxlis.runtime.device.setup_process()  # as the mlxlis commands do
    print(f"cpu: {cpu_name()}; kernels: {kernels.describe(build=True)}\n")
    print(
        "| model | step (core) ms | Python graph ms | eval ms | products ms (1 thread) | GB/s "
        "| rest of eval ms | nodes (product nodes) "
        "| pool a token: runs / joined / caller's wait µs / run alone |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.models:
        r = profile(name, a.context, a.steps)
        gbs = r["product_mib"] * 2**20 / (r["products_ms"] / 1e3) / 1e9
        p = r["pool"]
        print(
            f"| {name} | {r['core_ms']:.2f} | {r['build_ms']:.2f} | {r['eval_ms']:.2f} | "
            f"{r['products_ms']:.2f} ({r['products_1thread_ms']:.2f}) | {gbs:.1f} | "
            f"{r['eval_ms'] - r['products_ms']:.2f} | {r['nodes']} ({r['product_nodes']}) | "
            f"{p['runs']:.0f} / {p['joined']:.0f} / {p['wait_ns'] / 1e3:.0f} / {p['alone']:.0f} |",
            flush=True,
        )
        print(f"<!-- {name} nodes: {r['node_kinds']} -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
