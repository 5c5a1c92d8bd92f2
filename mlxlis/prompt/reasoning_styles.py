"""Reasoning styles as data, and the style a chat template renders.

A style is how a reply marks its reasoning: the tag that opens it, the tag that closes it, a
channel label right after the open tag that is not reasoning text (Gemma 4's "thought"), and,
for templates that wrap the answer too, the answer's own open and close tags (Command A's
`<|START_TEXT|>`), which are dropped from the answer.

Which style a model writes is read from its chat template, never from its name:
`template_reasoning` renders a probe, an assistant turn with reasoning and answer, as the last
turn and in the history, in each shape templates read it (the `reasoning_content`, `thinking`,
`reasoning` and `thought` fields; Mistral's thinking chunk; beside a tool call, where Kimi K2
Thinking and Gemma 4 keep it; Apertus' blocks), and takes the style whose tags wrap the
reasoning. A template that never renders past reasoning still shows its style: with thinking
on its generation prompt ends with the open tag (DeepSeek-R1, QwQ), or with thinking off it
ends with an empty block (SmolLM3, Gemma 4). The probe passes thinking on the way each
template spells it (`enable_thinking`, `thinking`, `reasoning_effort`, `thinking_mode`,
`thinking_budget`, and the switches that keep past reasoning in the history).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

from mlxlis.errors import TemplateError
from mlxlis.prompt.template import ChatTemplate


@dataclass(frozen=True)
class ReasoningStyle:
    """One row of the table. Whether a generation prompt opens the block is not the style's
    to say: the same template opens it or not with thinking on or off, so the splitter reads
    the prompt's tail (and `template_reasoning` says it for thinking on)."""

    name: str
    open: str
    close: str
    label: str = ""  # right after the open tag, not reasoning text
    answer_open: str = ""  # opens the answer (dropped)
    answer_close: str = ""  # closes the answer (dropped)


THINK = ReasoningStyle("think", "<think>", "</think>")
HARMONY = ReasoningStyle("harmony", "<|channel|>analysis<|message|>", "<|end|>")  # harmony.py

# First match wins where two rows share their tags: the answer's tags tell the Cohere ones apart.
TABLE: tuple[ReasoningStyle, ...] = (
    THINK,  # Qwen3, QwQ, DeepSeek, GLM, Kimi K2, MiniMax-M2, Nemotron, SmolLM3, LFM2.5, ...
    ReasoningStyle("gemma4", "<|channel>", "<channel|>", label="thought"),
    ReasoningStyle("mistral", "[THINK]", "[/THINK]"),  # Magistral, Ministral 3 Reasoning
    ReasoningStyle("seed", "<seed:think>", "</seed:think>"),  # Seed-OSS
    ReasoningStyle("minimax-m3", "<mm:think>", "</mm:think>"),
    ReasoningStyle("hy3", "<think:opensource>", "</think:opensource>"),  # Tencent Hy3
    ReasoningStyle(
        "command-a",
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        answer_open="<|START_TEXT|>",
        answer_close="<|END_TEXT|>",
    ),
    ReasoningStyle(
        "command-r",
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        answer_open="<|START_RESPONSE|>",
        answer_close="<|END_RESPONSE|>",
    ),
    ReasoningStyle(
        "kimi-k3",
        "<|open|>think<|sep|>",
        "<|close|>think<|sep|>",
        answer_open="<|open|>response<|sep|>",
        answer_close="<|close|>response<|sep|>",
    ),
    ReasoningStyle("apertus", "<|inner_prefix|>", "<|inner_suffix|>"),
    # Apriel 1.6: its generation prompt opens the reasoning with this sentence
    ReasoningStyle("apriel", "Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]"),
    # (the leading space before "to=" is whitespace the splitter skips)
    ReasoningStyle(
        "muse",
        "to=self<|message|>",
        "<|eom|><|start|>assistant to=user<|message|>",
        answer_open="to=user<|message|>",
    ),
    HARMONY,
)


@dataclass(frozen=True)
class TemplateReasoning:
    """The style a template renders, whether its generation prompt (thinking on) ends inside
    the block, and what showed it: "turn" (its tags around the probe's reasoning), "empty
    turn" (the turn keeps the tags, empty), "generation prompt" (it ends with the open tag)
    or "thinking-off prompt" (it ends with an empty block)."""

    style: ReasoningStyle
    opens: bool
    evidence: str


# multi-line and non-ASCII: a template that JSON-encodes a field it does not read as text
# escapes both, so the probe finds the reasoning only where the template renders it as text
PROBE_REASONING = "Probe reasoning, line one.\nLine two: naïve ü."
PROBE_ANSWER = "Probe answer."
THINKING_ON: dict[str, Any] = {
    "enable_thinking": True,
    "thinking": True,  # DeepSeek V3.1+, Kimi K3
    "reasoning_effort": "high",  # gpt-oss, Hy3, Cohere, DeepSeek V4, Solar
    "thinking_mode": "enabled",  # MiniMax-M3
    # keep past reasoning in the history (LFM2.5, Laguna, GLM-4.7, Nemotron 3, Hy3)
    "preserve_thinking": True,
    "keep_past_thinking": True,
    "preserved_thinking": True,
    "clear_thinking": False,
    "truncate_history_thinking": False,
}
_OFF: dict[str, Any] = {
    "enable_thinking": False,
    "thinking": False,
    "thinking_mode": "disabled",
    "thinking_budget": 0,  # Seed-OSS
    "reasoning": False,  # Cohere
}
# reasoning_effort's "off" differs: Cohere "none", Hy3 "no_think" (it refuses others), Solar
# "minimal"; each is tried in turn
THINKING_OFF: tuple[dict[str, Any], ...] = tuple(
    {**_OFF, "reasoning_effort": e} for e in ("none", "no_think", "minimal")
)
PROBE_USER = {"role": "user", "content": "Probe question?"}
PROBE_NEXT = {"role": "user", "content": "Probe follow-up?"}
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def probe_turns(reasoning: str, answer: str) -> list[dict[str, Any]]:
    """An assistant turn with `reasoning` and `answer`, in each shape templates read."""
    fields = {
        "role": "assistant",
        "content": answer,
        "reasoning_content": reasoning,
        "thinking": reasoning,
        "reasoning": reasoning,
        "thought": reasoning,  # Apriel 1.5
    }
    call = {"id": "call0", "type": "function", "function": {"name": "probe", "arguments": {}}}
    chunks = [{"type": "thinking", "thinking": reasoning}, {"type": "text", "text": answer}]
    blocks = [{"type": "thoughts", "text": reasoning}, {"type": "response", "text": answer}]
    return [
        fields,
        {"role": "assistant", "content": chunks},
        {**fields, "tool_calls": [call]},
        {"role": "assistant", "content": {"blocks": blocks}},
    ]


def render(
    template: ChatTemplate, messages: list[dict], generation: bool, switches: dict[str, Any]
) -> str | None:
    """The template's text for `messages`, or None when it refuses them; templates written for
    tool use that fail without tools are tried again with one."""
    for tools in (None, PROBE_TOOLS):
        try:
            return template.render(
                messages, add_generation_prompt=generation, tools=tools, **SPECIALS, **switches
            )
        except TemplateError:
            continue
    return None


def spliced(head: str, whole: str) -> str:
    """`whole` (a conversation ending with the assistant's turn) as the model writes it after
    the generation prompt `head`: where a template renders the turn without the text its
    generation prompt ends with (Apriel's reasoning opener), that text is put back."""
    if whole.startswith(head):
        return whole
    return head + whole[len(os.path.commonprefix([head, whole])) :]


def _opening(style: ReasoningStyle) -> str:
    return re.escape(style.open) + (f"(?:{re.escape(style.label)})?" if style.label else "")


def wraps(style: ReasoningStyle, text: str, reasoning: str = PROBE_REASONING) -> bool:
    """`text` holds `reasoning` between the style's tags (whitespace aside)."""
    pattern = _opening(style) + r"\s*" + re.escape(reasoning) + r"\s*" + re.escape(style.close)
    return re.search(pattern, text) is not None


def _answer_fits(style: ReasoningStyle, texts: list[str], answer: str) -> bool:
    """A style with answer tags fits only where the template puts them around the answer."""
    if not style.answer_open:
        return True
    pattern = re.escape(style.answer_open) + r"\s*" + re.escape(answer)
    return any(re.search(pattern, t) for t in texts)


def opens_block(prompt: str, style: ReasoningStyle) -> bool:
    """The prompt ends inside an open block of `style` (its open tag, maybe its label)."""
    return re.search(_opening(style) + r"\s*$", prompt) is not None


def empty_block(style: ReasoningStyle, after: str = "$") -> str:
    """A pattern: an empty block of `style` (`<think>\\n\\n</think>`), its answer tag, then
    `after` (a pattern)."""
    answer = r"(?:\s*" + re.escape(style.answer_open) + ")?" if style.answer_open else ""
    return _opening(style) + r"\s*" + re.escape(style.close) + answer + r"\s*" + after


def closes_empty_block(prompt: str, style: ReasoningStyle) -> bool:
    """The prompt ends with an empty block of `style` (the generation prompt, thinking off)."""
    return re.search(empty_block(style), prompt) is not None


@functools.lru_cache(maxsize=32)
def template_reasoning(template: ChatTemplate) -> TemplateReasoning | None:
    """The reasoning style `template` renders (see the module's docstring), or None when it
    shows none. Rendered once per template."""
    head = render(template, [PROBE_USER], True, THINKING_ON) or ""
    texts: list[str] = []
    for turn in probe_turns(PROBE_REASONING, PROBE_ANSWER):  # most templates show it first
        for msgs in ([PROBE_USER, turn], [PROBE_USER, turn, PROBE_NEXT]):
            text = render(template, msgs, False, THINKING_ON)
            if text is not None:
                texts.append(spliced(head, text) if len(msgs) == 2 else text)
        for style in TABLE:
            if any(wraps(style, t) for t in texts) and _answer_fits(style, texts, PROBE_ANSWER):
                return TemplateReasoning(style, opens_block(head, style), "turn")
    # the turn keeps the tags but drops what was between them (Kimi K2 Thinking's last turn)
    for style in TABLE:
        if any(re.search(empty_block(style, re.escape(PROBE_ANSWER)), t) for t in texts):
            return TemplateReasoning(style, opens_block(head, style), "empty turn")
    # history cut at the close tag, the generation prompt opening the next block (QwQ, R1)
    for style in TABLE:
        if opens_block(head, style):
            return TemplateReasoning(style, True, "generation prompt")
    for switches in THINKING_OFF:
        off = render(template, [PROBE_USER], True, switches) or ""
        for style in TABLE:
            if closes_empty_block(off, style) and _answer_fits(style, texts, PROBE_ANSWER):
                return TemplateReasoning(style, False, "thinking-off prompt")
    return None
