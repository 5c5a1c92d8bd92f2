"""One benchmark measurement in a fresh process (so peak memory is this engine's alone).

usage: bench_worker.py ENGINE MODEL_PATH PROMPT_IDS_JSON [DTYPE]
ENGINE: mlxlis | mlx-lm | llama.cpp. Prints one JSON object.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import mlxlis  # noqa: F401  (preloads the system BLAS: every engine measured gets the same one)

DECODE_TOKENS = 128


def rss_peak() -> int:
    """Peak resident memory of this process in bytes.

    Linux: VmHWM (the mm's high-water mark; ru_maxrss would carry over the parent's size
    across fork + exec). macOS: ru_maxrss (bytes there).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def weight_bytes_per_token(net) -> int:
    """Bytes of weights read to decode one token: every parameter, except that an untied
    embedding table contributes one row (a lookup), not the whole table."""
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for _, v in tree_flatten(net.parameters()))
    if hasattr(net, "lm_head"):  # untied: the embedding is only indexed
        emb = net.model.embed_tokens
        size = sum(v.nbytes for _, v in tree_flatten(emb.parameters()))
        total -= size - size // emb.weight.shape[0]
    return total


def timed_stream(stream, n: int) -> dict:
    """TTFT = time to the first token (prefill + first step); decode = tokens 2..n."""
    t0 = time.perf_counter()
    t_first = None
    count = 0
    for _ in stream:
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
        if count >= n:
            break
    t_end = time.perf_counter()
    return {
        "ttft_s": t_first - t0,
        "decode_tps": (count - 1) / (t_end - t_first),
        "generated": count,
    }


def bench_mlxlis(path: str, ids: list[int], dtype: str | None) -> dict:
    t = time.perf_counter()
    model = mlxlis.load(path, dtype)
    load_s = time.perf_counter() - t
    load_rss = rss_peak()
    stream = (
        e
        for e in mlxlis.generate(model, ids, max_tokens=DECODE_TOKENS, stop_ids=set())
        if e.token is not None
    )
    out = timed_stream(stream, DECODE_TOKENS)
    out["prefill_tps"] = _prefill_tps_mlxlis(model, ids)
    return {
        "load_s": load_s,
        "load_peak_rss": load_rss,
        **out,
        "dtype": str(model.dtype),
        "bytes_per_token": weight_bytes_per_token(model.net),
    }


def _prefill_tps_mlxlis(model, ids: list[int]) -> float:
    from mlxlis.generate import prefill

    import mlx.core as mx

    best = 0.0
    for _ in range(2):
        cache = model.make_cache()
        t = time.perf_counter()
        mx.eval(prefill(model.net, ids, cache))
        best = max(best, len(ids) / (time.perf_counter() - t))
    return best


def bench_mlx_lm(path: str, ids: list[int], dtype: str | None) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    t = time.perf_counter()
    model, _ = load(path)
    load_s = time.perf_counter() - t
    load_rss = rss_peak()
    prompt = mx.array(ids)
    out = timed_stream(generate_step(prompt, model, max_tokens=DECODE_TOKENS), DECODE_TOKENS)
    best = 0.0
    for _ in range(2):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        mx.eval(model(prompt[None], cache=cache)[:, -1])
        best = max(best, len(ids) / (time.perf_counter() - t))
    out["prefill_tps"] = best
    return {
        "load_s": load_s,
        "load_peak_rss": load_rss,
        **out,
        "bytes_per_token": weight_bytes_per_token(model),
    }


def bench_llama_cpp(path: str, ids: list[int], dtype: str | None) -> dict:
    import os

    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(
        model_path=path,
        n_ctx=len(ids) + DECODE_TOKENS + 8,
        n_threads=os.cpu_count(),
        verbose=False,
        logits_all=False,
    )
    load_s = time.perf_counter() - t
    load_rss = rss_peak()
    out = timed_stream(llm.generate(ids, temp=0.0, top_k=1, reset=True), DECODE_TOKENS)
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    out["prefill_tps"] = len(ids) / (time.perf_counter() - t)
    size = os.path.getsize(path)  # approximation: the whole file (its embedding included)
    return {"load_s": load_s, "load_peak_rss": load_rss, **out, "bytes_per_token": size}


ENGINES = {"mlxlis": bench_mlxlis, "mlx-lm": bench_mlx_lm, "llama.cpp": bench_llama_cpp}

if __name__ == "__main__":
    engine, path, ids_json = sys.argv[1:4]
    dtype = sys.argv[4] if len(sys.argv) > 4 else None
    ids = json.loads(open(ids_json).read())
    result = ENGINES[engine](path, ids, dtype)
    result["peak_rss"] = rss_peak()
    print(json.dumps(result))
