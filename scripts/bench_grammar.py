"""`make bench` (structured output): what enforcing a constraint costs.

1. The grammar engine on the real vocabularies (Qwen2.5's 152k tokens, Gemma 3's 262k): the
   engine's tokenizer set-up, the compile time of the 24 test schemas (tests/test_constraints),
   and the mask time per token (p50 / p99) along a recorded valid reply; llguidance always,
   xgrammar too when it is installed (it is not a dependency: it needs torch).
2. Decode tok/s constrained vs free on the three catalog models, batch 1 (`generate`) and
   batch 8 (the serving engine), 64 tokens each: the constraint is an array of 40 strings, so
   neither run ends before max_tokens.
Prints Markdown tables; writes bench-results/grammar.json.

usage: python scripts/bench_grammar.py [--models a,b] [--skip-engines] [--skip-decode]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)
from mlxlis.generation.constraints import constraint, engine_tokenizer  # noqa: E402
from mlxlis.generation.core import Request  # noqa: E402
from mlxlis.generation.engine import Engine  # noqa: E402

import numpy as np  # noqa: E402
from test_constraints import SCHEMAS, fmt  # noqa: E402

CATALOG = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
LONG = {
    "type": "array",
    "items": {"type": "string", "maxLength": 30},
    "minItems": 40,
    "maxItems": 40,
}
DOC = json.dumps({"person": {"name": "Ada Lovelace", "age": 36}})


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


def row(model: str, engine: str, vocab: int, setup: float, compiles: list, times: list) -> dict:
    return {
        "model": model,
        "engine": engine,
        "vocab": vocab,
        "setup_s": setup,
        "compile_ms_mean": statistics.mean(compiles) * 1e3,
        "compile_ms_max": max(compiles) * 1e3,
        "mask_ms_p50": pct(times, 50),
        "mask_ms_p99": pct(times, 99),
    }


def engines(name: str) -> list[dict]:
    model = mlxlis.load(name)
    tok, vocab = model.tokenizer, model.config.vocab_size
    stops = sorted(model.stop_ids())
    rows = []
    t0 = time.perf_counter()
    lt = engine_tokenizer(tok, vocab, stops)
    setup = time.perf_counter() - t0
    compiles = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        constraint(fmt(s), tok, vocab, stops)
        compiles.append(time.perf_counter() - t0)
    mask = constraint(fmt(SCHEMAS[7]), tok, vocab, stops)
    ids = tok.encode(DOC, add_bos=False)
    times = []
    for i in range(len(ids) + 1):
        t0 = time.perf_counter()
        mask.allowed([0] + ids[:i])
        times.append(time.perf_counter() - t0)
    rows.append(row(name, "llguidance", vocab, setup, compiles, times))
    del lt
    try:
        import xgrammar as xgr
    except ImportError:
        return rows
    t0 = time.perf_counter()
    enc = [
        b""
        if i in set(stops) | set(tok.special_tokens.values()) or i >= tok.vocab_size
        else tok.token_bytes(i)
        for i in range(vocab)
    ]
    info = xgr.TokenizerInfo(enc, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=stops)
    comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - t0
    compiles = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        comp.compile_json_schema(json.dumps(s), any_whitespace=False)
        compiles.append(time.perf_counter() - t0)
    m = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMAS[7]), any_whitespace=False))
    bitmask = np.full(xgr.get_bitmask_shape(1, vocab), -1, np.int32)
    times = []
    for i in range(len(ids) + 1):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        if i < len(ids):
            m.accept_token(ids[i])
    rows.append(row(name, "xgrammar", vocab, setup, compiles, times))
    return rows


def decode(name: str, tokens: int = 64) -> dict:
    model = mlxlis.load(name)
    prompt = (
        model.render_chat([{"role": "user", "content": "List forty fruits."}])
        if (model.template is not None)
        else "A list of forty fruits, as JSON:"
    )
    ids = model.tokenizer.encode(prompt, special=True)
    stops = set(model.stop_ids())
    out = {"model": name}
    for label, rf in (("free", None), ("constrained", fmt(LONG))):
        evs = list(
            mlxlis.generate(
                model, ids, max_tokens=tokens, stop_ids=stops if rf else set(), response_format=rf
            )
        )
        out[f"{label}_1"] = evs[-1].usage.decode_tps
        engine = Engine(model, max_active=8, prefix_cache_bytes=0)
        try:
            masks = [
                ()
                if rf is None
                else (constraint(rf, model.tokenizer, model.config.vocab_size, sorted(stops)),)
                for _ in range(8)
            ]
            t0 = time.perf_counter()
            streams = [
                engine.submit(
                    Request(
                        ids,
                        mlxlis.SamplingParams(max_tokens=tokens),
                        frozenset(stops) if rf else frozenset(),
                        processors=m,
                    )
                )
                for m in masks
            ]
            finals = [list(s)[-1] for s in streams]
        finally:
            engine.shutdown()
        # decode only: tokens after each request's first, over the time after the first token
        first = max(f.usage.time_to_first_token for f in finals)
        n = sum(f.usage.completion_tokens - 1 for f in finals)
        out[f"{label}_8"] = n / (time.perf_counter() - t0 - first)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(CATALOG))
    p.add_argument("--skip-engines", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    a = p.parse_args()
    result: dict = {}
    if not a.skip_engines:
        rows = [r for n in ("qwen2.5-coder-0.5b", "gemma3-270m") for r in engines(n)]
        result["engines"] = rows
        print(
            "| vocabulary | engine | set-up s | compile ms (mean / max, 24 schemas) | "
            "mask ms p50 | p99 |\n|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| {r['model']} ({r['vocab']}) | {r['engine']} | {r['setup_s']:.2f} | "
                f"{r['compile_ms_mean']:.1f} / {r['compile_ms_max']:.1f} | "
                f"{r['mask_ms_p50']:.3f} | {r['mask_ms_p99']:.3f} |"
            )
        print()
    if not a.skip_decode:
        rows = [decode(n) for n in a.models.split(",")]
        result["decode"] = rows
        print(
            "| model | free B=1 | constrained B=1 | ratio | free B=8 | constrained B=8 | ratio |"
            "\n|---|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| {r['model']} | {r['free_1']:.1f} | {r['constrained_1']:.1f} | "
                f"{r['constrained_1'] / r['free_1']:.2f} | {r['free_8']:.1f} | "
                f"{r['constrained_8']:.1f} | {r['constrained_8'] / r['free_8']:.2f} |"
            )
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "grammar.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
