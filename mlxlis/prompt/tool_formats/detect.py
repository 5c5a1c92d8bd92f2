"""Which tool-call format a chat template teaches, read from what it renders.

`template_format` renders a probe conversation through the template itself (in its sandbox):
an assistant turn calling two tools of known names and arguments (one when the template takes
one call a turn), and takes the first format of the table whose writer reproduces the text the
template rendered for them (table.py's order), else the first whose reader gets the probe's
calls back from it (a template that spaces its tags its own way: Reka's Hermes, Step 3.5's
Qwen3-Coder), reading what the template's reasoning splitter hands on too (gpt-oss's harmony
messages become call text there). Only a template that cannot render a call at all is matched
on its source text (`for_template`). Once per template.

`call_arguments` says how a template takes a past call's arguments: as an object (transformers'
convention, nearly all) or as the JSON text (functionary v3.2 concatenates them to strings).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from mlxlis.errors import TemplateError
from mlxlis.prompt.harmony import CALL, CHANNEL
from mlxlis.prompt.reasoning import ANSWER, ReasoningSplitter
from mlxlis.prompt.reasoning_styles import THINKING_OFF
from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_formats import table as t
from mlxlis.prompt.tool_formats.bare import PY_START, PYTHON_TAG
from mlxlis.prompt.tool_formats.base import Call, ToolFormat

_TEXT = {"type": "string", "description": "A probe."}  # Command R+ prints each description
_PARAMS = {
    "probe_weather": {"city": _TEXT, "days": {"type": "integer", "description": "A probe."}},
    "probe_search": {"query": _TEXT},
}
SCHEMAS = {
    name: {"type": "object", "properties": props, "required": list(props)}
    for name, props in _PARAMS.items()
}
PROBE_TOOLS = [
    {"type": "function", "function": {"name": n, "description": "A probe.", "parameters": s}}
    for n, s in SCHEMAS.items()
]
PROBE_CALLS: list[Call] = [
    ("probe_weather", {"city": "Paris", "days": 3}),
    ("probe_search", {"query": "tea"}),
]
PROBE_IDS = ["probe0001", "probe0002"]  # 9 letters and digits: Mistral's templates want them
USER = {"role": "user", "content": "Probe question?"}
# thinking switches tried in turn: some templates refuse a conversation without them
SWITCHES: tuple[dict[str, Any], ...] = ({}, *THINKING_OFF)


def _message(calls: list[Call], as_text: bool) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": PROBE_IDS[i],
                "type": "function",
                "function": {"name": n, "arguments": dict(a) if not as_text else _json(a)},
            }
            for i, (n, a) in enumerate(calls)
        ],
    }


def _json(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False)


def _render(template: ChatTemplate, messages: list[dict], generation: bool) -> str | None:
    for switches in SWITCHES:
        try:
            return template.render(
                messages,
                add_generation_prompt=generation,
                tools=PROBE_TOOLS,
                bos_token="<s>",
                eos_token="</s>",
                **switches,
            )
        except TemplateError:
            continue
    return None


@functools.lru_cache(maxsize=32)
def call_arguments(template: ChatTemplate) -> str:
    """How the template takes a past call's arguments: "object", or "text" where only text
    renders."""
    for as_text in (False, True):
        if _render(template, [USER, _message(PROBE_CALLS[:1], as_text)], False) is not None:
            return "text" if as_text else "object"
    return "object"


@dataclass(frozen=True)
class Probe:
    head: str  # the generation prompt
    reply: str  # what the probe's assistant turn adds after it (as the model writes it)
    turn: str  # the whole assistant turn (its header and reasoning too)
    calls: list[Call]  # the calls in it


def _probe(template: ChatTemplate) -> Probe | None:
    head = _render(template, [USER], True)
    before = _render(template, [USER], False)
    as_text = call_arguments(template) == "text"
    for calls in (PROBE_CALLS, PROBE_CALLS[:1]):
        whole = _render(template, [USER, _message(calls, as_text)], False)
        if head is None or before is None or whole is None:
            continue
        # where the turn starts: a template may open a block in its generation prompt that
        # its history leaves out (<think>), so the prompt's text may part from it mid-tag
        at = len(os.path.commonprefix([head, whole]))
        turn = whole[min(at, len(os.path.commonprefix([before, whole]))) :]
        if all(name in turn for name, _ in calls):  # else it renders one call a turn
            return Probe(head, whole[at:], turn, calls)
    return None


def _blocks(fmt: ToolFormat, text: str) -> list[tuple[str, str]] | None:
    """The calls of `fmt` in `text`, read block by block; None when one does not read."""
    out: list[tuple[str, str]] = []
    at = text.find(fmt.open)
    while at >= 0:
        start = at + len(fmt.open)
        end = text.find(fmt.close, start) if fmt.close is not None else len(text)
        if end < 0:
            return None
        parsed = fmt.parse(text[start:end], SCHEMAS)
        if parsed is None:
            return None
        out += [(name, args) for name, args, _ in parsed]
        at = text.find(fmt.open, end + len(fmt.close or ""))
    return out


def _reads(fmt: ToolFormat, texts: list[str], calls: list[Call]) -> bool:
    want = [(n, _json(a)) for n, a in calls]
    return any(fmt.open and _blocks(fmt, text) == want for text in texts)


def _writes(fmt: ToolFormat, probe: Probe) -> bool:
    written = fmt.write(probe.calls, PROBE_IDS)
    if fmt.open:
        return written in probe.turn
    return probe.reply.lstrip().removeprefix(PYTHON_TAG).lstrip().startswith(written)


def template_format(template: ChatTemplate) -> ToolFormat:
    """The tool-call format `template` renders (see the module's docstring)."""
    return template_match(template)[0]


@functools.lru_cache(maxsize=32)
def template_match(template: ChatTemplate) -> tuple[ToolFormat, str]:
    """(the format, how it was found): "exact" (its writer reproduces the template's text),
    "read" (its reader reads the probe's calls back) or "source" (the template's text names
    its tags; the probe rendered no call)."""
    probe = _probe(template)
    if probe is None:
        return for_template(template.text), "source"
    for fmt in t.TABLE:
        if _writes(fmt, probe):
            return _bare(fmt, template.text), "exact"
    splitter = ReasoningSplitter.for_prompt(None, probe.head, template)
    segments = splitter.feed(probe.reply) + splitter.flush()
    answer = "".join(text for kind, text in segments if kind == ANSWER)
    for fmt in t.TABLE:
        if _reads(fmt, [probe.turn, answer], probe.calls):
            return fmt, "read"
    return for_template(template.text), "source"


def _bare(fmt: ToolFormat, text: str) -> ToolFormat:
    """A bare-JSON format with Llama 4's tags where its template writes them."""
    if fmt.open == "" and PY_START in text:
        return t.bare_json("parameters" if '"parameters"' in text else "arguments", llama4=True)
    return fmt


# (source text, format): the first whose text the template holds, for a template the probe
# cannot render; more specific texts before the tags they contain
_SOURCE_MARKERS: tuple[tuple[str, ToolFormat], ...] = (
    ("[CALL_ID]", t.MISTRAL_CALL_ID),
    ("[ARGS]", t.MISTRAL_ARGS),
    ("[TOOL_CALLS]", t.MISTRAL),
    ("<minimax:tool_call>", t.MINIMAX_M2),
    ("｜DSML｜function_calls", t.DSML_V32),
    ("｜DSML｜tool_calls", t.DSML_V4),
    ("<seed:tool_call>", t.SEED),
    ("<tool_calls:opensource>", t.HY3),
    ("<|tool_calls_section_begin|>", t.KIMI_K2),
    ("<｜tool▁call▁begin｜>' + tool['type']", t.DEEPSEEK_R1),  # the R1 distills' source
    ("<｜tool▁call▁begin｜>", t.DEEPSEEK_V31),
    ("<|tool_call_start|>", t.LFM2),
    ("<|tool_list_start|>", t.LFM2),  # LFM2's templates that render no call
    ("List of tools: [", t.LFM2),  # (LFM2.5 Instruct's)
    ("<|tool_call|>", t.GRANITE),
    ("<TOOLCALL>", t.NEMOTRON_V2),
    ("<|START_ACTION|>", t.COHERE),
    ("<|tools_prefix|>", t.APERTUS),
    ("<arg_key>", t.GLM),
    ("<parameter=", t.QWEN3_CODER),
    ("<tool_call>", t.HERMES),
)


def for_template(text: str) -> ToolFormat:
    """The format a template's source names (its tags), for one the probe cannot render; a
    template that names none has the model write a bare JSON object (Llama 3's)."""
    if CHANNEL in text and CALL in text:  # gpt-oss (harmony)
        return t.HARMONY
    if "<|tool_call>" in text:
        return t.GEMMA4
    for marker, fmt in _SOURCE_MARKERS:
        if marker in text:
            return fmt
    key = "parameters" if '"parameters"' in text else "arguments"
    return t.bare_json(key, llama4=PY_START in text)
