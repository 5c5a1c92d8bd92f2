"""`make bench`: GGUF decoding on the CPU with the blocks kept quantized (mlxlis's kernels,
mlxlis/runtime/kernels), made dense in float32 (`--dequantize`, the old default) and llama.cpp
(when `llama_cpp` is installed), on the catalog models and the 1.5B when pulled.

Each measurement in a fresh process (scripts/bench_worker.py: load, a PROMPT-token prefill,
DECODE greedy tokens; peak RSS), engines alternating, best of --rounds (decode and prefill each
their own best); one row and 8 rows decoding together (mlxlis's batched step; llama.cpp: one
row only). Prints a Markdown table and writes bench-results/qmv.json.

usage: python scripts/bench_qmv.py [--models NAME ...] [--rounds N] [--prompt N] [--decode N]
                                   [--rows N ...]
(`--prompt 512 --decode 16 --rows 1`: long prompts' prefill, where sgemm does best)

`--steady [--prompts N ...] [--isa avx2 ...]`: side by side in the steady state instead, one
process per engine and model (scripts/bench_steady.py: the model loaded once, then rounds of
a prefill into a fresh cache and DECODE greedy tokens; best of --rounds, the first prefill of
the process apart), mlxlis on each kernel ISA asked for (default: the CPU's best) beside
llama.cpp; the CPU's model and vector extensions printed. Writes bench-results/qmv_steady.json.
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

from mlxlis.loading import catalog  # noqa: E402
from mlxlis.runtime import kernels  # noqa: E402

from bench import cpu_name, prompt_ids, run  # noqa: E402

PROMPT, DECODE = 64, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pulled = [  # the decoders' GGUF files (not the embedding model's folder)
        n for n in catalog.CATALOG if catalog.is_pulled(n) and catalog.model_path(n).is_file()
    ]
    ap.add_argument("--models", nargs="*", default=pulled)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens (at most 512)")
    ap.add_argument("--decode", type=int, default=DECODE, help="greedy tokens (8 rows: a 4th)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows decoding together")
    ap.add_argument("--steady", action="store_true", help="side by side, models loaded once")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512], help="--steady: prefills")
    ap.add_argument("--isa", nargs="+", default=[""], help="--steady: mlxlis kernel ISAs")
    a = ap.parse_args()
    if a.steady:
        return steady(a)
    try:
        import llama_cpp  # noqa: F401

        llama = True
    except ImportError:
        llama = False
    print("kernels:", kernels.describe(build=True), flush=True)
    rows = []
    for name in a.models:
        gguf = catalog.model_path(name)
        ids = prompt_ids(gguf)[: a.prompt]
        if len(ids) < a.prompt:
            ap.error(f"--prompt {a.prompt}: the benchmark's text is {len(ids)} tokens for {name}")
        runs = [(e, b) for b in a.rows for e in ("mlxlis", "mlxlis-dense")]
        runs += [("llama.cpp", 1)] if llama and 1 in a.rows else []
        best: dict[tuple[str, int], dict] = {}
        for _ in range(a.rounds):
            for engine, b in runs:
                r = run(engine, gguf, ids, a.decode if b == 1 else max(1, a.decode // 4), b)
                old = best.get((engine, b))
                if old is not None and "error" in old:  # a failed run is what the row shows
                    pass
                elif "error" in r or old is None:
                    best[(engine, b)] = r
                else:  # decode and prefill each their own best
                    best[(engine, b)] = r if r["decode_tps"] > old["decode_tps"] else old
                    best[(engine, b)]["prefill_tps"] = max(r["prefill_tps"], old["prefill_tps"])
                print(f"  {name} {engine} ×{b}: {r}", flush=True)
        for (engine, b), r in best.items():
            rows.append({"model": name, "engine": engine, "rows": b, **r})
    size = {n: os.path.getsize(catalog.model_path(n)) for n in a.models}
    print("\n| model | engine | rows | decode tok/s | prefill tok/s | peak RSS MiB (× file) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['engine']} | {r['rows']} | error: {r['error']} |||")
            continue
        peak = r["peak_rss"] / 2**20
        print(
            f"| {r['model']} | {r['engine']} | {r['rows']} | {r['decode_tps']:.1f} | "
            f"{r['prefill_tps']:.1f} | {peak:.0f} ({r['peak_rss'] / size[r['model']]:.2f}×) |"
        )
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "qmv.json").write_text(json.dumps(rows, indent=1))
    return 0


def cpu_isa() -> str:
    """The vector extensions the kernels care about, as /proc/cpuinfo lists them."""
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "unknown"
    want = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi")
    return " ".join(f for f in want if f in flags)


def steady_run(engine: str, gguf: Path, ids: list[int], n: int, a, isa: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    env = dict(os.environ, **({"QMV_ISA": isa} if isa else {}))
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_steady.py"), engine, str(gguf), f.name]
    try:
        res = subprocess.run(
            [*cmd, str(n), str(a.decode), str(a.rounds)],
            capture_output=True,
            text=True,
            timeout=3600,
            env=env,
        )
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def steady(a) -> int:
    print(f"cpu: {cpu_name()} ({os.cpu_count()} CPUs; {cpu_isa()})", flush=True)
    print("kernels:", kernels.describe(build=True), flush=True)
    rows = []
    for name in a.models:
        gguf = catalog.model_path(name)
        text = prompt_ids(gguf)
        for n in a.prompts:
            ids = (text * (n // len(text) + 2))[: n + 1]  # the text repeated to n tokens
            ref = steady_run("llama.cpp", gguf, ids, n, a, "")
            for isa in a.isa:
                got = steady_run("mlxlis", gguf, ids, n, a, isa)
                rows.append(
                    {
                        "model": name,
                        "prompt": n,
                        "isa": isa or "best",
                        "mlxlis": got,
                        "llama.cpp": ref,
                    }
                )
                print(f"  {name} {n} {isa or 'best'}: {got} | llama.cpp {ref}", flush=True)
    print(
        "\n| model | prompt | kernels | decode tok/s mlxlis / llama.cpp | ratio "
        "| prefill tok/s | ratio | first prefill of a process |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, ll = r["mlxlis"], r["llama.cpp"]
        if "error" in m or "error" in ll:
            why = m.get("error") or ll.get("error")
            print(f"| {r['model']} | {r['prompt']} | {r['isa']} | error: {why} |||||")
            continue
        print(
            f"| {r['model']} | {r['prompt']} | {r['isa']} | {m['decode_tps']:.1f} / "
            f"{ll['decode_tps']:.1f} | {m['decode_tps'] / ll['decode_tps']:.2f}× | "
            f"{m['prefill_tps']:.0f} / {ll['prefill_tps']:.0f} | "
            f"{m['prefill_tps'] / ll['prefill_tps']:.2f}× | "
            f"{m['first_prefill_tps']:.0f} / {ll['first_prefill_tps']:.0f} |"
        )
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "qmv_steady.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
