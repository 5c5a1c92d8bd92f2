"""`mlxlis serve` as a real process, its limits and its end: an API key, a model without a
chat template, a full queue (429) and SIGTERM while a reply streams. One tiny-model server
(no template, --api-key, --max-batch 1 --max-queue 1) for the module; the SIGTERM test comes
last and ends it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlxlis

import openai
import pytest
from serve_process import STARTUP_S, ServeProcess, events

KEY = "test-key-123"
LONG = {"prompt": "Hello", "ignore_eos": True, "max_tokens": 100_000, "stream": True}


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "llama_long").symlink_to(tiny("llama_long")[0])  # served as "llama_long"
    srv = ServeProcess(
        tmp, "-m", str(tmp / "llama_long"), "--max-batch", "1", "--max-queue", "1", api_key=KEY
    )
    yield srv
    srv.stop()


def test_bad_flags_exit_2(server):
    """Out-of-range flags, a --max-context over the model's own, a malformed --alias or
    --keep-alive, a --models-dir that is no folder, and several models under mlx.launch (a
    pipelined server serves one) end `mlxlis serve` with status 2 and one line naming the flag
    (before anything listens)."""
    launched = {**os.environ, "MLX_RANK": "0"}
    for flags, flag, env in (
        (["--max-batch", "0"], "--max-batch", None),
        (["--port", "70000"], "--port", None),
        (["--prefix-cache-mb", "-1"], "--prefix-cache-mb", None),
        (["-m", server.model, "--max-context", "999999999"], "--max-context", None),
        (["-m", server.model, "--alias", "claude-haiku"], "--alias", None),
        (["-m", server.model, "--keep-alive", "soon"], "--keep-alive", None),
        (["-m", server.model, "--models-dir", str(Path(server.model) / "x")], "--models-dir", None),
        (["-m", server.model, "-m", server.model], "-m", launched),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "mlxlis", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=STARTUP_S,
            env=env,
        )
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_keep_alive_forever_holds_for_models_loaded_on_demand(tiny, tmp_path):
    """`--keep-alive -1`: a model loaded on demand never expires, as the first -m does
    (/health's expires_in_s), not the 5 minutes of a server without the flag."""
    for name in "ab":  # two paths: two models (one path under two names would be one)
        (tmp_path / name).symlink_to(tiny("llama_long")[0])
    a, b = f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"
    srv = ServeProcess(tmp_path, "-m", a, "-m", b, "--keep-alive", "-1")
    try:
        status, _ = srv.request(
            "POST", "/v1/completions", {"model": "b", "prompt": "Hi", "max_tokens": 1}
        )
        assert status == 200
        kept = srv.request("GET", "/health")[1]["loaded"]
        assert kept["a"]["expires_in_s"] is None and kept["b"]["expires_in_s"] is None
    finally:
        assert srv.stop() == 0, srv.log()


def test_api_key_is_required(server):
    """With --api-key, a request without `Authorization: Bearer KEY` or with another key gets
    401 invalid_api_key; the right key is served; /health needs no key."""
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    status, body = server.request("GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    status, _ = server.request(
        "POST", "/v1/completions", {"prompt": "Hi"}, headers={"Authorization": "Basic " + KEY}
    )
    assert status == 401
    assert [m.id for m in server.client().models.list().data] == ["llama_long"]
    assert server.request("GET", "/health", headers={"Authorization": ""})[0] == 200


def test_anthropic_clients_key_is_x_api_key(server):
    """Anthropic's client sends the key as `x-api-key`: the right one passes (to the missing
    template's 400 on this server), a wrong one is 401 authentication_error in Anthropic's
    error shape."""
    import anthropic

    url = f"http://127.0.0.1:{server.port}"
    body = {"model": "llama_long", "messages": [{"role": "user", "content": "Hi"}]}
    good = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        good.messages.count_tokens(**body)
    assert e.value.body["error"]["message"].startswith("No chat template")
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            **body
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"


def test_ollama_routes_take_the_bearer_key(server):
    """Ollama's routes: 401 in Ollama's error shape (`{"error": …}` alone) without the key,
    served to the ollama client given the key as a header; `GET /` (clients probe it) needs
    none."""
    import ollama

    status, body = server.request("GET", "/api/tags", headers={"Authorization": ""})
    assert status == 401 and list(body) == ["error"]
    url = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    names = [m.model for m in ollama.Client(host=url, headers=auth).list().models]
    assert names == ["llama_long:latest"]
    conn = server.connect()
    conn.request("GET", "/")
    assert conn.getresponse().status == 200
    conn.close()


def test_chat_without_template_is_400_with_the_diagnosis(server):
    """A model without a chat template answers a chat request with a 400 whose message is
    the diagnosis `mlxlis chat` prints (no template is guessed); /v1/completions still
    works on the same model."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="llama_long", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    diagnosis = mlxlis.load(server.model, "float32").missing_template_diagnosis()
    assert e.value.body["message"] == diagnosis and e.value.body["code"] == "no_chat_template"
    r = client.completions.create(model="llama_long", prompt="Hi", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_full_queue_is_429(server):
    """With --max-batch 1 --max-queue 1, a third request while one runs and one waits gets
    429 (the client sees RateLimitError); once both leave, the engine holds nothing and the
    next request is served."""
    running, resp = server.open_stream("/v1/completions", LONG)
    next(events(resp))  # it generates: it holds the one place
    waiting, _ = server.open_stream("/v1/completions", LONG)  # headers: it was queued
    with pytest.raises(openai.RateLimitError) as e:
        server.client().completions.create(model="llama_long", prompt="Hi", max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    for conn in (running, waiting):
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    server.wait_idle()
    r = server.client().completions.create(model="llama_long", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_sigterm_mid_stream_ends_streams_and_exits_cleanly(server):
    """SIGTERM while a reply streams: the stream ends with an error event (the openai client
    raises APIError saying the server is shutting down), the process exits with status 0,
    and its log says it stopped. (Runs last: it ends the module's server.)"""
    stream = server.client().completions.create(
        model="llama_long",
        prompt="Hello",
        stream=True,
        max_tokens=100_000,
        extra_body={"ignore_eos": True},
    )
    got = 0
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            got += 1
            if got == 5:
                server.proc.send_signal(signal.SIGTERM)
    assert "shutting down" in str(e.value)
    assert server.stop() == 0
    assert server.log().rstrip().endswith("mlxlis serve: stopped"), server.log()[-2000:]
