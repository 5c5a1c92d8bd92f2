"""`make bench`: mlxlis vs mlx-lm (and llama.cpp when installed) on each catalog model.

Engines run alternately, each measurement in a fresh process, best of `--rounds`. mlx-lm cannot
read GGUF, so it gets Hugging Face-layout safetensors copies of the same weights written by
`mlxlis convert --dequantize`: float16 (as such checkpoints ship) and the dtype mlxlis uses on
this device. Prints a Markdown table with ratios and writes JSON to bench-results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402, F401  (importing mlxlis preloads the BLAS first)
from mlxlis.loading import catalog  # noqa: E402
from mlxlis.runtime.blas import state as blas_state  # noqa: E402
from mlxlis.runtime.device import default_dtype_name, device_name  # noqa: E402

PROMPT_TOKENS = 512
DECODE_TOKENS = 128
TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. "
    "Early machines were programmed by rewiring; later, stored programs let the same "
    "hardware do many things. Compilers, operating systems and networks followed. "
) * 40


def memory_bandwidth_gbs() -> float:
    """Read bandwidth with every core: one thread per core sums its slice of a 1 GiB float32
    array (numpy releases the GIL), best of 3, in GB/s. One thread alone reaches about half."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(256 * 2**20, np.float32)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    best = float("inf")
    with ThreadPoolExecutor(n) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def prompt_ids(gguf: Path) -> list[int]:
    """The prompt, tokenised by the file's own tokenizer. Only the tokenizer is built here:
    weights loaded in this process would take memory from every measured one (a 2 GB model held
    here made a worker's load 2.5x slower)."""
    from mlxlis.loading.gguf_split import read_gguf
    from mlxlis.tokenizer import Tokenizer

    with read_gguf(gguf) as gf:
        tok = Tokenizer.from_gguf(gf.metadata, gguf)
    return tok.encode(TEXT)[:PROMPT_TOKENS]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hf_copy(name: str, dtype: str, root: Path) -> Path:
    """`mlxlis convert --dequantize` in a child process (kept out of this one's memory)."""
    out = root / f"{name}-{dtype}"
    if not (out / "config.json").is_file():
        cmd = [
            sys.executable,
            "-m",
            "mlxlis",
            "convert",
            str(catalog.model_path(name)),
            "-o",
            str(out),
            "--dtype",
            dtype,
            "--dequantize",
            "--force",
        ]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def run(engine: str, path: Path, ids: list[int], n_decode: int, rows: int = 1) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_worker.py"),
        engine,
        str(path),
        f.name,
        str(n_decode),
        str(rows),
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def best(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    pick = {}
    for key in ("load_s", "ttft_s", "load_peak_rss", "peak_rss", "bytes_per_token"):
        pick[key] = min(r[key] for r in ok)
    for key in ("decode_tps", "prefill_tps"):
        pick[key] = max(r[key] for r in ok)
    return pick


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="*", default=catalog.default_names())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", default=str(catalog.store_dir().parent / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    a = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
    import mlx.core as mx

    dev_dtype = default_dtype_name()
    machine = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "blas": blas_state.name,
        "device": device_name(),
        "mlx": mx.__version__,
        "mlxlis_dtype": dev_dtype,
        "bandwidth_gbs": round(memory_bandwidth_gbs(), 1),
    }
    print("machine:", json.dumps(machine), flush=True)
    rows = []
    cache = Path(a.cache)
    for name in a.models:
        gguf = catalog.pull(name)
        text_ids = prompt_ids(gguf)
        # (engine, path, prompt ids, decode tokens, rounds). CPU float16 matmuls are
        # emulated (~30x slower): that run gets a 64-token prompt, 32 tokens and one round.
        slow16 = dev_dtype != "float16"
        short = (text_ids[:64], 32, 1) if slow16 else (text_ids, DECODE_TOKENS, a.rounds)
        full = (text_ids, DECODE_TOKENS, a.rounds)
        engines = {
            "mlxlis (GGUF)": ("mlxlis", gguf, *full),
            "mlx-lm (fp16 copy)": ("mlx-lm", hf_copy(name, "float16", cache), *short),
        }
        if dev_dtype != "float16":
            copy = hf_copy(name, dev_dtype, cache)
            engines[f"mlx-lm ({dev_dtype} copy)"] = ("mlx-lm", copy, *full)
            engines[f"mlxlis ({dev_dtype} copy)"] = ("mlxlis", copy, *full)
        if have_llama:
            engines["llama.cpp (GGUF)"] = ("llama.cpp", gguf, *full)
        # unmeasured: MLX compiles mlxlis's CPU kernels once per machine (cached after; ~4 s),
        # a one-time cost that a --rounds 1 run would otherwise charge to one measurement
        run("mlxlis", gguf, text_ids[:16], 2)
        results: dict[str, list[dict]] = {k: [] for k in engines}
        for r in range(a.rounds):  # alternate engines within each round
            for label, (engine, path, ids, n_decode, rounds) in engines.items():
                if r >= rounds:
                    continue
                results[label].append(run(engine, path, ids, n_decode))
                print(f"  {name} {label}: {results[label][-1]}", flush=True)
        for label in engines:
            _, _, ids, n_decode, _ = engines[label]
            rows.append(
                {
                    "model": name,
                    "engine": label,
                    "prompt": len(ids),
                    "decode": n_decode,
                    **best(results[label]),
                }
            )
    print_table(rows, machine)
    out = Path(a.out)
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"bench-{stamp}.json").write_text(
        json.dumps({"machine": machine, "rows": rows}, indent=1)
    )
    return 0


def print_table(rows: list[dict], machine: dict) -> None:
    """Markdown table. Ratios: decode vs mlx-lm on the float16 copy (out of the box), and
    decode / prefill / load time / load memory vs mlx-lm on the copy in mlxlis's dtype (the
    same weights and dtype; > 1 is better for mlxlis in every column)."""
    bw = machine["bandwidth_gbs"] * 1e9
    same = f"mlx-lm ({machine['mlxlis_dtype']} copy)"
    if machine["mlxlis_dtype"] == "float16":
        same = "mlx-lm (fp16 copy)"
    print(
        "\n| model | engine | prompt/decode | load s | load peak MiB | TTFT s | prefill tok/s "
        "| decode tok/s | decode vs mlx-lm fp16 | vs mlx-lm same dtype: decode / prefill / "
        "load s / load MiB | of decode limit | peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def find(model: str, engine: str) -> dict | None:
        return next(
            (x for x in rows if x["model"] == model and x["engine"] == engine and "error" not in x),
            None,
        )

    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['engine']} | error: {r['error']} ||||||||||")
            continue
        fp16, ref = find(r["model"], "mlx-lm (fp16 copy)"), find(r["model"], same)
        vs16 = f"{r['decode_tps'] / fp16['decode_tps']:.2f}×" if fp16 else "–"
        vs = "–"
        if ref and r["engine"].startswith("mlxlis"):
            vs = (
                f"{r['decode_tps'] / ref['decode_tps']:.2f}× / "
                f"{r['prefill_tps'] / ref['prefill_tps']:.2f}× / "
                f"{ref['load_s'] / r['load_s']:.2f}× / "
                f"{ref['load_peak_rss'] / r['load_peak_rss']:.2f}×"
            )
        limit = bw / r["bytes_per_token"]
        print(
            f"| {r['model']} | {r['engine']} | {r['prompt']}/{r['decode']} | "
            f"{r['load_s']:.2f} | {r['load_peak_rss'] / 2**20:.0f} | {r['ttft_s']:.2f} | "
            f"{r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | {vs16} | {vs} | "
            f"{r['decode_tps'] / limit:.0%} of {limit:.0f} | {r['peak_rss'] / 2**20:.0f} |"
        )
    for model in dict.fromkeys(r["model"] for r in rows):
        ours, lc = find(model, "mlxlis (GGUF)"), find(model, "llama.cpp (GGUF)")
        if ours and lc:
            print(
                f"\n{model}: mlxlis ÷ llama.cpp on the same GGUF — decode "
                f"{ours['decode_tps'] / lc['decode_tps']:.2f}×, prefill "
                f"{ours['prefill_tps'] / lc['prefill_tps']:.2f}×, load "
                f"{lc['load_s'] / ours['load_s']:.2f}× (> 1: mlxlis faster)",
                end="",
            )
    print(
        "\n\ndecode limit = measured read bandwidth (every core) ÷ bytes of that engine's weights "
        "read per token. Same-dtype ratios are mlxlis ÷ mlx-lm for speeds and mlx-lm ÷ mlxlis "
        "for load time and memory (> 1: mlxlis better).\nmlx-lm runs on the same system BLAS "
        "as mlxlis (faster than its bundled one) but without mlxlis's own CPU kernels (gemv "
        "dispatch, fastmath) and allocator setting."
    )


if __name__ == "__main__":
    raise SystemExit(main())
