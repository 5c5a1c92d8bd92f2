"""`mlxlis serve` under a 1 000-request soak over HTTP (a real server process on a tiny random
Llama): 8 clients at once, streamed and whole requests, a quarter of them through Anthropic's
/v1/messages, a random third of the clients leaving mid-stream or before their reply. Proves:
every kept request gets a whole, well-formed answer (finish reason, usage agreeing with the
tokens asked for); the checked ones (every 25th) carry exactly the reply the same request gets
alone afterwards (greedy), so no request's tokens reached another; afterwards nothing runs or
waits, the prefix cache is within its bound and MLX's memory is back at its level before the
soak, apart from what the prefix cache holds."""

from __future__ import annotations

import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_process import ServeProcess, events

pytestmark = pytest.mark.slow

REQUESTS, CLIENTS, CACHE_MB = 1000, 8, 1
WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers".split()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    (tmp / "llama_long").symlink_to(tiny("llama_long")[0])
    srv = ServeProcess(
        tmp,
        "-m",
        str(tmp / "llama_long"),
        "--max-batch",
        "8",
        "--max-queue",
        str(REQUESTS),
        "--prefix-cache-mb",
        str(CACHE_MB),
        "--chat-template",
        "chatml",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def body(i: int) -> tuple[dict, str | None]:
    """Request i (the same every time it is built) and how its client leaves, if it does."""
    rng = random.Random(i)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    req = {
        "messages": [{"role": "user", "content": words}],
        "max_tokens": rng.randint(1, 12),
        "temperature": 0,
        "stream": rng.random() < 0.5,
    }
    if req["stream"]:
        req["stream_options"] = {"include_usage": True}
    leave = None
    if rng.random() < 1 / 3:
        leave = "mid-stream" if req["stream"] else "before the reply"
    if rng.random() < 1 / 4:  # Anthropic's Messages API: no stream_options, usage at the end
        req.pop("stream_options", None)
        req["model"], req["anthropic"] = "llama_long", True
    return req, leave


STOP_REASONS = {"end_turn": "stop", "max_tokens": "length"}


def messages_reply(resp, stream: bool) -> tuple[str, str, int]:
    """(text, finish_reason in OpenAI's words, output tokens) of a /v1/messages answer."""
    if not stream:
        r = json.loads(resp.read())
        text = "".join(b["text"] for b in r["content"] if b["type"] == "text")
        return text, STOP_REASONS[r["stop_reason"]], r["usage"]["output_tokens"]
    text, reasons, used = "", [], None
    for ev in events(resp):
        if ev["type"] == "content_block_delta":
            text += ev["delta"]["text"]
        elif ev["type"] == "message_delta":
            reasons.append(STOP_REASONS[ev["delta"]["stop_reason"]])
            used = ev["usage"]["output_tokens"]
    assert len(reasons) == 1, reasons
    return text, reasons[0], used


def run(server: ServeProcess, i: int, models: tuple[str, ...] = ()) -> tuple[str, str, int] | None:
    """(content, finish_reason, completion tokens) of request i (to models[i % len(models)],
    when given), or None when its client left."""
    req, leave = body(i)
    if models:
        req["model"] = models[i % len(models)]
    path = "/v1/messages" if req.pop("anthropic", False) else "/v1/chat/completions"
    conn = server.connect()
    conn.request("POST", path, json.dumps(req).encode(), server.headers())
    if leave == "before the reply":
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        return None
    resp = conn.getresponse()
    assert resp.status == 200, (i, resp.read())
    if leave == "mid-stream":
        next(events(resp))
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        return None
    if path == "/v1/messages":
        got = messages_reply(resp, req["stream"])
        conn.close()
        return got
    if not req["stream"]:
        r = json.loads(resp.read())
        conn.close()
        c = r["choices"][0]
        assert c["finish_reason"] in ("stop", "length"), r
        return c["message"]["content"], c["finish_reason"], r["usage"]["completion_tokens"]
    content, finishes, usage = "", [], None
    for ev in events(resp):
        if ev == "[DONE]":
            break
        for ch in ev["choices"]:
            content += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finishes.append(ch["finish_reason"])
        usage = ev.get("usage") or usage
    conn.close()
    assert finishes in (["stop"], ["length"]), (i, finishes)
    return content, finishes[0], usage["completion_tokens"]


@pytest.fixture(scope="module")
def two_models(tiny, tmp_path_factory):
    """Two models (the tiny Llama's weights under two names: two loads, two engines) in one
    server, both loaded at start and kept."""
    tmp = tmp_path_factory.mktemp("soak2")
    for name in TWO:
        (tmp / name).symlink_to(tiny("llama_long")[0])
    args = [x for name in TWO for x in ("-m", f"{name}={tmp / name}")]
    srv = ServeProcess(
        tmp,
        *args,
        "--max-batch",
        "8",
        "--max-queue",
        str(REQUESTS),
        "--prefix-cache-mb",
        str(CACHE_MB),
        "--chat-template",
        "chatml",
        "--keep-alive",
        "-1",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


TWO = ("llama_a", "llama_b")


@pytest.mark.extended  # `make test-all`: the engine's soak (test_serve_engine) is in make test
def test_soak_over_http_loses_nothing_mixes_nothing_leaks_nothing(server):
    soak(server, ())


@pytest.mark.extended
def test_soak_over_two_models_loses_nothing_mixes_nothing_leaks_nothing(two_models):
    """The same soak, each request to one of two models (the second loaded by its first
    request), their engines taking turns on the MLX thread."""
    soak(two_models, TWO, caches=2)


def soak(server: ServeProcess, models: tuple[str, ...], caches: int = 1) -> None:
    for i in range(4):  # warm up: compiled kernels, buffers, the first prefix-cache entries
        run(server, 10_000 + i, models)
    before = server.wait_idle()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda i: run(server, i, models), range(REQUESTS)))
    after = server.wait_idle(timeout=120)
    kept = [i for i, r in enumerate(results) if r is not None]
    assert REQUESTS // 2 < len(kept) < REQUESTS - 200  # a third of the clients left
    for i in kept:
        _, finish, used = results[i]
        asked = body(i)[0]["max_tokens"]
        assert used == asked if finish == "length" else 0 < used <= asked, (i, results[i])
    for i in kept[::25]:  # the same request alone afterwards: the same greedy reply
        assert run(server, i, models)[0] == results[i][0], i
    assert after["prefix_cache_bytes"] <= caches * CACHE_MB << 20
    held_before = before["memory_bytes"] - before["prefix_cache_bytes"]
    held_after = after["memory_bytes"] - after["prefix_cache_bytes"]
    assert held_after <= held_before + (256 << 10), (before, after)
