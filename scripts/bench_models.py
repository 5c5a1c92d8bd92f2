"""`make bench` (several models in one server): a real `mlxlis serve` serving the three default
catalog models, driven over HTTP.

- Time to the first token of a request to a model that is not loaded (its load included)
  vs the same request once it is loaded, for each model (greedy, a short prompt).
- Two models decoding at once (one stream each, started together) vs each alone: total
  generated tokens per second.
- The longest pause between two tokens of a SmolLM2 stream, alone and while Qwen2.5-Coder
  is loaded (its weights read on the loading thread) and answers its first token.

Best of `--rounds` (the cold figure: the model unloaded with Ollama's keep_alive 0 between
rounds). Prints a Markdown table; the machine should be quiet.

usage: python scripts/bench_models.py [--rounds N] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from mlxlis.loading import catalog  # noqa: E402

from serve_process import ServeProcess, events  # noqa: E402

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
PROMPT = "The history of computing is a story of abstraction layered upon abstraction."


def first_token(srv: ServeProcess, model: str, tokens: int = 1) -> tuple[float, int, float]:
    """(seconds to the first streamed token, tokens received, seconds to the last)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    t0 = time.perf_counter()
    conn, resp = srv.open_stream("/v1/completions", {**body, "stream": True})
    ttft, n = None, 0
    for ev in events(resp):
        if ev == "[DONE]":
            break
        if ev["choices"][0]["text"]:
            n += 1
            ttft = ttft if ttft is not None else time.perf_counter() - t0
    conn.close()
    return ttft or 0.0, n, time.perf_counter() - t0


def gaps(srv: ServeProcess, model: str, tokens: int, during=None) -> float:
    """The longest wait between two streamed tokens of `model` (`during()` called once the
    stream has started: another model's load)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    conn, resp = srv.open_stream("/v1/completions", {**body, "stream": True})
    stream = events(resp)
    next(stream)
    job = threading.Thread(target=during) if during else None
    if job:
        job.start()
    last, worst = time.perf_counter(), 0.0
    for ev in stream:
        if ev == "[DONE]":
            break
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    conn.close()
    if job:
        job.join()
    return worst


def unload(srv: ServeProcess, model: str) -> None:
    """Unloaded, and gone from /api/ps (a request just ended may still hold it a moment)."""
    status, body = srv.request("POST", "/api/generate", {"model": model, "keep_alive": 0})
    assert status == 200 and body["done_reason"] == "unload", body
    while any(m["model"] == f"{model}:latest" for m in srv.request("GET", "/api/ps")[1]["models"]):
        time.sleep(0.05)


def together(srv: ServeProcess, pair: list[str], tokens: int) -> float:
    """Total tokens/s of one stream per model, started at once."""
    out: dict[str, tuple[float, int, float]] = {}
    threads = [
        threading.Thread(target=lambda m=m: out.__setitem__(m, first_token(srv, m, tokens)))
        for m in pair
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(n for _, n, _ in out.values()) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    missing = [m for m in MODELS if not catalog.is_pulled(m)]
    if missing:
        print(f"not pulled: {', '.join(missing)} (make models)")
        return 2
    tmp = Path(ROOT / "bench-results" / "models")
    tmp.mkdir(parents=True, exist_ok=True)
    args = [x for m in MODELS for x in ("-m", m)]
    srv = ServeProcess(tmp, *args, "--keep-alive", "-1")
    rows, results = [], {}
    try:
        for m in MODELS:
            cold, warm = [], []
            for _ in range(a.rounds):
                unload(srv, m)
                cold.append(first_token(srv, m)[0])
                warm.append(first_token(srv, m)[0])
            results[m] = {"cold_ttft_s": min(cold), "warm_ttft_s": min(warm)}
            rows.append(f"| {m} | {min(cold):.2f} s | {min(warm) * 1000:.0f} ms |")
        pair = MODELS[:2]
        for m in pair:  # both loaded and warm
            first_token(srv, m)
        alone = {m: max(together(srv, [m], a.tokens) for _ in range(a.rounds)) for m in pair}
        both = max(together(srv, pair, a.tokens) for _ in range(a.rounds))
        results["together"] = {"alone_tps": alone, "both_tps": both}
        # a stream's longest pause, alone and while the largest model is read and warmed up
        big = MODELS[-1]
        calm, loading = [], []
        for _ in range(a.rounds):
            unload(srv, big)
            calm.append(gaps(srv, MODELS[0], 4 * a.tokens))
            unload(srv, big)
            loading.append(gaps(srv, MODELS[0], 4 * a.tokens, lambda: first_token(srv, big)))
        results["stream_gap_s"] = {"alone": min(calm), "during_load": min(loading)}
    finally:
        srv.stop()
    print("| model | first token, not loaded (load included) | first token, loaded |")
    print("|---|---|---|")
    print("\n".join(rows))
    print()
    print(f"| {a.tokens} tokens each | tokens/s |")
    print("|---|---|")
    for m, tps in alone.items():
        print(f"| {m} alone | {tps:.1f} |")
    print(f"| {' + '.join(pair)} at once | {both:.1f} |")
    print()
    gap = results["stream_gap_s"]
    print(f"| {MODELS[0]} stream | longest pause between tokens |")
    print("|---|---|")
    print(f"| alone | {gap['alone'] * 1000:.0f} ms |")
    print(f"| while {MODELS[-1]} loads | {gap['during_load'] * 1000:.0f} ms |")
    (ROOT / "bench-results" / "models.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
