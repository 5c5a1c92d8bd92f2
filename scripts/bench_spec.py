"""`make bench` (speculative decoding): decode speed of a target alone, with a draft model and
with prompt lookup, on three prompts, at batch 1 and 4.

Target Qwen2.5-Coder-1.5B-Instruct Q4_K_M (catalog `qwen2.5-coder-1.5b`, pulled on demand),
draft Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the same vocabulary). Prompts: writing code (the
draft model's case), editing a file given in the prompt (prompt lookup's: the reply copies it)
and random tokens sampled at temperature 1 (drafts fail: speculation must rest, never slow
decoding; greedy decoding would fall into a loop that drafts predict). Greedy otherwise, the
draft length chosen by the Governor (as a user gets it), the same loaded models throughout. Batch 4:
four requests of the same prompt kind in the serving engine, decoding together (speculation
rests there by design: one verification per row costs more than the batch's one step gains).

Each cell: decode tok/s (tokens after the first over the time after the first), the share of
drafted tokens kept and the draft length used most; the ratio to the target alone. Prints a
markdown table; writes bench-results/spec.json.

usage: python scripts/bench_spec.py [--tokens 64] [--target qwen2.5-coder-1.5b]
       [--draft qwen2.5-coder-0.5b] [--batch 1,4]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402  (the BLAS before mlx.core)
from mlxlis.cache.prefix import PrefixCache  # noqa: E402
from mlxlis.generation.core import Core, Request  # noqa: E402
from mlxlis.generation.engine import Engine  # noqa: E402
from mlxlis.generation.generate import run  # noqa: E402
from mlxlis.generation.sampling import SamplingParams  # noqa: E402
from mlxlis.generation.speculative import Speculation, check_vocabulary  # noqa: E402
from mlxlis.generation.steps import steps_for  # noqa: E402
from mlxlis.loading import catalog  # noqa: E402

FILE = '''import json
from pathlib import Path


def load(path):
    """Read the settings file and return its values."""
    text = Path(path).read_text()
    values = json.loads(text)
    if "name" not in values:
        raise ValueError("settings need a name")
    return values


def save(path, values):
    """Write the settings back."""
    Path(path).write_text(json.dumps(values, indent=2))


def merged(base, extra):
    out = dict(base)
    for key, value in extra.items():
        out[key] = value
    return out
'''
PROMPTS = {
    "code": "Write a Python function that reads a CSV file and returns its rows as a list of "
    "dicts keyed by the header, skipping blank lines.",
    "edit": "Rename the function `load` to `read_settings` in this file and show the whole "
    "file:\n\n```python\n" + FILE + "```",
}


def prompt_ids(model, kind: str) -> list[int]:
    if kind == "random":  # drafts fail: no earlier occurrence to copy, no pattern to guess
        rng = random.Random(0)
        return [rng.randrange(1000, 30000) for _ in range(48)]
    text = model.render_chat([{"role": "user", "content": PROMPTS[kind]}])
    return model.tokenizer.encode(text, special=True)


SHARED = PrefixCache(8 << 30)  # the lone runs of one prompt prefill it once (TTFT is not timed)


def params(kind: str, tokens: int) -> SamplingParams:
    if kind == "random":
        return SamplingParams(max_tokens=tokens, temperature=1.0, seed=0)
    return SamplingParams(max_tokens=tokens)


def lone(model, ids: list[int], spec: Speculation | None, p: SamplingParams) -> dict:
    core = Core(model, steps_for(model, SHARED))
    req = Request(ids, p, frozenset(), speculation=spec)
    seq = core.start(req)
    for _ in run(core, seq):
        pass
    chosen = seq.spec.governor.chosen if seq.spec is not None else {}
    u = seq.usage
    return {
        "tps": u.decode_tps,
        "kept": u.accepted_tokens / u.draft_tokens if u.draft_tokens else None,
        "drafted": u.draft_tokens,
        "k": max(chosen, key=chosen.get) if chosen else None,
        "note": u.speculation_note,
    }


def batched(model, ids: list[int], spec: Speculation | None, p: SamplingParams, n: int) -> dict:
    engine = Engine(model, max_active=n, prefix_cache_bytes=0)
    try:
        t = time.perf_counter()
        streams = [engine.submit(Request(ids, p, speculation=spec)) for _ in range(n)]
        finals = [list(s)[-1] for s in streams]
        wall = time.perf_counter() - t
    finally:
        engine.shutdown()
    drafted = sum(f.usage.draft_tokens for f in finals)
    kept = sum(f.usage.accepted_tokens for f in finals)
    ttft = max(f.usage.time_to_first_token for f in finals)
    total = sum(f.usage.completion_tokens for f in finals)
    return {
        "tps": (total - n) / (wall - ttft) if wall > ttft else 0.0,
        "kept": kept / drafted if drafted else None,
        "drafted": drafted,
        "k": None,
        "note": finals[0].usage.speculation_note,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--batch", default="1,4", help="batch sizes (4: the code prompt only)")
    ap.add_argument("--prompts", default="code,edit,random")
    a = ap.parse_args()
    for name in (a.target, a.draft):
        if name in catalog.CATALOG and not catalog.is_pulled(name):
            catalog.pull(name)
    target, draft = mlxlis.load(a.target), mlxlis.load(a.draft)
    check_vocabulary(target, draft)
    modes = {
        "alone": None,
        "draft model": Speculation("draft", draft),
        "ngram": Speculation("ngram"),
    }
    rows = []
    print(f"| prompt | batch | {' | '.join(modes)} |")
    print("|---|---|" + "---|" * len(modes))
    for kind in a.prompts.split(","):
        ids = prompt_ids(target, kind)
        lone(target, ids[:8], None, params(kind, 4))  # kernels compiled before the timed runs
        for n in map(int, a.batch.split(",")):
            if n > 1 and kind != "code":  # long prompts x 4 take long on a CPU: one kind
                continue
            cells, base = [], None
            for mode, spec in modes.items():
                p = params(kind, a.tokens)
                r = lone(target, ids, spec, p) if n == 1 else batched(target, ids, spec, p, n)
                base = r["tps"] if base is None else base
                r.update(prompt=kind, batch=n, mode=mode, ratio=r["tps"] / base if base else 0)
                rows.append(r)
                cell = f"{r['tps']:.2f} tok/s"
                if spec is not None:
                    kept = "-" if r["kept"] is None else f"{r['kept']:.0%}"
                    k = f", k {r['k']}" if r["k"] else ""
                    cell += f" ({r['ratio']:.2f}×; kept {kept}{k})"
                cells.append(cell)
                print(f"  {kind} batch {n} {mode}: {r}", file=sys.stderr, flush=True)
            print(f"| {kind} | {n} | {' | '.join(cells)} |", flush=True)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "spec.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
