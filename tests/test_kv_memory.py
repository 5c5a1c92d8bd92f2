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
from mlxlis.models.footprint import footprint, weight_bytes

import mlx.core as mx
import pytest
from conftest import TINY, build_tiny, trajectory
from serve_process import TINY_TEMPLATE, ServeProcess, events

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


# the tiny llama_long with head_dim 64 (so that KV groups of 32 and 64 divide it): dense KV
# takes 2 layers x 2 KV heads x 64 x 2 x 4 B = 2 048 B a token; 8-bit (groups of 64) 576 B
SMALL = {**TINY["llama_long"], "head_dim": 64}
PER_TOKEN = {None: 2048, KVFormat(8, 64): 576}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """That model with 11 MiB for caches beside its weights and the margin: one dense request
    of 4 002 tokens fits (7.8 MiB), two do not; an 8-bit one (2.2 MiB) fits beside it."""
    tmp = tmp_path_factory.mktemp("mem")
    build_tiny(tmp / "ll", SMALL)
    (tmp / "t.jinja").write_text(TINY_TEMPLATE)
    weights = weight_bytes(mlxlis.load(tmp / "ll", "float32"))
    cap = MARGIN + (11 << 20) + weights
    srv = ServeProcess(
        tmp,
        "-m",
        str(tmp / "ll"),
        "--chat-template",
        str(tmp / "t.jinja"),
        "--prefix-cache-mb",
        "0",
        "--max-context",
        "8192",
        "--max-batch",
        "2",
        env={"MLXLIS_MAX_MEMORY": str(cap)},
    )
    srv.cap, srv.folder = cap, tmp / "ll"
    yield srv
    assert srv.stop() == 0, srv.log()


def test_health_reports_the_memory_and_auto_context(small, tmp_path):
    _, health = small.request("GET", "/health")
    assert health["kv_format"] == "dense" and health["kv_bytes_per_token"] == PER_TOKEN[None]
    room = health["cache_room_bytes"]
    assert room == small.cap - MARGIN - health["weights_bytes"] and 10 << 20 < room < 12 << 20
    auto = ServeProcess(
        tmp_path,
        "-m",
        str(small.folder),
        "--prefix-cache-mb",
        "0",
        "--max-context",
        "auto",
        "--max-batch",
        "2",
        env={"MLXLIS_MAX_MEMORY": str(small.cap)},
    )
    try:
        _, models = auto.request("GET", "/v1/models")
        context = models["data"][0]["context_length"]
        assert context == room // 2 // PER_TOKEN[None]  # two requests, 2 KiB a token
    finally:
        assert auto.stop() == 0, auto.log()


def test_requests_that_would_outgrow_the_memory_are_refused_first(small):
    """Dense: 8 000 tokens never fit (400); a 4 000-token one runs, a second is a 503 — and an
    8-bit one (the kv_bits extension) of the same length is taken beside it, while an 8-bit
    one of 8 000 tokens is not."""
    long = {"model": "ll", "prompt": "Hi", "ignore_eos": True, "max_tokens": 8000}
    status, body = small.request("POST", "/v1/completions", long)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "max_tokens" and "memory" in body["error"]["message"]
    running = {**long, "max_tokens": 4000, "stream": True}
    conn, resp = small.open_stream("/v1/completions", running)
    assert next(events(resp))["choices"]  # it runs: it holds 4 002 tokens' caches
    status, body, retry = post(small, running)
    assert status == 503 and retry is not None and body["error"]["code"] == "memory_full"
    status, body, _ = post(small, {**long, "kv_bits": 8, "stream": False})
    assert status == 503 and body["error"]["code"] == "memory_full"  # alone it would fit
    other, quantized = small.open_stream("/v1/completions", {**running, "kv_bits": 8})
    assert next(events(quantized))["choices"]  # taken: 4 002 tokens at 576 B fit beside
    other.close()
    stream = events(resp)
    assert all(next(stream)["choices"][0]["text"] is not None for _ in range(8))  # goes on
    conn.close()
    small.wait_idle()
    ran = [x for x in small.log().splitlines() if " prompt=" in x and "generated=" in x]
    assert len(ran) == 2, small.log()  # the refused requests never reached the engine


def post(srv, body: dict) -> tuple[int, dict, str | None]:
    c = srv.connect()
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=srv.headers())
    r = c.getresponse()
    out = json.loads(r.read())
    c.close()
    return r.status, out, r.getheader("Retry-After")


def test_a_requests_kv_format_is_checked_in_every_api(small):
    """The kv_bits / kv_group_size extension through the official clients: bits MLX does not
    quantize with, a group size beside full precision (16), a group that does not divide the
    head dimension (64, in groups of 128) and a group size with no bits on a dense server are
    each a 400 naming the field in the API's own error shape; kv_bits 8 is answered."""
    import anthropic
    import ollama
    import openai

    url = f"http://127.0.0.1:{small.port}"
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="ll", messages=hi, max_tokens=2, extra_body={"kv_bits": 5})
    assert e.value.body["param"] == "kv_bits"
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(
            model="ll",
            input="Hi",
            max_output_tokens=2,
            extra_body={"kv_bits": 16, "kv_group_size": 32},
        )
    assert e.value.body["param"] == "kv_group_size"
    an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(
            model="ll", messages=hi, max_tokens=2, extra_body={"kv_bits": 8, "kv_group_size": 128}
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("kv_group_size: head_dim 64")
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).chat(model="ll", messages=hi, options={"kv_group_size": 32})
    assert e.value.status_code == 400 and e.value.error.startswith("options.kv_group_size:")
    done = oa.completions.create(model="ll", prompt="Hi", max_tokens=3, extra_body={"kv_bits": 8})
    assert done.usage.completion_tokens <= 3 and done.choices[0].finish_reason


def test_a_model_larger_than_the_memory_is_refused_before_loading(small, monkeypatch):
    """MLXLIS_MAX_MEMORY below the weights' stored bytes: load is a TooLargeError naming the
    folder and both sizes, raised from the headers (no weight read: MLX's active memory does
    not grow)."""
    from mlxlis.errors import TooLargeError

    monkeypatch.setenv("MLXLIS_MAX_MEMORY", "64K")
    before = mx.get_active_memory()
    with pytest.raises(TooLargeError) as e:
        mlxlis.load(small.folder, "float32")
    assert str(small.folder) in str(e.value) and "0.00 GiB this process may fill" in str(e.value)
    assert mx.get_active_memory() == before
