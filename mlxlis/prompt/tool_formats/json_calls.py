"""The formats that write a call's arguments as one JSON object: a call that is a JSON object
(Hermes' `{"name": …, "arguments": {…}}`, Cohere's, Apertus' `{"NAME": {…}}`), or a name and
then the object (Mistral's, DeepSeek's, Kimi K2's, Solar's, functionary's, harmony's), and the
bare object of Llama 3. Each definition was read off what the vendor's template renders for an
assistant message's `tool_calls` (llama.cpp's copies); base.py says what the fields mean."""

from __future__ import annotations

import functools

from mlxlis.prompt.harmony import CALL, CALL_OPEN
from mlxlis.prompt.tool_formats.bare import (
    PY_END,
    PY_START,
    harmony_opener,
    json_opener,
    parse_json,
)
from mlxlis.prompt.tool_formats.base import ToolFormat, mistral_id

_HERMES_CALL = '{"name": "{name}", "arguments": {args}}'

# ---------------------------------------------------------------- a JSON object a call

HERMES = ToolFormat(
    "hermes",
    "<tool_call>",
    "</tool_call>",
    block="<tool_call>\n{calls}\n</tool_call>",
    call=_HERMES_CALL,
    single=True,
    between="\n",
    models="Qwen2.5, Qwen3, QwQ, Hermes 2/3, Granite 4, MiMo-VL, Bielik, Reka",
)
MINIMAX_M1 = ToolFormat(
    "minimax-m1",
    "<tool_calls>",
    "</tool_calls>",
    block="<tool_calls>\n{calls}\n</tool_calls>",
    call=_HERMES_CALL,
    sep="\n",
    models="MiniMax-M1",
)
APRIEL = ToolFormat(
    "apriel",
    "<tool_calls>",
    "</tool_calls>",
    block="<tool_calls>[{calls}]</tool_calls>",
    call=_HERMES_CALL,
    sep=", ",
    models="Apriel 1.5, 1.6",
)
NEMOTRON_V2 = ToolFormat(
    "nemotron-v2",
    "<TOOLCALL>",
    "</TOOLCALL>",
    block="<TOOLCALL>[{calls}]</TOOLCALL>",
    call=_HERMES_CALL,
    sep=", ",
    models="Nemotron Nano v2",
)
COHERE = ToolFormat(
    "cohere",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    block="<|START_ACTION|>[\n    {calls}\n]<|END_ACTION|>",
    call='{"tool_call_id": "{index}", "tool_name": "{name}", "parameters": {args}}',
    sep=",\n    ",
    models="Command R7B, Command A (Cohere2MoE)",
)
COMMAND_R = ToolFormat(
    "command-r",
    "Action:\n```json",
    "```",
    block="Action:\n```json\n[\n{calls}\n]```",
    call='{"tool_name": "{name}", "parameters": {args}}',  # written indented by 4
    sep=",\n",
    models="Command R+",
)
APERTUS = ToolFormat(
    "apertus",
    "<|tools_prefix|>",
    "<|tools_suffix|>",
    block="<|tools_prefix|>[{calls}]<|tools_suffix|>",
    call='{"{name}": {args}}',
    sep=", ",
    models="Apertus",
)
GIGACHAT3 = ToolFormat(
    "gigachat3",
    "<|message_sep|>\n\nfunction call<|role_sep|>",
    "<|message_sep|>",
    block="<|message_sep|>\n\nfunction call<|role_sep|>\n{calls}<|message_sep|>",
    call=_HERMES_CALL,
    single=True,
    models="GigaChat 3",
)
GIGACHAT31 = ToolFormat(
    "gigachat3.1",
    "<|function_call|>",
    "<|message_sep|>",
    block="<|function_call|>{calls}<|message_sep|>",
    call=_HERMES_CALL,
    single=True,
    models="GigaChat 3.1",
)
MISTRAL = ToolFormat(  # v3 (Nemo): one list, each call with its id
    "mistral",
    "[TOOL_CALLS]",
    None,
    block="[TOOL_CALLS][{calls}]",
    call='{"name": "{name}", "arguments": {args}, "id": "{id}"}',
    sep=", ",
    new_id=mistral_id,
    models="Mistral Nemo, Mistral v3",
)

GRANITE = ToolFormat(  # from its system prompt: its template renders no past call
    "granite",
    "<|tool_call|>",
    None,
    block="<|tool_call|>[{calls}]",
    call=_HERMES_CALL,
    sep=", ",
    models="Granite 3.x",
)

# ---------------------------------------------------------------- a name, then a JSON object

MISTRAL_ARGS = ToolFormat(
    "mistral-args",
    "[TOOL_CALLS]",
    None,
    block="{calls}",
    call="[TOOL_CALLS]{name}[ARGS]{args}",
    new_id=mistral_id,
    models="Ministral 3, Devstral, Magistral",
)
MISTRAL_CALL_ID = ToolFormat(
    "mistral-call-id",
    "[TOOL_CALLS]",
    None,
    block="{calls}",
    call="[TOOL_CALLS]{name}[CALL_ID]{id}[ARGS]{args}",
    new_id=mistral_id,
    models="Mistral Small 3.2",
)
DEEPSEEK_V31 = ToolFormat(
    "deepseek-v3.1",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    block="<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>",
    call="<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>",
    models="DeepSeek V3.1",
)
DEEPSEEK_R1 = ToolFormat(
    "deepseek-r1",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    block="<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>",
    call="<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>",
    sep="\n",
    models="DeepSeek R1 (distills), DeepSeek V3",
)
KIMI_K2 = ToolFormat(
    "kimi-k2",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    block="<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>",
    call="<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>",
    models="Kimi K2",
)
SOLAR = ToolFormat(
    "solar",
    "<|tool_calls|>",
    "<|calls|>",
    block="<|tool_calls|>{calls}<|calls|>",
    call="<|tool_call:begin|>{id}<|tool_call:name|>{name}<|tool_call:args|>{args}<|tool_call:end|>",
    models="Solar Open",
)
FUNCTIONARY = ToolFormat(
    "functionary",
    "<function=",
    "</function>",
    block="{calls}",
    call="<function={name}>{args}</function>",
    single=True,
    models="functionary v3.1",
)
HARMONY = ToolFormat(
    "harmony",
    CALL_OPEN,
    CALL,
    block="{calls}",
    call=f"{CALL_OPEN}{{name}}<|message|>{{args}}{CALL}",
    single=True,
    opener=harmony_opener,
    models="gpt-oss",
)


@functools.lru_cache(maxsize=4)
def bare_json(key: str = "parameters", llama4: bool = False) -> ToolFormat:
    """Llama 3's (`key` "parameters") or another bare object's; Llama 4 writes its empty
    text tags first."""
    return ToolFormat(
        "json",
        "",
        None,
        block="{calls}",
        call=f'{{"name": "{{name}}", "{key}": {{args}}}}',
        reader=parse_json,
        opener=json_opener(key, PY_START + PY_END if llama4 else ""),
        models="Llama 3.1-3.3, Llama 4",
    )


JSON = bare_json()
JSON_ARGUMENTS = bare_json("arguments")
