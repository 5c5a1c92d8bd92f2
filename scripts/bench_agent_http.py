"""`make bench` (agent, over HTTP): bench_agent.py's 10-turn tool-using session sent as
Chat Completions to `mlxlis serve` and to `mlx_lm.server`, on the same weights and template.

Each turn is one non-streamed greedy request of max_tokens 1 (its whole time is the time to
the first token, HTTP and template included) carrying the conversation so far, as an agent
sends it: the system prompt, 12 tools, every past turn's reply (its reasoning dropped by the
template) and tool result. First the session runs on a fresh server (each turn may reuse
what the server kept of the previous one), then the same ten prompts again, each with a tag of
its own at the start of the system prompt (nothing after the first few tokens is shared with
what the server holds: the cold time). mlxlis serves the GGUF; mlx-lm its `mlxlis convert
--dequantize` folder (bench_serve.py). Prints a Markdown table per model; writes
bench-results/agent_http.json.

usage: python scripts/bench_agent_http.py [--models smollm2-135m,gemma3-270m]
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_agent import GEMMA, TEMPLATE, TOOLS, turn  # noqa: E402  (imports mlxlis first)
from bench_serve import Server  # noqa: E402

ENGINES = ("mlxlis", "mlx_lm")


def chat(server: Server, messages: list[dict]) -> tuple[float, int, int | None]:
    """(seconds, prompt tokens, cached tokens where the server says) of one request."""
    body = {
        "model": server.model,
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 1,
        "temperature": 0,
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), server.headers)
    resp = conn.getresponse()
    out = json.loads(resp.read())
    seconds = time.perf_counter() - t0
    conn.close()
    assert resp.status == 200, out
    usage = out["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return seconds, usage["prompt_tokens"], cached


def conversations(tag: str = "") -> list[list[dict]]:
    """The ten prompts of the session (bench_agent.session's messages, as a client sends
    them: the tool calls' arguments as JSON text)."""
    system = f"{tag}You are a coding agent working in a git repository."
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "The test suite fails in src/: find the bug and fix it."},
    ]
    out = []
    for i in range(10):
        out.append(list(messages))
        reasoning, answer, call, result = turn(i)
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        messages += [
            {
                "role": "assistant",
                "content": answer,
                "reasoning_content": reasoning,
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": f"c{i}", "content": result},
        ]
    return out


def session(engine: str, name: str, cache: Path) -> list[dict]:
    template = GEMMA if name.startswith("gemma") else TEMPLATE
    log = cache / f"{engine}-{name}.log"
    server = Server(engine, name, cache, log, template=template)
    rows = []
    try:
        for i, messages in enumerate(conversations()):
            warm, prompt, cached = chat(server, messages)
            rows.append(dict(turn=i + 1, prompt=prompt, cached=cached, reused_s=warm))
        for i in range(len(rows)):  # a tag of its own each: no cold run shares another's start
            rows[i]["cold_s"] = chat(server, conversations(tag=f"[cold run {i}] ")[i])[0]
            print(json.dumps({"engine": engine, "model": name, **rows[i]}), file=sys.stderr)
    finally:
        server.stop()
    return rows


def table(name: str, runs: dict[str, list[dict]]) -> str:
    out = [
        f"**{name}** (seconds to the first token, HTTP included; reused / cold)\n",
        "| turn | prompt tokens | mlxlis reused | mlxlis cold | ratio | mlx-lm reused | "
        "mlx-lm cold | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ours, theirs = runs["mlxlis"], runs["mlx_lm"]
    for a, b in zip(ours, theirs, strict=True):
        out.append(
            f"| {a['turn']} | {a['prompt']} | {a['reused_s']:.2f} | {a['cold_s']:.2f} | "
            f"{a['reused_s'] / a['cold_s']:.2f} | {b['reused_s']:.2f} | {b['cold_s']:.2f} | "
            f"{b['reused_s'] / b['cold_s']:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    a = p.parse_args()
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="mlxlis-bench-agent-") as tmp:
        for name in a.models.split(","):
            results[name] = {engine: session(engine, name, Path(tmp)) for engine in ENGINES}
    for name, runs in results.items():
        print(table(name, runs) + "\n")
    out = ROOT / "bench-results" / "agent_http.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
