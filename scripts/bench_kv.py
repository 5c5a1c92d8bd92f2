"""`make bench` (long contexts): what quantized KV caches and the prefix cache on disk buy.

For each model:
- the longest context one sequence's caches fit beside the weights in a fixed budget
  (`--budget`, default 2G, as MLXLIS_MAX_MEMORY would set it) at dense, 8- and 4-bit KV
  (models/footprint.py: measured from the caches);
- decode tok/s after `--context` tokens (default 4 000) at each format;
- the time to first token of a conversation's second turn (`--context` tokens, then 64 new
  ones): cold, with the first turn's caches in memory, and read from disk by a fresh engine
  (a restart) through `--prefix-cache-dir`'s DiskCache.
Prints a Markdown table; writes bench-results/kv.json.

usage: python scripts/bench_kv.py [--models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import inspect
import json
import json.decoder
import json.encoder
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402  (the BLAS before mlx.core)
from mlxlis.cache import KVFormat  # noqa: E402
from mlxlis.cache.disk import DiskCache  # noqa: E402
from mlxlis.generation.core import Request  # noqa: E402
from mlxlis.generation.engine import Engine  # noqa: E402
from mlxlis.generation.sampling import SamplingParams  # noqa: E402
from mlxlis.generation.steps import prefill  # noqa: E402
from mlxlis.models.footprint import footprint  # noqa: E402
from mlxlis.runtime.memory import parse_bytes  # noqa: E402

import mlx.core as mx  # noqa: E402

FORMATS = {"dense": None, "8-bit": KVFormat(8, 64), "4-bit": KVFormat(4, 64)}
TEXT = (inspect.getsource(json.decoder) + inspect.getsource(json.encoder)) * 4  # real code
STEPS = 16


def decode_rate(model, ids: list[int]) -> float:
    caches = model.make_cache()
    mx.eval(prefill(model.net, ids, caches))
    token = mx.array([[ids[-1]]], mx.int32)
    mx.eval(model.net(token, cache=caches))  # the first step compiles what it needs
    t0 = time.perf_counter()
    for _ in range(STEPS):
        mx.eval(model.net(token, cache=caches))
    return STEPS / (time.perf_counter() - t0)


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    events = list(engine.submit(Request(ids, SamplingParams(max_tokens=1))))
    return events[-1].usage.time_to_first_token, events[-1].usage.cached_tokens


def second_turn(model, one: list[int], two: list[int], three: list[int], folder: Path) -> dict:
    """TTFT of `two` (turn 1 `one`, then new tokens) cold, after `one` in memory, and of
    `three` (other new tokens after `one`) after a restart, `one` read from disk."""

    def engine(disk: bool) -> Engine:
        tier = DiskCache(folder, 1 << 40, model.cache_key(), model.make_cache, print)
        return Engine(model, max_active=1, prefix_cache_bytes=4 << 30, disk=tier if disk else None)

    e = engine(False)
    try:
        cold, _ = ttft(e, two)
    finally:
        e.shutdown()
    e = engine(True)
    try:
        ttft(e, one)
        memory, from_memory = ttft(e, two)
    finally:
        e.shutdown()
    e = engine(True)  # a restart: nothing in memory, the folder as the last one left it
    try:
        disk, from_disk = ttft(e, three)
    finally:
        e.shutdown()
    return {"cold": cold, "memory": memory, "disk": disk, "reused": [from_memory, from_disk]}


def bench(name: str, context: int, budget: int) -> dict:
    model = mlxlis.load(name)
    ids = model.tokenizer.encode(TEXT)[:context]
    assert len(ids) == context, f"the text gives {len(ids)} tokens, fewer than {context}"
    out: dict = {"formats": {}}
    for label, fmt in FORMATS.items():
        model.set_kv_format(fmt)
        fp = footprint(model)
        fits = fp.max_context(budget - fp.weights, 1 << 24)
        out["formats"][label] = {
            "kv_bytes_per_token": fp.per_token,
            "max_context": fits,
            "decode_tps": decode_rate(model, ids),
        }
        print(json.dumps({"model": name, label: out["formats"][label]}), file=sys.stderr)
    model.set_kv_format(None)
    one, three = ids[: context - 64], ids[: context - 64] + ids[-64:][::-1]
    with tempfile.TemporaryDirectory(prefix="mlxlis-bench-kv-") as tmp:
        out["second_turn"] = second_turn(model, one, ids, three, Path(tmp))
    print(json.dumps({"model": name, "second_turn": out["second_turn"]}), file=sys.stderr)
    return out


def table(results: dict, context: int, budget: str) -> str:
    rows = [
        f"| model | KV | bytes/token | context in {budget} | decode tok/s at {context} |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        dense = r["formats"]["dense"]
        for label, f in r["formats"].items():
            rows.append(
                f"| {name} | {label} | {f['kv_bytes_per_token']} | {f['max_context']} "
                f"({f['max_context'] / max(dense['max_context'], 1):.1f}×) | "
                f"{f['decode_tps']:.2f} ({f['decode_tps'] / dense['decode_tps']:.2f}×) |"
            )
    rows += [
        "",
        "| model | 2nd turn TTFT cold | from memory | from disk (restart) |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        t = r["second_turn"]
        rows.append(
            f"| {name} | {t['cold']:.2f} s | {t['memory']:.2f} s ({t['memory'] / t['cold']:.2f}×) "
            f"| {t['disk']:.2f} s ({t['disk'] / t['cold']:.2f}×) |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--budget", default="2G")
    a = p.parse_args()
    budget = parse_bytes(a.budget, "--budget")
    results = {name: bench(name, a.context, budget) for name in a.models.split(",")}
    print(table(results, a.context, a.budget))
    out = ROOT / "bench-results" / "kv.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
