"""`make bench` (batched decoding part): what one step of B sequences decoding together costs.

For each catalog model (float32): B sequences of ~100-token prompts, each with its own caches,
take decoding steps together (`net.decode_batch`, the serving engine's step; B = 1 is a lone
step) — once with the BLAS dispatch's batch kernel and once with those products left to sgemm
(`MLXLIS_BLAS_SKINNY=0`), each in a fresh process. Prints ms a step and tokens/s (B / step),
best of 4 rounds of 5 steps; writes bench-results/batch.json.

usage: python scripts/bench_batch.py [--models NAME ...] [--batches 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "The history of computing is long and varied, with many turns and returns. " * 12


def measure(name: str, batches: list[int]) -> dict[int, float]:
    """Seconds a step for each batch size (in this process)."""
    import mlxlis
    from mlxlis.generation.steps import prefill

    import mlx.core as mx

    model = mlxlis.load(name, "float32")
    ids = model.tokenizer.encode(TEXT)[:120]
    out = {}
    for b in batches:
        caches = []
        for i in range(b):  # prompts of different lengths: rows padded as in serving
            cache = model.make_cache()
            mx.eval(prefill(model.net, ids[: 96 + i], cache))
            caches.append(cache)
        tokens = [ids[5 + i] for i in range(b)]

        def step(b=b, tokens=tokens, caches=caches):
            if b == 1:
                mx.eval(model.net(mx.array([tokens]), cache=caches[0], last_only=True))
            else:
                mx.eval(model.net.decode_batch(mx.array(tokens), caches))

        for _ in range(2):
            step()
        best = float("inf")
        for _ in range(4):
            t = time.perf_counter()
            for _ in range(5):
                step()
            best = min(best, (time.perf_counter() - t) / 5)
        out[b] = best
    return out


def main() -> int:
    from mlxlis.loading import catalog

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=catalog.default_names())
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # one model, one setting: print the timings as JSON
        print(json.dumps(measure(args.worker[0], args.batches)))
        return 0
    rows = []
    print("| model | products of 2-16 rows | " + " | ".join(f"B={b}" for b in args.batches) + " |")
    print("|---|---|" + "---|" * len(args.batches))
    for name in args.models:
        if not catalog.is_pulled(name):
            print(f"{name}: not pulled (make models)", file=sys.stderr)
            continue
        for kernel in ("1", "0"):
            env = {**os.environ, "MLXLIS_BLAS_SKINNY": kernel}
            res = subprocess.run(
                [sys.executable, __file__, "--worker", name, "--batches", *map(str, args.batches)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            times = {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}
            label = "batch kernel" if kernel == "1" else "sgemm"
            cells = [f"{t * 1e3:.0f} ms ({b / t:.1f} tok/s)" for b, t in sorted(times.items())]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)
            rows.append({"model": name, "products": label, "step_s": times})
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "batch.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
