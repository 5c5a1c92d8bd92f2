"""A reply as the API returns it, built from the engine's events one at a time.

`ChatReply` splits the text into reasoning (`reasoning_content`) and answer, the answer into
content and tool calls (when the request offered tools), and keeps the logprobs; `feed`
returns what one event adds (a streamed chunk's delta), the object keeps the whole (a
non-streamed response). `CompletionReply` does the same for /v1/completions' plain text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxlis.generation.events import Event
from mlxlis.prompt.harmony import HarmonySplitter
from mlxlis.prompt.reasoning import ANSWER, ReasoningSplitter
from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import HERMES, ToolFormat
from mlxlis.serve.openai_format import CompletionLogprobs, TokenText, chat_logprob


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # whole, as they end
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # the calls as they stream (OpenAI's chunk shape: tool_calls.ToolCallParser.take_pieces)
    call_pieces: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.content or self.reasoning or self.tool_calls or self.logprobs or self.call_pieces
        )


def finish_reason(engine_reason: str, tool_calls: bool) -> str:
    """The API's finish_reason: a reply that called tools ends with "tool_calls"."""
    return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason


class ChatReply:
    def __init__(
        self,
        tokenizer: Any,
        token_text: TokenText,
        prompt: str,
        *,
        logprobs: bool,
        tools: Mapping[str, Any] | frozenset[str] | None,
        tool_format: ToolFormat | None = None,
        forced: str = "",
        template: ChatTemplate | None = None,
    ):
        # the template that rendered the prompt says which reasoning tags the model writes
        self.splitter = ReasoningSplitter.for_prompt(tokenizer, prompt, template)
        self.tools = None
        if tools is not None:
            # the offered tools (their parameters by name, where given: how a format that
            # writes arguments as text reads them)
            schemas = tools if isinstance(tools, Mapping) else None
            self.tools = ToolCallParser(frozenset(tools), tool_format or HERMES, schemas)
            # the prompt opened the call (tool_choice): all of it held; a harmony header
            # (gpt-oss) is the splitter's to read first, as if the model had written it
            pieces = [forced]
            if isinstance(self.splitter, HarmonySplitter):
                pieces = [text for _, text in self.splitter.feed(forced)]
            for text in pieces:
                self.tools.feed(text)
        self.token_text = token_text
        self.want_logprobs = logprobs
        self.content, self.reasoning = "", ""
        self.logprobs: list[dict[str, Any]] = []
        self.tool_calls: list[dict[str, Any]] = []

    def feed(self, ev: Event) -> Delta:
        d = Delta()
        parts = self.splitter.feed(ev.text, ev.token) if ev.text or ev.token is not None else []
        if ev.finish_reason is not None:
            parts += self.splitter.flush()
        for kind, text in parts:
            if kind != ANSWER:
                d.reasoning += text
            elif self.tools is not None:
                text, calls = self.tools.feed(text)
                d.content += text
                d.tool_calls += calls
            else:
                d.content += text
        if ev.finish_reason is not None and self.tools is not None:
            # cut by max_tokens: a call the cut stopped is dropped, not shown as its markup
            text, calls = self.tools.flush(cut=ev.finish_reason == "length")
            d.content += text
            d.tool_calls += calls
        if self.tools is not None:
            d.call_pieces = self.tools.take_pieces()
        if self.want_logprobs and ev.token is not None and ev.logprob is not None:
            d.logprobs.append(chat_logprob(self.token_text, ev.token, ev.logprob, ev.top_logprobs))
        for i, call in enumerate(d.tool_calls, start=len(self.tool_calls)):
            call["index"] = i
        self.content += d.content
        self.reasoning += d.reasoning
        self.tool_calls += d.tool_calls
        self.logprobs += d.logprobs
        return d

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["content"] = self.content or None
            msg["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in self.tool_calls
            ]
        return msg

    @staticmethod
    def delta_dict(d: Delta) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if d.reasoning:
            out["reasoning_content"] = d.reasoning
        if d.content or not (d.reasoning or d.call_pieces):
            out["content"] = d.content
        if d.call_pieces:
            out["tool_calls"] = d.call_pieces
        return out


class CompletionReply:
    def __init__(self, token_text: TokenText, *, logprobs: bool):
        self.token_text = token_text
        self.text = ""
        self.logprobs = CompletionLogprobs() if logprobs else None

    def feed(self, ev: Event) -> tuple[str, CompletionLogprobs | None]:
        """(the text one event adds, its logprobs when they were asked for)."""
        lp = None
        if self.logprobs is not None and ev.token is not None and ev.logprob is not None:
            lp = CompletionLogprobs()
            lp.add(self.token_text, ev.token, ev.logprob, ev.top_logprobs, len(self.text))
            self.logprobs.add(
                self.token_text, ev.token, ev.logprob, ev.top_logprobs, len(self.text)
            )
        self.text += ev.text
        return ev.text, lp
