"""`make bench`: `mlxlis serve` vs `mlx_lm.server` under 1, 4 and 8 concurrent clients.

Each catalog model is served by both, one server at a time, on the same weights: mlxlis from
the GGUF, mlx-lm from `mlxlis convert --dequantize` safetensors in the dtype mlxlis computes
in on this device (mlx-lm cannot read GGUF; see bench.py). Every client sends streamed
/v1/completions requests (distinct prompts of about PROMPT_WORDS words, MAX_TOKENS tokens,
greedy) one after another. Reported per engine x clients: aggregate generated tokens/s (all
clients' tokens over the wall time, prefill included), p50/p95 time to first token; and the
second turn of a conversation of about 1 000 tokens, whose prompt starts with the first
turn's prompt and reply (the prefix cache's case): its TTFT against the first turn's.
Prints a Markdown table and writes JSON to bench-results/. `--engines mlxlis@2` also serves
under `mlx.launch` with the model pipelined across 2 ranks of this machine (loopback: the
cost of the pipeline, not a speed-up).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlxlis  # noqa: E402, F401  (importing mlxlis preloads the BLAS first)
from mlxlis.loading import catalog  # noqa: E402
from mlxlis.runtime.device import default_dtype_name  # noqa: E402

from bench import cpu_name, hf_copy  # noqa: E402

CLIENTS = (1, 4, 8)
REQUESTS_PER_CLIENT = 2
MAX_TOKENS = 32
PROMPT_WORDS = 100
STARTUP_S = 300
WORDS = (
    "river stone garden lantern harbour meadow violin copper orchard glacier thunder "
    "pepper canyon marble feather compass velvet ember willow saddle"
).split()
STORY = (
    "The history of computing is a story of abstraction layered upon abstraction. Early "
    "machines were programmed by rewiring; later, stored programs let the same hardware do "
    "many things. Compilers, operating systems and networks followed. "
) * 22


# mlx_lm.server with the OpenBLAS sgemm mlxlis gives itself (MLX's bundled BLAS is ~30x
# slower: a 1 000-token prefill took minutes), not mlxlis's matrix-vector routing (measured
# here as part of mlxlis), as bench_worker.py does for the single-stream benchmark
MLX_LM_SERVER = """
import os, runpy, sys
os.environ["MLXLIS_BLAS_GEMV"] = "0"
import mlxlis  # chooses the BLAS before mlx.core loads
sys.argv = ["mlx_lm", "server", *sys.argv[1:]]
runpy.run_module("mlx_lm", run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i: int) -> str:
    """A prompt of PROMPT_WORDS words that differs from every other one from its first word."""
    words = [WORDS[(i * 7 + k * (i % 5 + 1)) % len(WORDS)] for k in range(PROMPT_WORDS)]
    return f"{i}: " + " ".join(words)


class Server:
    headers = {"Content-Type": "application/json"}

    def __init__(self, engine: str, name: str, cache: Path, log: Path, template: str | None = None):
        """`template`: a chat template both engines use instead of the model's."""
        self.port = free_port()
        self.model = "default_model" if engine == "mlx_lm" else name  # mlx-lm: the one loaded
        py = sys.executable
        if engine.startswith("mlxlis"):
            cmd = [
                py,
                "-m",
                "mlxlis",
                "serve",
                "-m",
                name,
                "--port",
                str(self.port),
                "--max-batch",
                "8",
            ]
            if template is not None:
                (cache / "template.jinja").write_text(template)
                cmd += ["--chat-template", str(cache / "template.jinja")]
            if "@" in engine:  # mlxlis@N: pipelined across N ranks on this machine (loopback)
                launcher = str(Path(py).with_name("mlx.launch"))
                cmd = [launcher, "--backend", "ring", "-n", engine.split("@")[1], *cmd]
        else:
            folder = hf_copy(name, default_dtype_name(), cache)
            cmd = [
                py,
                "-c",
                MLX_LM_SERVER,
                "--model",
                str(folder),
                "--port",
                str(self.port),
                "--log-level",
                "WARNING",
            ]
            if template is not None:  # mlx-lm takes the template's text
                cmd += ["--chat-template", template]
        self.log = open(log, "wb")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=self.log, cwd=ROOT, start_new_session=True
        )  # stop() ends a launcher's ranks too
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{engine} server exited; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{engine} server did not start; see {log}")

    def complete(self, text: str, max_tokens: int = MAX_TOKENS) -> tuple[float, int, str, float]:
        """(TTFT s, tokens, text, total s) of one streamed greedy completion."""
        body = {
            "model": self.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        ttft, n, out = None, 0, ""
        while line := resp.readline():
            line = line.strip()
            if line == b"data: [DONE]":
                break  # mlx_lm.server keeps the connection open after it
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            for ch in event.get("choices") or []:
                if ch.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    out += ch["text"]
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
        conn.close()
        return (ttft or 0.0), n, out, time.perf_counter() - t0

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)  # its session: a launcher and its ranks
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def load(server: Server, clients: int) -> dict:
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(REQUESTS_PER_CLIENT):
            ttft, n, _, _ = server.complete(prompt(1000 * clients + 10 * c + r))
            with lock:
                ttfts.append(ttft)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = statistics.quantiles(ttfts, n=20, method="inclusive")
    return {
        "clients": clients,
        "tokens": tokens[0],
        "wall_s": wall,
        "tok_s": tokens[0] / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": q[18],
    }


def second_turn(server: Server) -> dict:
    """TTFT of a ~1 000-token first turn and of the turn after it (first prompt + reply +
    a new line: the prefix cache's case)."""
    first = STORY + "\nQuestion: what came after compilers?\nAnswer:"
    ttft1, _, reply, _ = server.complete(first, 16)
    ttft2, _, _, _ = server.complete(first + reply + "\nQuestion: and then?\nAnswer:", 16)
    return {"first_ttft_s": ttft1, "second_ttft_s": ttft2, "ratio": ttft2 / ttft1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="*", default=catalog.default_names())
    ap.add_argument("--engines", nargs="*", default=["mlxlis", "mlx_lm"])
    ap.add_argument("--cache", default=str(catalog.store_dir().parent / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    a = ap.parse_args()
    rows = []
    logs = Path(tempfile.mkdtemp(prefix="mlxlis-bench-serve-"))
    for name in a.models:
        catalog.pull(name)
        for engine in a.engines:
            print(f"{name} / {engine} ...", file=sys.stderr, flush=True)
            server = Server(engine, name, Path(a.cache), logs / f"{name}-{engine}.log")
            try:
                server.complete(prompt(0), 8)  # warm-up: compiled kernels, first buffers
                row = {
                    "model": name,
                    "engine": engine,
                    "loads": [load(server, c) for c in CLIENTS],
                    "second_turn": second_turn(server),
                }
            finally:
                server.stop()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)  # kept if a later model fails
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "dtype": default_dtype_name()}
    out = Path(a.out)
    out.mkdir(exist_ok=True)
    path = out / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    print_table(rows, machine)
    print(f"\n(JSON: {path})")
    return 0


def print_table(rows: list[dict], machine: dict) -> None:
    print(
        f"\n{machine['cpu']}, {machine['cores']} cores, {machine['dtype']}; streamed "
        f"completions of {MAX_TOKENS} tokens, {REQUESTS_PER_CLIENT} per client\n"
    )
    print(
        "| model | engine | clients | tok/s (aggregate) | vs 1 client | TTFT p50 | TTFT p95 |"
        " vs mlx_lm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    by = {(r["model"], r["engine"]): r for r in rows}
    for r in rows:
        one = r["loads"][0]["tok_s"]
        other = by.get((r["model"], "mlx_lm"))
        for i, ld in enumerate(r["loads"]):
            vs = ""
            if r["engine"] != "mlx_lm" and other is not None:
                vs = f"{ld['tok_s'] / other['loads'][i]['tok_s']:.2f}x"
            print(
                f"| {r['model']} | {r['engine']} | {ld['clients']} | {ld['tok_s']:.1f} | "
                f"{ld['tok_s'] / one:.2f}x | {ld['ttft_p50_s']:.2f} s | "
                f"{ld['ttft_p95_s']:.2f} s | {vs} |"
            )
    print("\n| model | engine | first-turn TTFT (~1 000 tokens) | second-turn TTFT | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        s = r["second_turn"]
        print(
            f"| {r['model']} | {r['engine']} | {s['first_ttft_s']:.2f} s | "
            f"{s['second_ttft_s']:.2f} s | {s['ratio']:.2f} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
