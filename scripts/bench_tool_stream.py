"""`make bench` (tool calls): how long the server's tool-call parser takes to stream one
call whose string argument is 50 000 characters long, fed 4 characters at a time (about a
token's worth), in Hermes' JSON and Qwen3.5's XML format (the latter found from llama.cpp's
official template, `make references`). Best of 3 rounds; prints a Markdown table.

usage: python scripts/bench_tool_stream.py [--chars N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from mlxlis.prompt.tool_calls import ToolCallParser  # noqa: E402
from mlxlis.prompt.tool_formats import table  # noqa: E402
from mlxlis.prompt.tool_formats.base import ToolFormat  # noqa: E402
from mlxlis.prompt.tool_formats.detect import for_template  # noqa: E402

from fetch_references import fetch  # noqa: E402

SCHEMAS = {
    "w": {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}
}


def stream(fmt: ToolFormat, text: str, step: int = 4) -> tuple[float, dict]:
    parser = ToolCallParser(frozenset(SCHEMAS), fmt, SCHEMAS)
    t0 = time.perf_counter()
    for i in range(0, len(text), step):
        parser.feed(text[i : i + step])
        parser.take_pieces()
    parser.flush()
    return time.perf_counter() - t0, parser.calls[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=50_000)
    big = "x" * ap.parse_args().chars
    want = {"text": big, "n": 3}
    qwen = (fetch() / "templates" / "Qwen3.5-4B.jinja").read_text()
    cases = {
        "Hermes JSON": (
            table.HERMES,
            "<tool_call>\n" + json.dumps({"name": "w", "arguments": want}) + "\n</tool_call>",
        ),
        "Qwen3.5 XML": (
            for_template(qwen),
            f"<tool_call>\n<function=w>\n<parameter=text>\n{big}\n</parameter>\n"
            "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
        ),
    }
    print(f"| format | {len(big)}-character argument, streamed (best of 3) |\n|---|---|")
    for name, (fmt, text) in cases.items():
        rounds = [stream(fmt, text) for _ in range(3)]
        assert all(json.loads(c["function"]["arguments"]) == want for _, c in rounds), name
        print(f"| {name} | {min(s for s, _ in rounds):.3f} s |")


if __name__ == "__main__":
    main()
