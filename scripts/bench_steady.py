"""Steady state, one engine in one process: the model loaded once, then rounds of a PREFILL-token
prefill into a fresh cache and DECODE greedy tokens after it; prints one JSON object with the
first round's prefill (what a one-shot command pays) and the best round's prefill and decode.

usage: bench_steady.py ENGINE MODEL_PATH PROMPT_IDS_JSON PREFILL DECODE ROUNDS
ENGINE: mlxlis | llama.cpp (llama-cpp-python; threads = the CPUs this process may use)
"""

from __future__ import annotations

import json
import os
import sys
import time

if sys.argv[1] != "mlxlis":
    os.environ["MLXLIS_BLAS_GEMV"] = "0"  # peers get plain OpenBLAS (see bench_worker.py)

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)


def threads() -> int:
    return len(os.sched_getaffinity(0))


def mlxlis_rounds(path: str, ids: list[int], n: int, rounds: int) -> list[dict]:
    from mlxlis.generation.generate import generate
    from mlxlis.generation.steps import prefill

    import mlx.core as mx

    mlxlis.runtime.device.setup_process()  # as the mlxlis commands do
    model = mlxlis.load(path)
    out = []
    for _ in range(rounds):
        cache = model.make_cache()
        t0 = time.perf_counter()
        mx.eval(prefill(model.net, ids[:-1], cache))
        t1 = time.perf_counter()
        steps = generate(
            model, ids[-1:], max_tokens=n, stop_ids=set(), cache=cache, history=ids[:-1]
        )
        out.append({"prefill_s": t1 - t0, **decode_time(e for e in steps if e.token is not None)})
    return out


def llama_rounds(path: str, ids: list[int], n: int, rounds: int) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=path,
        n_ctx=len(ids) + n + 8,
        n_threads=threads(),
        n_threads_batch=threads(),
        n_batch=512,
        n_ubatch=512,
        verbose=False,
    )
    out = []
    for _ in range(rounds):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:-1])
        t1 = time.perf_counter()
        steps = llm.generate(ids[-1:], temp=0.0, top_k=1, reset=False)
        out.append({"prefill_s": t1 - t0, **decode_time(steps, n)})
    return out


def decode_time(steps, n: int | None = None) -> dict:
    """Seconds for tokens 2..n (the first carries the last prompt token's step)."""
    count, t_first = 0, 0.0
    for _ in steps:
        count += 1
        if count == 1:
            t_first = time.perf_counter()
        if n is not None and count >= n:
            break
    return {"decode_s": time.perf_counter() - t_first, "decoded": count - 1}


if __name__ == "__main__":
    engine, path, ids_json, n_prefill, n_decode, n_rounds = sys.argv[1:7]
    with open(ids_json) as f:
        ids = json.load(f)[: int(n_prefill) + 1]
    run = mlxlis_rounds if engine == "mlxlis" else llama_rounds
    got = run(path, ids, int(n_decode), int(n_rounds))
    prefill = [(len(ids) - 1) / r["prefill_s"] for r in got]
    decode = [r["decoded"] / r["decode_s"] for r in got if r["decoded"] > 0]
    print(
        json.dumps(
            {
                "engine": engine,
                "threads": threads(),
                "first_prefill_tps": prefill[0],
                "prefill_tps": max(prefill),
                "decode_tps": max(decode) if decode else 0.0,
            }
        )
    )
