"""`make bench` (pipeline): one model pipelined over 1, 2 and 3 ranks of one machine (mlx.launch,
ring backend over loopback). On one machine this measures the overhead of splitting, never a
speed-up: the ranks share its cores and memory bandwidth.

For each rank count, in a fresh launch (best of --rounds), rank 0 running `mlxlis.generate`
(the generation core, its steps announced to the ranks that follow):
  prefill   PROMPT tokens, in 512-token chunks (the core's) and in 128-token chunks (more
            overlap between ranks), tokens/s;
  decode    DECODE greedy tokens, tokens/s after the first (and the step in ms);
  bytes     bytes passed between ranks per token: hidden_size × residual dtype size per hop,
            plus the float32 logits the last rank sends rank 0 (vocab × 4).
A tensor row (`--tensor 2`: every layer split across the ranks, distributed/tensor.py) runs
the same measurements; its bytes are what each rank sends per token in the ring's all_sums
(two per layer and the embedding's) and the head's all_gather, and a link adds one latency
per ring step of each of those collectives.
Prints a Markdown table with what a Thunderbolt link would add per token, and writes
bench-results/pipeline.json. With fewer cores than ranks the ranks slow each other: a rank
waiting for its input polls its sockets (MLX's ring backend; about half a core here) on the
cores the computing rank needs.

usage: python scripts/bench_pipeline.py [--model NAME] [--ranks 1,2,3] [--tensor 2]
                                       [--rounds N] [--prompt N] [--decode N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT, DECODE = 512, 32
# Thunderbolt links between Macs (ring backend over IP): usable bandwidth and a round trip
LINKS = {
    "Thunderbolt 4 (~2.5 GB/s, ~50 µs)": (2.5e9, 50e-6),
    "Thunderbolt 5 (~5 GB/s, ~30 µs)": (5e9, 30e-6),
}


def rank_main(model: str, rounds: int, tensor: int | None = None) -> None:
    """One rank of a launch (or the lone process): rank 0 measures and prints one JSON line,
    the other ranks follow its steps (split in `tensor` ranks, else pipelined)."""
    import mlxlis  # noqa: F401  (chooses the BLAS before mlx.core loads)
    from mlxlis.distributed.leader import finish, follow, ranks_of
    from mlxlis.generation.generate import generate
    from mlxlis.runtime.device import setup_process

    setup_process()
    m = mlxlis.load(model, "float32", tensor=tensor)
    if m.rank != 0:
        follow(m)
        return
    ranks = ranks_of(m)
    ids = (m.tokenizer.encode("The history of the river and the mill. " * 80))[:PROMPT]
    out: dict = {"ranks": ranks.size if ranks is not None else 1, "tensor": tensor is not None}
    try:
        for step in (512, 128):
            best = 0.0
            for _ in range(rounds):
                final = list(generate(m, ids, max_tokens=1, prefill_step=step))[-1]
                best = max(best, final.usage.prompt_tps)
            out[f"prefill_{step}"] = best
        best = 0.0
        for _ in range(rounds):
            final = list(generate(m, ids[:16], max_tokens=DECODE, temperature=0.0))[-1]
            best = max(best, final.usage.decode_tps)
        out["decode"] = best
        out["step_ms"] = 1e3 / best if best else 0.0
        if ranks is not None and tensor is not None:
            from mlxlis.distributed.tensor import bytes_per_token

            out["bytes_per_token"] = bytes_per_token(m.config, mx_float32(), ranks.size)
            out["collectives"] = 2 * m.config.num_hidden_layers + 2
        elif ranks is not None:
            out["bytes_per_token"] = (
                m.net.hidden_bytes_per_token() * (ranks.size - 1) + m.config.vocab_size * 4
            )
    finally:
        finish(ranks)
    print("RESULT " + json.dumps(out), flush=True)


def mx_float32():
    import mlx.core as mx

    return mx.float32


def launch(n: int, model: str, rounds: int, tensor: bool = False) -> dict:
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--rank-run",
        "--model",
        model,
        "--rounds",
        str(rounds),
        "--prompt",
        str(PROMPT),
        "--decode",
        str(DECODE),
        "--tensor",
        str(n) if tensor else "",
    ]
    if n > 1:
        me = [
            str(Path(sys.executable).with_name("mlx.launch")),
            "--backend",
            "ring",
            "-n",
            str(n),
            *me,
        ]
    env = {**os.environ, "MLXLIS_DEVICE": os.environ.get("MLXLIS_DEVICE", "cpu")}
    env["PYTHONPATH"] = str(ROOT)  # the ranks import this checkout's mlxlis
    if n == 1:  # as many BLAS threads as each rank of the 2-rank run (pipeline.share_cores)
        env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    res = subprocess.run(me, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"{n} ranks failed:\n{res.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def link_seconds(nbytes: int, hops: int, bandwidth: float, rtt: float) -> float:
    """What links add to one decoded token: its bytes at `bandwidth`, plus one-way latencies
    (rtt / 2): one per hop for the step's announcement and one for its hidden states, and one
    for the logits' way back to rank 0."""
    return nbytes / bandwidth + (2 * hops + 1) * rtt / 2 if hops else 0.0


def table(rows: list[dict]) -> str:
    out = [
        "| ranks | split | prefill tok/s (512-chunks) | (128-chunks) | decode tok/s | step ms | "
        "bytes/token | " + " | ".join(f"{k} adds µs/token" for k in LINKS) + " |",
        "|" + "---|" * (7 + len(LINKS)),
    ]
    for r in rows:
        b = r.get("bytes_per_token", 0)
        hops = r["ranks"] - 1
        if r.get("tensor"):  # each collective: 2·(N−1) ring steps (the gather N−1; counted 2)
            hops = r["collectives"] * (r["ranks"] - 1)
        adds = [f"{link_seconds(b, hops, bw, rtt) * 1e6:.0f}" for bw, rtt in LINKS.values()]
        split = "tensor" if r.get("tensor") else ("layers" if r["ranks"] > 1 else "-")
        out.append(
            f"| {r['ranks']} | {split} | {r['prefill_512']:.0f} | {r['prefill_128']:.0f} | "
            f"{r['decode']:.1f} | {r['step_ms']:.1f} | {b} | " + " | ".join(adds) + " |"
        )
    return "\n".join(out)


def main() -> None:
    global PROMPT, DECODE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--tensor", default="2", help="tensor-parallel rank counts ('' for none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--decode", type=int, default=32, help="decoded tokens")
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    PROMPT, DECODE = a.prompt, a.decode
    if a.rank_run:
        rank_main(a.model, a.rounds, int(a.tensor) if a.tensor else None)
        return
    rows = [launch(int(n), a.model, a.rounds) for n in a.ranks.split(",")]
    rows += [launch(int(n), a.model, a.rounds, tensor=True) for n in a.tensor.split(",") if n]
    print(
        f"{a.model}, float32, {PROMPT}-token prompt, {DECODE} decoded tokens, one machine "
        f"({os.cpu_count()} cores):\n"
    )
    print(table(rows))
    out = ROOT / "bench-results" / "pipeline.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
