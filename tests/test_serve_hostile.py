"""`mlxlis serve` as a real process against requests that once took it down or answered them
wrongly, on a tiny random Qwen2 whose head is padded past its tokenizer (as Qwen2.5's is:
151 936 rows, 151 665 tokens), started with --strict-context.

What these prove: sampling at temperature 100 (a near-uniform draw over every row of the
head, padded ones included) never yields an id the tokenizer cannot read — every request ends
normally and the server serves the next one (before, one such id ended the engine's loop and
every later request hung while /health said "ok"); with --strict-context an explicit max
field over what the context leaves is a 400 naming the field as each API calls it (Ollama's
`options.num_predict`, the official `ollama` client's error), and without it (the other
server tests) the reply is cut at the context's end; Ollama images to a model that does not
see are a 400 naming them.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import socket
import time

import ollama
import openai
import pytest
from conftest import TINY, build_tiny
from serve_process import ServeProcess

CONTEXT = 256
PAD = 64
HEAD_S = 1.0  # --head-timeout


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    folder = tmp / "padded"
    build_tiny(folder, TINY["qwen2"], pad_vocab=PAD)
    (tmp / "t.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    srv = ServeProcess(
        tmp,
        "-m",
        str(folder),
        "--max-context",
        str(CONTEXT),
        "--strict-context",
        "--head-timeout",
        str(HEAD_S),
        "--chat-template",
        str(tmp / "t.jinja"),
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def test_padded_ids_are_never_sampled(server):
    client = server.client()

    def one(seed: int) -> str:
        r = client.chat.completions.create(
            model="padded",
            messages=[{"role": "user", "content": "Hello"}],
            temperature=100,
            max_tokens=48,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == ["length"] * 4
    status, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["running"] == 0
    assert "Error" not in server.log()


def test_strict_context_names_each_apis_field(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="padded", messages=[{"role": "user", "content": "Hi"}], max_tokens=CONTEXT
        )
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "max_tokens"
    ol = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(
            model="padded",
            messages=[{"role": "user", "content": "Hi"}],
            options={"num_predict": 10**12},
            stream=False,
        )
    assert e.value.status_code == 400
    assert "options.num_predict" in e.value.error and "max_tokens" not in e.value.error


def test_ollama_images_to_a_model_that_does_not_see(server):
    ol = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    )
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(
            model="padded",
            messages=[{"role": "user", "content": "What is this?", "images": [png]}],
            stream=False,
        )
    assert e.value.status_code == 400 and "messages[0].images[0]" in e.value.error


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": " "}}]}, "tools[0].function.name"),
        ({"kv_bits": 8, "kv_group_size": 0}, "kv_group_size"),
    ],
)
def test_what_cannot_run_is_refused_by_its_field(server, change, param):
    """A tool with no function (or no name) was rendered into the prompt or accepted under
    tool_choice "required"; a KV group of 0 was read as unset (the default 64)."""
    body = {"model": "padded", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, reply = server.request("POST", "/v1/chat/completions", {**body, **change})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_a_connection_that_stalls_in_its_head_is_closed(server):
    """A client that sends part of a request's head and waits (slowloris) was held forever:
    now it is closed after --head-timeout; a connection whose requests come whole is served
    and reused meanwhile, and the server serves new ones after."""
    stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    for s in stalled:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    alive = server.connect()
    for _ in range(2):  # one connection, kept alive between its requests
        alive.request("GET", "/health")
        reply = alive.getresponse()
        assert reply.status == 200 and reply.read()
    alive.close()
    time.sleep(HEAD_S * 3)
    for s in stalled:
        s.settimeout(5)
        assert s.recv(1024) == b""  # closed by the server, nothing answered
        s.close()
    status, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok"
