"""Numeric fingerprint of the engine, for refactors that must not change a bit.

usage: python scripts/fingerprint.py save FILE.npz   (before the change)
       python scripts/fingerprint.py check FILE.npz  (after: every array bit-identical)

For one tiny random checkpoint of every family (built once with transformers into
$MLXLIS_FINGERPRINT_MODELS, default /tmp/mlxlis-fingerprint, so both runs read the same
weights) in float32 and float16, and for the three catalog models in float32, it records: the
full-forward logits of a fixed trajectory, the logits of a cached decode (prompt prefilled,
then one token at a time), greedy tokens through `mlxlis.generate` (a prompt longer than every
sliding window), seeded sampled tokens with the repetition penalty, and greedy tokens with
their log-probabilities from the serving engine decoding 4 requests as one batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("MLXLIS_DEVICE", "cpu")

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

MODELS = Path(os.environ.get("MLXLIS_FINGERPRINT_MODELS", "/tmp/mlxlis-fingerprint"))
CATALOG = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


def tiny_specs() -> dict[str, tuple[dict, object]]:
    from conftest import TINY, build_tiny
    from test_gemma4 import SPECS as G4
    from test_gemma4 import build as build_g4
    from test_gemma_parity import SPECS as GEMMA
    from test_qwen3 import SPECS as QWEN3
    from test_qwen3_5 import SPECS as Q35
    from test_qwen3_5 import build as build_q35

    return {
        "llama": (TINY["llama"], build_tiny),
        "llama3_tied": (TINY["llama3_tied"], build_tiny),
        "qwen2": (TINY["qwen2"], build_tiny),
        "qwen3": (QWEN3["qwen3"], build_tiny),
        "qwen3_moe": (QWEN3["qwen3_moe"], build_tiny),
        **{
            g: ({"kind": g, "pad_token_id": 0, **GEMMA[g]}, build_tiny)
            for g in ("gemma", "gemma2", "gemma3")
        },
        "qwen3_5": (Q35["qwen3_5"], build_q35),
        "qwen3_5_moe": (Q35["qwen3_5_moe"], build_q35),
        "gemma4": (G4["all"], build_g4),
    }


def tiny_folder(name: str, spec: dict, build) -> Path:
    folder = MODELS / name
    if not (folder / "config.json").is_file():
        build(folder, spec)
    return folder


def trajectory(n: int, seed: int, vocab: int) -> list[int]:
    from conftest import trajectory as t

    return t(n, seed=seed, vocab=vocab)


def cached_decode(model, ids: list[int], split: int) -> np.ndarray:
    """Logits of ids[split:], fed one at a time after ids[:split] was prefilled."""
    cache = model.make_cache()
    out = [model.net(mx.array([ids[:split]]), cache=cache)[0, -1:]]
    for t in ids[split:-1]:
        out.append(model.net(mx.array([[t]]), cache=cache)[0, -1:])
    return np.array(mx.concatenate(out).astype(mx.float32))


def greedy(model, ids: list[int], n: int, **kw) -> list[int]:
    return [
        e.token
        for e in mlxlis.generate(model, ids, max_tokens=n, stop_ids=set(), **kw)
        if e.token is not None
    ]


def batched(model, prompts: list[list[int]], n: int) -> tuple[list[int], list[float]]:
    from mlxlis.generation.core import Request
    from mlxlis.generation.engine import Engine
    from mlxlis.generation.sampling import SamplingParams

    engine = Engine(model, max_active=8, prefix_cache_bytes=0)
    try:
        streams = [
            engine.submit(Request(p, SamplingParams(max_tokens=n), top_logprobs=0)) for p in prompts
        ]
        toks, logps = [], []
        for s in streams:
            for e in s:
                if e.token is not None:
                    toks.append(e.token)
                    logps.append(e.logprob)
    finally:
        engine.shutdown()
    return toks, logps


def record(out: dict, key: str, model, vocab: int, long_n: int) -> None:
    ids = trajectory(long_n, 1, vocab)
    out[f"{key}/logits"] = np.array(model.logits(ids))
    out[f"{key}/cached"] = cached_decode(model, ids, long_n // 2)
    out[f"{key}/greedy"] = np.array(greedy(model, ids, 24))
    out[f"{key}/sampled"] = np.array(
        greedy(
            model,
            ids[:20],
            24,
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=3,
            repetition_penalty=1.1,
        )
    )
    prompts = [trajectory(n, s, vocab) for s, n in enumerate((5, 17, 33, 9))]
    toks, logps = batched(model, prompts, 12)
    out[f"{key}/batched_tokens"] = np.array(toks)
    out[f"{key}/batched_logprobs"] = np.array(logps, dtype=np.float64)


def fingerprint(tiny_only: bool = False) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, (spec, build) in tiny_specs().items():
        folder = tiny_folder(name, spec, build)
        for dtype in ("float32", "float16"):
            model = mlxlis.load(folder, dtype)
            try:
                record(out, f"{name}/{dtype}", model, model.config.vocab_size, 48)
            except RuntimeError as e:  # MLX's CPU gather_mm is float32 only (the MoE families)
                print(f"{name} {dtype}: skipped ({e})", flush=True)
                continue
            print(f"{name} {dtype}", flush=True)
    if not tiny_only:
        for name in CATALOG:
            model = mlxlis.load(name, "float32")
            record(out, f"{name}/float32", model, 2000, 40)
            print(name, flush=True)
    return out


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("save", "check"):
        print(__doc__)
        return 2
    mode, path = sys.argv[1], Path(sys.argv[2])
    got = fingerprint("--tiny" in sys.argv[3:])
    if mode == "save":
        np.savez(path, **got)
        print(f"saved {len(got)} arrays to {path}")
        return 0
    want = dict(np.load(path))
    bad = 0
    for key in sorted(set(want) | set(got)):
        if key not in got or key not in want:
            print(f"MISSING {key}")
            bad += 1
            continue
        a, b = want[key], got[key]
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            diff = (
                float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                if a.shape == b.shape
                else float("nan")
            )
            print(f"DIFFERS {key}: shape {a.shape} vs {b.shape}, max |Δ| {diff:.3g}")
            bad += 1
    print(f"{len(want) - bad} of {len(want)} arrays bit-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
