"""`make bench` (core): the one generation core's decode speed on two surfaces, the one-shot
command and `mlxlis serve` with one client, on the same prompt.

For each catalog model, in fresh processes, alternating, median of --rounds: the one-shot
command (`mlxlis -m M --no-chat --temp 0 --max-tokens N --verbose PROMPT`, its "generated: …
tok/s" line) and a server (`mlxlis serve -m M --max-batch 1`) answering one /v1/completions
request for the same prompt (greedy, the same N; its per-request log line's tok/s). Both are
tokens after the first over the time after the first, so the ratio is the server's overhead
per token (HTTP and the engine's thread, nothing else: the same core steps both).

usage: python scripts/bench_core.py [--models a,b] [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLXLIS = [sys.executable, "-m", "mlxlis"]
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
CATALOG = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


def one_shot(model: str, tokens: int) -> float:
    args = ["-m", model, "--no-chat", "--temp", "0", "--max-tokens", str(tokens), "--verbose"]
    out = subprocess.run([*MLXLIS, *args, PROMPT], capture_output=True, text=True, timeout=600)
    m = re.search(r"generated: (\d+) tokens, ([\d.]+) tok/s", out.stderr)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"one-shot failed:\n{out.stderr[-2000:]}")
    return float(m.group(2))


def served(model: str, tokens: int, log: Path) -> float:
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [*MLXLIS, "serve", "-m", model, "--port", "0", "--max-batch", "1"],
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r" on http://[^ ]+:(\d+) ", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server failed:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=600)
        body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        reply.read()
        deadline = time.monotonic() + 10
        while not (hit := re.search(r"([\d.]+) tok/s", log.read_text())):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        return float(hit.group(1))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(CATALOG))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    rows = []
    for model in a.models.split(","):
        shot, serve = [], []
        for _ in range(a.rounds):
            shot.append(one_shot(model, a.tokens))
            serve.append(served(model, a.tokens, out / "core-serve.log"))
        rows.append(
            {
                "model": model,
                "one_shot": statistics.median(shot),
                "serve": statistics.median(serve),
                "runs": [shot, serve],
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"decode tok/s, greedy, {a.tokens} tokens, median of {a.rounds}:\n")
    print("| model | one-shot | serve, 1 client | serve / one-shot |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['one_shot']:.1f} | {r['serve']:.1f} | "
            f"{r['serve'] / r['one_shot']:.3f} |"
        )
    (out / "core.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
