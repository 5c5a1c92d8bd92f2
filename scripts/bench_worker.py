"""One benchmark measurement in a fresh process (so peak memory is this engine's alone).

usage: bench_worker.py ENGINE MODEL_PATH PROMPT_IDS_JSON DECODE_TOKENS [ROWS]
ENGINE: mlxlis | mlxlis-dense (a GGUF's blocks made dense) | mlx-lm | llama.cpp. Prints one
JSON object. ROWS > 1 (mlxlis only): that many sequences decoding together (the server's
batched step), decode tok/s counting every row's tokens.

One pass: load; prefill all prompt ids but the last into the cache (prefill tok/s); then
stream greedy tokens from the last id (time to first token = prefill + first step; decode
tok/s over tokens 2..N).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

if sys.argv[1] not in ("mlxlis", "mlxlis-dense"):
    # peers get the same OpenBLAS sgemm (far faster than MLX's bundled BLAS), not mlxlis's own
    # matrix-vector routing (mlxlis/_blas_dispatch.c) nor its allocator setting, which are
    # part of what is measured
    os.environ["MLXLIS_BLAS_GEMV"] = "0"

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)

if sys.argv[1] in ("mlxlis", "mlxlis-dense"):
    mlxlis.runtime.device.setup_process()  # as the mlxlis commands do


def rss_peak() -> int:
    """Peak resident memory of this process in bytes.

    Linux: VmHWM (the mm's high-water mark; ru_maxrss would carry over the parent's size
    across fork + exec). macOS: ru_maxrss (bytes there).
    """
    from mlxlis.runtime.device import proc_bytes

    peak = proc_bytes("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


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


def measure(prefill, stream, n_prompt: int, n_decode: int, t0: float) -> dict:
    prefill()
    t1 = time.perf_counter()
    t_first = None
    count = 0
    for _ in stream():
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
        if count >= n_decode:
            break
    t_end = time.perf_counter()
    return {
        "prefill_tps": (n_prompt - 1) / (t1 - t0),
        "ttft_s": t_first - t0,
        "decode_tps": (count - 1) / (t_end - t_first),
        "generated": count,
    }


def bench_mlxlis(path: str, ids: list[int], n: int, dequantize: bool | None = None) -> dict:
    from mlxlis.generation.generate import generate
    from mlxlis.generation.steps import prefill

    import mlx.core as mx

    t = time.perf_counter()
    model = mlxlis.load(path, dequantize=dequantize)
    load_s, load_rss = time.perf_counter() - t, rss_peak()
    if ROWS > 1:
        return {"load_s": load_s, "load_peak_rss": load_rss, **rows(model, ids, n, ROWS)}
    cache = model.make_cache()

    def stream():
        return (
            e
            for e in generate(
                model, ids[-1:], max_tokens=n, stop_ids=set(), cache=cache, history=ids[:-1]
            )
            if e.token is not None
        )

    out = measure(
        lambda: mx.eval(prefill(model.net, ids[:-1], cache)),
        stream,
        len(ids),
        n,
        time.perf_counter(),
    )
    return {
        "load_s": load_s,
        "load_peak_rss": load_rss,
        **out,
        "bytes_per_token": weight_bytes_per_token(model.net),
    }


def rows(model, ids: list[int], n: int, b: int) -> dict:
    """b sequences (the prompt, each shifted by a token) decoding together for n steps."""
    from mlxlis.generation.steps import prefill

    import mlx.core as mx

    caches = [model.make_cache() for _ in range(b)]
    t0 = time.perf_counter()
    for i, c in enumerate(caches):
        mx.eval(prefill(model.net, ids[i : len(ids) - b + i], c))
    t1 = time.perf_counter()
    tokens = mx.array(ids[len(ids) - b :])
    for step in range(n):
        if step == 1:
            t2 = time.perf_counter()
        tokens = model.net.decode_batch(tokens, caches).argmax(-1)
        mx.eval(tokens)
    t3 = time.perf_counter()
    return {
        "prefill_tps": b * (len(ids) - b) / (t1 - t0),
        "ttft_s": t2 - t0,
        "decode_tps": b * (n - 1) / (t3 - t2),
        "generated": b * n,
        "bytes_per_token": weight_bytes_per_token(model.net),
    }


def bench_mlx_lm(path: str, ids: list[int], n: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    t = time.perf_counter()
    model, _ = load(path)
    load_s, load_rss = time.perf_counter() - t, rss_peak()
    cache = make_prompt_cache(model)
    prompt = mx.array(ids)

    def prefill():
        for i in range(0, len(ids) - 1, 2048):  # mlx-lm's own prefill step size
            model(prompt[None, i : min(i + 2048, len(ids) - 1)], cache=cache)
            mx.eval([c.state for c in cache])

    out = measure(
        prefill,
        lambda: generate_step(prompt[-1:], model, max_tokens=n, prompt_cache=cache),
        len(ids),
        n,
        time.perf_counter(),
    )
    return {
        "load_s": load_s,
        "load_peak_rss": load_rss,
        **out,
        "bytes_per_token": weight_bytes_per_token(model),
    }


def bench_llama_cpp(path: str, ids: list[int], n: int) -> dict:
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=len(ids) + n + 8, n_threads=os.cpu_count(), verbose=False)
    load_s, load_rss = time.perf_counter() - t, rss_peak()
    out = measure(
        lambda: llm.eval(ids[:-1]),
        lambda: llm.generate(ids[-1:], temp=0.0, top_k=1, reset=False),
        len(ids),
        n,
        time.perf_counter(),
    )
    size = os.path.getsize(path)  # approximation: the whole file (its embedding included)
    return {"load_s": load_s, "load_peak_rss": load_rss, **out, "bytes_per_token": size}


ENGINES = {
    "mlxlis": bench_mlxlis,
    "mlxlis-dense": lambda *a: bench_mlxlis(*a, dequantize=True),
    "mlx-lm": bench_mlx_lm,
    "llama.cpp": bench_llama_cpp,
}
ROWS = int(sys.argv[5]) if len(sys.argv) > 5 else 1

if __name__ == "__main__":
    engine, path, ids_json, n_decode = sys.argv[1:5]
    with open(ids_json) as f:
        prompt_ids = json.load(f)
    result = ENGINES[engine](path, prompt_ids, int(n_decode))
    result["peak_rss"] = rss_peak()
    print(json.dumps(result))
