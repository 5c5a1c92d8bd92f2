"""How each chat template asks a model to write tool calls, as data.

Each format is one small definition (table.py): the tags that start and end a block of calls,
how a call writes its name and arguments, how an argument of each JSON type is written (base.py,
values.py, args.py). The format a model writes is read from its chat template by rendering a
probe call through it (detect.py), never from the model's name. The families:

- a JSON object a call: Hermes `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`
  (Qwen2.5/3), Mistral v3's `[TOOL_CALLS][…]`, Apriel's and MiniMax-M1's `<tool_calls>`,
  Nemotron Nano v2's `<TOOLCALL>[…]`, Cohere's `<|START_ACTION|>`, Apertus, GigaChat, Llama 3's
  bare object (`json`);
- a name, then a JSON object: Mistral's `[TOOL_CALLS]name[ARGS]{…}`, DeepSeek V3.1's and R1's,
  Kimi K2's `functions.NAME:0`, Solar's, functionary's `<function=NAME>{…}</function>`,
  gpt-oss's harmony message to `functions.NAME`;
- arguments as tagged rows, read by the tool's schema: Qwen3-Coder/Qwen3.5
  `<function=NAME>\\n<parameter=K>\\nV\\n</parameter>`, Seed-OSS, GLM's `<arg_key>`/`<arg_value>`
  (and Ling's, Laguna's), Hy3's, MiniMax-M2's `<invoke name=…><parameter name=…>`, DeepSeek
  V3.2/V4's DSML (`string="true|false"`), Kimi K3's, MiniCPM5's;
- their own syntax: Gemma 4's `call:NAME{key:<|"|>v<|"|>}`, LFM2's `[NAME(key='v')]`.

A parse takes the text of a block (between its tags) and the offered tools' schemas and gives
[(name, arguments JSON text, id or None)], or None when it does not parse.
"""

from __future__ import annotations

from mlxlis.prompt.tool_formats.bare import PY_END, PY_START, parse_json
from mlxlis.prompt.tool_formats.base import Call, ParsedCall, ToolFormat
from mlxlis.prompt.tool_formats.detect import (
    call_arguments,
    for_template,
    template_format,
    template_match,
)
from mlxlis.prompt.tool_formats.table import GEMMA4, HARMONY, HERMES, TABLE


def parse_gemma4(body: str) -> list[ParsedCall] | None:
    """Gemma 4's call text (`call:name{…}`, between its tags)."""
    return GEMMA4.parse(body)


__all__ = [
    "GEMMA4",
    "HARMONY",
    "HERMES",
    "PY_END",
    "PY_START",
    "TABLE",
    "Call",
    "ParsedCall",
    "ToolFormat",
    "call_arguments",
    "for_template",
    "parse_gemma4",
    "parse_json",
    "template_format",
    "template_match",
]
