"""`make bench` (pipeline): one model pipelined over 1, 2 and 3 ranks of one machine (mlx.launch,
ring backend over loopback). On one machine this measures the overhead of splitting, never a
speed-up: the ranks share its cores and memory bandwidth.

For each rank count, in a fresh launch (best of --rounds):
  prefill   PROMPT tokens through `generate`'s prefill, in 512-token chunks (a lone process's)
            and in 128-token chunks (more overlap between ranks), tokens/s;
  decode    DECODE greedy tokens with `mlxlis.generate`, tokens/s after the first;
  step      an instrumented decode step: each rank's compute (its layers, evaluated alone) and
            the rest of the step's wall time, spent passing hidden states and the token
            between ranks (waiting included);
  bytes     bytes passed between ranks per token: hidden_size × residual dtype size per hop,
            plus the 8-byte (token, stop flag) all_sum.
Prints a Markdown table with what a Thunderbolt link would add per token, and writes
bench-results/pipeline.json. With fewer cores than ranks the compute column grows too: a rank
waiting for its input polls its sockets (MLX's ring backend; about half a core here) on the
cores the computing rank needs.

usage: python scripts/bench_pipeline.py [--model NAME] [--ranks 1,2,3] [--rounds N]
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
PROMPT, DECODE, STEPS = 512, 32, 16
# Thunderbolt links between Macs (ring backend over IP): usable bandwidth and a round trip
LINKS = {"Thunderbolt 4 (~2.5 GB/s, ~50 µs)": (2.5e9, 50e-6),
         "Thunderbolt 5 (~5 GB/s, ~30 µs)": (5e9, 30e-6)}  # fmt: skip


def rank_main(model: str, rounds: int) -> None:
    """One rank of a launch (or the lone process): measure, rank 0 prints one JSON line."""
    import mlxlis  # noqa: F401  (chooses the BLAS before mlx.core loads)
    from mlxlis.device import setup_process
    from mlxlis.generate import generate, prefill

    import mlx.core as mx

    setup_process()
    m = mlxlis.load(model, "float32")
    net = m.net
    pipe = getattr(net, "is_pipeline", False)
    ids = (m.tokenizer.encode("The history of the river and the mill. " * 80))[:PROMPT]
    out: dict = {"ranks": net.ranks.size if pipe else 1}

    def sync(x) -> None:  # every rank finished x (a lone process: just evaluated)
        mx.eval(x)
        if pipe:
            net.ranks.barrier()

    for step in (512, 128):
        best = 0.0
        for _ in range(rounds):
            cache = m.make_cache()
            sync([])
            t0 = time.perf_counter()
            last = prefill(net, ids, cache, step)
            y = net.share(None if not net.is_last else mx.argmax(last, -1), after=last) \
                if pipe else last
            sync(y)
            best = max(best, len(ids) / (time.perf_counter() - t0))
        out[f"prefill_{step}"] = best
    best = 0.0
    for _ in range(rounds):
        final = None
        for final in generate(m, ids[:16], max_tokens=DECODE, temperature=0.0):  # noqa: B007
            pass
        best = max(best, final.stats.decode_tps)
    out["decode"] = best
    out.update(_step_times(m, net, pipe))
    if pipe:
        out["bytes_per_token"] = net.hidden_bytes_per_token() * (net.ranks.size - 1) + 8
    if not pipe or net.ranks.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _step_times(m, net, pipe: bool) -> dict:
    """Mean decode step wall time and the compute of every rank in it (each rank evaluates its
    received input first, then its layers alone, then passes them on)."""
    from mlxlis.generate import prefill

    import mlx.core as mx

    cache = m.make_cache()
    last = prefill(net, m.tokenizer.encode("Once upon a time"), cache)
    if not pipe:
        t0, token = time.perf_counter(), mx.argmax(last, -1)
        for _ in range(STEPS):
            token = mx.argmax(net(token.reshape(1, 1), cache=cache, last_only=True)[:, -1], -1)
            mx.eval(token)
        wall = (time.perf_counter() - t0) / STEPS
        return {"step_ms": wall * 1e3, "compute_ms": wall * 1e3, "comm_ms": 0.0}
    inner, group, rank = net.net, net.ranks.group, net.ranks.rank
    hidden = inner.config.hidden_size
    token = net.share(mx.argmax(last, -1) if net.is_last else None, after=last)[:1]
    mx.eval(token)
    compute = wall = 0.0
    for _ in range(STEPS):
        t0 = time.perf_counter()
        if rank == 0:
            h = inner.embed(token.reshape(1, 1))
        else:
            h = mx.distributed.recv((1, 1, hidden), net.hidden_dtype, rank - 1, group=group)
        mx.eval(h)
        c0 = time.perf_counter()
        h = inner.run_layers(h, cache)
        y = mx.argmax(inner.head(h, True)[:, -1], -1) if net.is_last else None
        mx.eval(h if y is None else y)
        compute += time.perf_counter() - c0
        sent = h if net.is_last else mx.distributed.send(h, rank + 1, group=group)
        token = net.share(y, after=sent)[:1]
        mx.eval(token)
        wall += time.perf_counter() - t0
    per_rank = net.ranks.gather([int(compute / STEPS * 1e6)])  # µs of each rank's compute
    total = sum(r[0] for r in per_rank) / 1e3
    step = wall / STEPS * 1e3
    return {"step_ms": step, "compute_ms": total, "comm_ms": max(0.0, step - total)}


def launch(n: int, model: str, rounds: int) -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--rank-run", "--model", model,
          "--rounds", str(rounds)]  # fmt: skip
    if n > 1:
        me = [str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring", "-n",
              str(n), *me]  # fmt: skip
    env = {**os.environ, "MLXLIS_DEVICE": os.environ.get("MLXLIS_DEVICE", "cpu")}
    if n == 1:  # as many BLAS threads as each rank of the 2-rank run (pipeline.share_cores)
        env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    res = subprocess.run(me, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"{n} ranks failed:\n{res.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def link_seconds(nbytes: int, hops: int, bandwidth: float, rtt: float) -> float:
    """What links add to one decoded token: its bytes at `bandwidth`, plus one-way latencies
    (rtt / 2): one per hop for the hidden states and 2 per hop for the token's ring all_sum
    (reduce, then gather)."""
    return nbytes / bandwidth + 3 * hops * rtt / 2 if hops else 0.0


def table(rows: list[dict]) -> str:
    out = ["| ranks | prefill tok/s (512-chunks) | (128-chunks) | decode tok/s | step ms | "
           "compute ms | between ranks ms | bytes/token | "
           + " | ".join(f"{k} adds µs/token" for k in LINKS) + " |",
           "|" + "---|" * (8 + len(LINKS))]  # fmt: skip
    for r in rows:
        b = r.get("bytes_per_token", 0)
        hops = r["ranks"] - 1
        adds = [f"{link_seconds(b, hops, bw, rtt) * 1e6:.0f}" for bw, rtt in LINKS.values()]
        out.append(f"| {r['ranks']} | {r['prefill_512']:.0f} | {r['prefill_128']:.0f} | "
                   f"{r['decode']:.1f} | {r['step_ms']:.1f} | {r['compute_ms']:.1f} | "
                   f"{r['comm_ms']:.1f} | {b} | " + " | ".join(adds) + " |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_run:
        rank_main(a.model, a.rounds)
        return
    rows = [launch(int(n), a.model, a.rounds) for n in a.ranks.split(",")]
    print(f"{a.model}, float32, {PROMPT}-token prompt, {DECODE} decoded tokens, one machine "
          f"({os.cpu_count()} cores):\n")  # fmt: skip
    print(table(rows))
    out = ROOT / "bench-results" / "pipeline.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
