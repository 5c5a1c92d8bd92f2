"""Where does loading a GGUF model go? Per-stage wall time, peak memory and weight bytes.

    .venv/bin/python scripts/load_profile.py [NAME|PATH ...] [--dequantize | --quantized]
                                             [--repeat N] [--cprofile]

Each load runs in a fresh process (peak RSS is per process): the stages are read (header,
metadata, config), convert by GGUF type (including undoing conventions), bind (model build,
quantize, bind), tokenizer (built on its own thread while the weights convert: its own time and
the time the loader waited for it) and template. A convert stage includes any wait for MLX to
allocate that tensor's buffers (queued ahead on MLX's own thread). Memory: peak RSS of the
process before and after the load (ru_maxrss), MLX's peak, and the final weight bytes; the goal
is peak RSS ≤ 1.3 × weights + 200 MB. With no NAME, every pulled catalog model.

--decode also measures prompt and decode speed after the load (greedy, 64 tokens after a
~100-token prompt, best of ROUNDS): the figures behind the per-device default in
models/from_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402  (preloads the BLAS before anything imports mlx.core)

MB = 1e6


def _rss_bytes() -> int:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


PROMPT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early "
    "machines were programmed by rewiring; later, stored programs let the same hardware do "
    "many things. Compilers, operating systems and networks followed, each hiding "
) * 3


def decode_tps(model, rounds: int = 3) -> tuple[float, float]:
    """Best (prompt tok/s, decode tok/s) of greedy generation: 64 tokens after 100."""
    ids = model.tokenizer.encode(PROMPT)[:100]
    prompt = decode = 0.0
    for _ in range(rounds):
        stats = list(mlxlis.generate(model, ids, max_tokens=64, stop_ids=set()))[-1].stats
        prompt, decode = max(prompt, stats.prompt_tps), max(decode, stats.decode_tps)
    return prompt, decode


def child(name: str, dequantize: bool | None, cprofile: bool, decode: int) -> dict:
    """Runs in the fresh process: one load, measured."""
    import mlxlis.prompt.template  # noqa: F401  (imports belong to the baseline, not the load)
    import mlxlis.tokenizer  # noqa: F401
    from mlxlis.loading.resolve import resolve
    from mlxlis.models.from_gguf import load_gguf
    from mlxlis.runtime.device import resolve_dtype

    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = resolve(name)
    if path.suffix.lower() != ".gguf":
        raise SystemExit(f"{path}: not a GGUF file")
    base_rss = _rss_bytes()
    mx.reset_peak_memory()
    timings: dict[str, float] = {}
    prof = None
    if cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    cpu0, t0 = time.process_time(), time.perf_counter()
    model = load_gguf(path, resolve_dtype(None), dequantize=dequantize, timings=timings)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    weights = sum(v.nbytes for _, v in tree_flatten(model.net.parameters()))
    out = {
        "name": name,
        "wall": wall,
        "cpu": cpu,
        "timings": timings,
        "base_rss": base_rss,
        "peak_rss": _rss_bytes(),
        "mx_peak": mx.get_peak_memory(),
        "weights": weights,
        "quant": model.quant_summary,
    }
    if decode:
        out["prompt_tps"], out["decode_tps"] = decode_tps(model, decode)
    return out


def report(r: dict) -> None:
    t = r["timings"]
    print(
        f"\n{r['name']}: {r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU (all threads)  [{r['quant']}]"
    )
    for stage, sec in t.items():
        print(f"  {stage:<24} {sec:6.3f} s")
    goal = 1.3 * r["weights"] + 200 * MB
    print(
        f"  weights {r['weights'] / MB:.0f} MB; peak RSS {r['peak_rss'] / MB:.0f} MB "
        f"(before load {r['base_rss'] / MB:.0f} MB), MLX peak {r['mx_peak'] / MB:.0f} MB; "
        f"goal ≤ {goal / MB:.0f} MB: {'ok' if r['peak_rss'] <= goal else 'OVER'}"
    )
    if "decode_tps" in r:
        print(
            f"  prompt {r['prompt_tps']:.1f} tok/s, decode {r['decode_tps']:.1f} tok/s "
            "(greedy, 64 tokens after 100)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="catalog names or .gguf paths")
    p.add_argument("--dequantize", action="store_true", default=None, help="load dense")
    p.add_argument(
        "--quantized",
        dest="dequantize",
        action="store_false",
        help="load quantized even where the device default is dense",
    )
    p.add_argument("--repeat", type=int, default=1, help="loads per model; the fastest is shown")
    p.add_argument("--cprofile", action="store_true", help="cProfile top 20 on stderr")
    p.add_argument(
        "--decode",
        type=int,
        nargs="?",
        const=3,
        default=0,
        metavar="ROUNDS",
        help="also measure decode tok/s (best of ROUNDS generations, default 3)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.names[0], a.dequantize, a.cprofile, a.decode)))
        return 0
    names = a.names
    if not names:
        from mlxlis.loading import catalog

        names = [n for n in catalog.CATALOG if catalog.is_pulled(n)]
    flags = [] if a.dequantize is None else ["--dequantize" if a.dequantize else "--quantized"]
    flags += ["--cprofile"] if a.cprofile else []
    flags += [f"--decode={a.decode}"] if a.decode else []
    for name in names:
        runs = []
        for _ in range(a.repeat):
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, *flags],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = min(runs, key=lambda r: r["wall"])
        if a.decode:
            best["decode_tps"] = max(r["decode_tps"] for r in runs)
            best["prompt_tps"] = max(r["prompt_tps"] for r in runs)
        report(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
