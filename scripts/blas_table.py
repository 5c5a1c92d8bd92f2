"""Prefill and decode of each catalog model under each BLAS MLX's Linux CPU backend can use.

usage: python scripts/blas_table.py [--models NAME ...] [--prompt N] [--decode N] [--rounds R]

Each cell is the best of R fresh `bench_worker.py mlxlis` processes with MLXLIS_BLAS set to
wheel (scipy-openblas32, routed by the dispatch), system (apt's libopenblas0) or bundled (MLX's
own reference BLAS). Prints a Markdown table (docs/performance.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mlxlis.loading import catalog  # noqa: E402

KINDS = ("wheel", "system", "bundled")


def worker(kind: str, path: Path, ids_file: str, n_decode: int) -> dict:
    env = {**os.environ, "MLXLIS_BLAS": kind}
    probe = subprocess.run(
        [sys.executable, "-c", "import mlxlis.runtime.blas as b; print(b.state.name)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    name = probe.stdout.strip()
    if kind != "bundled" and "bundled" in name:
        return {"blas": name, "error": "not available here"}
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_worker.py"),
        "mlxlis",
        str(path),
        ids_file,
        str(n_decode),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        return {"blas": name, "error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"blas": name, **json.loads(res.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=catalog.default_names())
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from bench import prompt_ids  # noqa: E402

    print("| model | BLAS | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|")
    for name in a.models:
        path = catalog.model_path(name)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompt_ids(path)[: a.prompt], f)
        try:
            for kind in KINDS:
                runs = [worker(kind, path, f.name, a.decode) for _ in range(a.rounds)]
                ok = [r for r in runs if "error" not in r]
                if not ok:
                    print(f"| {name} | {runs[0]['blas']} | {runs[0]['error']} | |", flush=True)
                    continue
                pre = max(r["prefill_tps"] for r in ok)
                dec = max(r["decode_tps"] for r in ok)
                print(f"| {name} | {ok[0]['blas']} | {pre:.0f} | {dec:.1f} |", flush=True)
        finally:
            os.unlink(f.name)


if __name__ == "__main__":
    main()
