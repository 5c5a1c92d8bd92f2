"""The memory a context takes, and a server that never starts what would outgrow its memory
(mlxlis/models/footprint.py, runtime/memory.py, the engine's MemoryPlan).

What is proved here:
- the footprint's KV bytes per token equal the format's arithmetic (2 x layers x KV heads x
  head_dim x bytes per element: 4 dense float32, bits/8 plus a scale and a bias per group
  quantized), and a 4 000-token context's caches, measured by MLX's own counter of live
  arrays, are within 5 % of `kv_bytes(4000)` at each format (the 256-position growth steps
  are the difference);
- `mlxlis serve` under MLXLIS_MAX_MEMORY: /health reports the KV format, bytes per token and
  the room for caches; `--max-context auto` is the longest context --max-batch requests fit;
  a request whose caches could never fit is a 400 `context_length_exceeded` naming
  max_tokens, one that would not fit beside a running request a 503 with Retry-After — both
  refused before the engine takes them (nothing of theirs runs: the log has no line of a
  request that ran for them), and the running one is undisturbed.
"""

from __future__ import annotations

import gc
import json

import mlxlis
from mlxlis.cache import KVFormat
from mlxlis.generation.steps import prefill
from mlxlis.models.footprint import footprint

import mlx.core as mx
import pytest
from conftest import TINY, build_tiny, trajectory
from serve_process import ServeProcess, events

MARGIN = 256 << 20  # serve/server.py MARGIN_BYTES: kept free for transient arrays


@pytest.mark.parametrize("fmt", [None, KVFormat(8, 64), KVFormat(4, 64)], ids=str)
def test_kv_bytes_per_token_and_a_4000_token_context_as_measured(fmt, tmp_path):
    spec = {**TINY["llama"], "head_dim": 64, "max_position_embeddings": 8192}
    spec["num_hidden_layers"] = 1  # the arithmetic is per layer; one keeps the prefill short
    build_tiny(tmp_path / "m", spec)
    model = mlxlis.load(tmp_path / "m", "float32", kv_bits=fmt and fmt.bits)
    fp = footprint(model)
    per_element = 4 if fmt is None else fmt.bytes_per_element(mx.float32)
    layers, kv, hd = spec["num_hidden_layers"], spec["num_key_value_heads"], 64
    assert fp.per_token == 2 * layers * kv * hd * per_element
    ids = trajectory(4000, vocab=model.config.vocab_size)
    gc.collect()
    before = mx.get_active_memory()
    caches = model.make_cache()
    mx.eval(prefill(model.net, ids, caches))
    gc.collect()
    held = mx.get_active_memory() - before
    assert sum(a.nbytes for c in caches for a in c.state) <= held
    assert abs(held - fp.kv_bytes(4000)) <= 0.05 * fp.kv_bytes(4000)


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    """The tiny llama_long (512 B of dense KV per token) with 3.5 MiB for caches beside its
    weights and the margin: one request of 4 002 tokens fits (2 MiB), two do not."""
    tmp = tmp_path_factory.mktemp("mem")
    (tmp / "ll").symlink_to(tiny("llama_long")[0])
    cap = MARGIN + (3 << 20) + (512 << 10) + (400 << 10)  # margin, caches, ~the weights
    srv = ServeProcess(
        tmp,
        "-m",
        str(tmp / "ll"),
        "--prefix-cache-mb",
        "0",
        "--max-context",
        "8192",
        "--max-batch",
        "2",
        env={"MLXLIS_MAX_MEMORY": str(cap)},
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def test_health_reports_the_memory_and_auto_context(small, tiny, tmp_path):
    _, health = small.request("GET", "/health")
    assert health["kv_format"] == "dense" and health["kv_bytes_per_token"] == 512
    room = health["cache_room_bytes"]
    assert 3 << 20 <= room <= 4 << 20
    (tmp_path / "ll").symlink_to(tiny("llama_long")[0])
    cap = MARGIN + room + health["weights_bytes"]
    auto = ServeProcess(
        tmp_path,
        "-m",
        str(tmp_path / "ll"),
        "--prefix-cache-mb",
        "0",
        "--max-context",
        "auto",
        "--max-batch",
        "2",
        env={"MLXLIS_MAX_MEMORY": str(cap)},
    )
    try:
        _, models = auto.request("GET", "/v1/models")
        context = models["data"][0]["context_length"]
        _, health = auto.request("GET", "/health")
        assert context == health["cache_room_bytes"] // 2 // 512  # two requests, 512 B a token
    finally:
        assert auto.stop() == 0, auto.log()


def test_requests_that_would_outgrow_the_memory_are_refused_first(small):
    long = {"model": "ll", "prompt": "Hi", "ignore_eos": True, "max_tokens": 8000}
    status, body = small.request("POST", "/v1/completions", long)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "max_tokens" and "memory" in body["error"]["message"]
    running = {**long, "max_tokens": 4000, "stream": True}
    conn, resp = small.open_stream("/v1/completions", running)
    assert next(events(resp))["choices"]  # it runs: it holds 4 002 tokens' caches
    c = small.connect()
    c.request("POST", "/v1/completions", body=json.dumps(running).encode(), headers=small.headers())
    r = c.getresponse()
    body = json.loads(r.read())
    c.close()
    assert r.status == 503 and r.getheader("Retry-After") is not None
    assert body["error"]["code"] == "memory_full"
    stream = events(resp)
    assert all(next(stream)["choices"][0]["text"] is not None for _ in range(8))  # goes on
    conn.close()
    small.wait_idle()
    ran = [x for x in small.log().splitlines() if " prompt=" in x and "generated=" in x]
    assert len(ran) == 1, small.log()  # only the running request ever reached the engine
