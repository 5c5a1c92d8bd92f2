"""`mlxlis serve` as a real process for the server tests: started on a free port (--port 0,
the port read from its first log line), driven over HTTP, stopped by a signal."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the tiny server's chat template: ChatML with a tool list, past tool calls and Qwen3's
# enable_thinking switch (shared by the API tests: one process for all of them)
TINY_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)
TINY_CONTEXT = 4096
TINY_ORIGINS = ("http://good.example", "http://other.example:8080")
STARTUP_S = 180.0  # hang guards, not speed checks: a busy 2-core machine loads slowly
STOP_S = 60.0


class ServeProcess:
    def __init__(
        self,
        folder: Path,
        *args: str,
        api_key: str | None = None,
        ranks: int = 1,
        env: dict[str, str] | None = None,
    ):
        """`ranks` > 1: under `mlx.launch` (ring over loopback), in a session of its own."""
        self.api_key = api_key
        self.model = args[args.index("-m") + 1] if "-m" in args else None
        self.log_path = folder / "serve.log"
        cmd = [sys.executable, "-m", "mlxlis", "serve", "--port", "0", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        if ranks > 1:
            from launch import command

            cmd = command(ranks, *cmd)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, **(env or {})},
                start_new_session=ranks > 1,
            )
        self.port = self._wait_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _wait_port(self) -> int:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if m := re.search(r" on http://[^ ]+:(\d+) ", self.log()):
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise AssertionError(f"mlxlis serve exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"mlxlis serve did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_line(self, pattern: str, skip: int = 0, timeout: float = 60.0) -> str:
        """The first log line after the first `skip` matching `pattern` (a regex), waiting
        for it to be written."""
        deadline = time.monotonic() + timeout
        while not (found := [x for x in self.log().splitlines()[skip:] if re.search(pattern, x)]):
            assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{self.log()}"
            time.sleep(0.05)
        return found[0]

    def client(self, **kw: Any):
        import openai

        kw.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, timeout=120, **kw)

    def anthropic_client(self, **kw: Any):
        import anthropic

        kw.setdefault("api_key", self.api_key or "unused")
        url = f"http://127.0.0.1:{self.port}"
        return anthropic.Anthropic(base_url=url, max_retries=0, timeout=120, **kw)

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def headers(self, auth: bool = True) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """(status, parsed JSON body) of one raw request; `body` as bytes is sent as it is."""
        conn = self.connect()
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=self.headers() | (headers or {}))
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()

    def open_stream(
        self, path: str, body: dict
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A streaming request whose events the caller reads (`events`) and may abandon."""
        conn = self.connect()
        conn.request("POST", path, body=json.dumps(body).encode(), headers=self.headers())
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return conn, resp

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """/health once nothing runs or waits (the engine let every request go)."""
        deadline = time.monotonic() + timeout
        while True:
            status, health = self.request("GET", "/health")
            if health["running"] == 0 and health["waiting"] == 0:
                return health
            assert time.monotonic() < deadline, f"requests still held: {health}"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"mlxlis serve did not stop on {sig}:\n{self.log()}") from None
        return self.proc.returncode


def events(resp: http.client.HTTPResponse):
    """The `data:` payloads of a server-sent event stream, parsed ("[DONE]" as is)."""
    while line := resp.readline():
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            yield data if data == "[DONE]" else json.loads(data)


def tiny_server(folder: Path, tmp: Path) -> ServeProcess:
    """The tiny random Llama at `folder` served as "llama_long" with TINY_TEMPLATE, a batch of
    4, a context of TINY_CONTEXT, keep-alive pings after 0.05 s of quiet and TINY_ORIGINS
    allowed (CORS)."""
    (tmp / "llama_long").symlink_to(folder)
    (tmp / "template.jinja").write_text(TINY_TEMPLATE)
    return ServeProcess(
        tmp,
        "-m",
        str(tmp / "llama_long"),
        "--max-batch",
        "4",
        "--max-context",
        str(TINY_CONTEXT),
        "--chat-template",
        str(tmp / "template.jinja"),
        "--verbose",  # the log's per-request reuse lines (test_serve)
        "--keepalive",  # an Anthropic stream's pings while it waits (test_serve_anthropic)
        "0.05",
        "--allowed-origins",  # browser pages' calls (test_serve_ops)
        ",".join(TINY_ORIGINS),
    )
