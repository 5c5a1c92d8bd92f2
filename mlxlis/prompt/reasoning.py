"""Reasoning ("thinking") split from the answer in a reply's stream.

Qwen3-style models open their reply with `<think>`, reason, close with `</think>` and then
answer; some templates (Qwen3.5, DeepSeek-R1) put `<think>\\n` at the end of the generation
prompt, so the reply starts inside the reasoning with no opening tag. Other models use other
tags (Gemma 4's `<|channel>thought\\n…<channel|>`, Mistral's `[THINK]…[/THINK]`, Seed-OSS's
`<seed:think>`, Command A's `<|START_THINKING|>` with its answer in `<|START_TEXT|>…<|END_TEXT|>`):
the styles are data (reasoning_styles.TABLE), and the one a model writes is read from its chat
template by a probe render (`template_reasoning`); gpt-oss's harmony channels are harmony.py's.
`ReasoningSplitter` turns decoded pieces into ("reasoning", text) / ("answer", text) segments:

- the tags are matched by token id when the tokenizer has each as a single token (its
  special / added tokens), else by text, held back while a piece could be the start of a tag;
- an opening tag counts only before any visible answer text, a closing tag only inside the
  reasoning: later tags are answer text (text matching) or dropped (ids);
- the tags never show, nor do a style's answer tags (matched as text);
- whitespace: the reasoning is stripped at both ends (inner whitespace kept) and so is what
  lies between the closing tag and the answer; the answer is otherwise kept as written.

A reply without tags is all answer, byte for byte.
"""

from __future__ import annotations

from typing import Any, Protocol

from mlxlis.prompt.harmony import HarmonySplitter, speaks_harmony
from mlxlis.prompt.reasoning_styles import HARMONY, TABLE, ReasoningStyle, template_reasoning
from mlxlis.prompt.segments import ANSWER, REASONING, Segment, join, partial_suffix
from mlxlis.prompt.template import ChatTemplate

__all__ = ["ANSWER", "REASONING", "ReasoningSplitter", "Segment", "Splitter", "join"]

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
# (open tag, close tag, label right after the open tag that is not reasoning text), in the
# table's order: <think>, Gemma 4's channel, Mistral's [THINK], then the others
STYLES = tuple((s.open, s.close, s.label) for s in TABLE if s is not HARMONY)

_START, _THINK, _AFTER, _ANSWER = "start", "reasoning", "after", "answer"


class Splitter(Protocol):
    """What the surfaces use of a splitter (this module's, or harmony.py's for gpt-oss)."""

    open_tag: str
    close_tag: str  # what a thinking budget forces to end the reasoning
    saw_reasoning: bool
    reasoning_tokens: int

    @property
    def end_tags(self) -> tuple[str, ...]:
        """What ends the reasoning when the model writes it."""
        ...

    @property
    def in_reasoning(self) -> bool: ...

    def feed(self, text: str, token: int | None = None) -> list[Segment]: ...

    def flush(self) -> list[Segment]: ...


def tag_ids(tokenizer: Any, tags: tuple[str, str] = (OPEN_TAG, CLOSE_TAG)) -> dict[int, str]:
    """{id: tag} when every tag is one token of `tokenizer` (e.g. added special tokens), else {}."""
    found: dict[int, str] = {}
    for tag in tags:
        ids = tokenizer.encode(tag, special=True, add_bos=False, add_eos=False)
        if len(ids) != 1 or tokenizer.decode(ids) != tag:
            return {}
        found[ids[0]] = tag
    return found


def starts_in_reasoning(prompt: str, open_tag: str = OPEN_TAG) -> bool:
    """True when the rendered prompt ends inside an open reasoning block (`…<think>\\n`)."""
    return prompt.rstrip().endswith(open_tag)


def ends_after_reasoning(prompt: str, close_tag: str = CLOSE_TAG, answer_open: str = "") -> bool:
    """True when the prompt ends right after a closed block (`<think>\\n\\n</think>\\n\\n`),
    or opens the answer itself (Kimi K3 with thinking off ends with its answer tag)."""
    tail = prompt.rstrip()
    return tail.endswith(close_tag) or bool(answer_open) and tail.endswith(answer_open)


class ReasoningSplitter:
    """Feed `(text, token)` per generated token; get the segments that text completes."""

    def __init__(
        self,
        *,
        ids: dict[int, str] | None = None,
        in_reasoning: bool = False,
        after_reasoning: bool = False,
        open_tag: str = OPEN_TAG,
        close_tag: str = CLOSE_TAG,
        label: str = "",
        answer_open: str = "",
        answer_close: str = "",
    ):
        self.open_tag, self.close_tag, self.label = open_tag, close_tag, label
        self.answer_open, self.answer_close = answer_open, answer_close
        self._label = ""  # the channel label still expected at the start of the reasoning
        self._ids = dict(ids or {})
        self._state = _THINK if in_reasoning else _AFTER if after_reasoning else _START
        self._buf = ""  # text held back: leading whitespace, or what may be part of a tag
        self._ws = ""  # reasoning whitespace held until more reasoning text follows it
        self._reasoned = False  # some reasoning text was emitted in this block
        self.saw_reasoning = in_reasoning  # a reasoning block was opened (by tag or prompt)
        # tokens generated inside the reasoning, tags excluded (when matched by id)
        self.reasoning_tokens = 0

    @classmethod
    def for_prompt(
        cls, tokenizer: Any, prompt: str, template: ChatTemplate | None = None
    ) -> Splitter:
        """A splitter for the reply to `prompt`. The style is the one `template` (the chat
        template that rendered the prompt) renders, harmony's for gpt-oss (harmony.py);
        without a template or a style found in it: harmony's after its generation prompt,
        else the first style whose two tags are tokens of `tokenizer`'s vocabulary, else
        `<think>` as text. Tags that are tokens of the vocabulary are matched by id
        (`tokenizer` None: all as text)."""
        found = template_reasoning(template) if template is not None else None
        style = found.style if found is not None else None
        if style is HARMONY or (style is None and speaks_harmony(prompt)):
            return HarmonySplitter()
        ids: dict[int, str] = {}
        if style is None:
            style = TABLE[0]
            for candidate in TABLE if tokenizer is not None else ():
                if candidate is not HARMONY and (
                    found_ids := tag_ids(tokenizer, (candidate.open, candidate.close))
                ):
                    style, ids = candidate, found_ids
                    break
        elif tokenizer is not None:
            ids = tag_ids(tokenizer, (style.open, style.close))
        return cls.for_style(style, prompt, ids)

    @classmethod
    def for_style(
        cls, style: ReasoningStyle, prompt: str, ids: dict[int, str] | None = None
    ) -> ReasoningSplitter:
        """A splitter for `style` after `prompt`: the prompt's tail says where the reply
        starts (inside the block, after it, or free to open one)."""
        return cls(
            ids=ids,
            in_reasoning=starts_in_reasoning(prompt, style.open),
            after_reasoning=ends_after_reasoning(prompt, style.close, style.answer_open),
            open_tag=style.open,
            close_tag=style.close,
            label=style.label,
            answer_open=style.answer_open,
            answer_close=style.answer_close,
        )

    @property
    def in_reasoning(self) -> bool:
        return self._state == _THINK

    @property
    def end_tags(self) -> tuple[str, ...]:
        return (self.close_tag,)

    def feed(self, text: str, token: int | None = None) -> list[Segment]:
        """The segments completed by one generated piece (its token id when known)."""
        out: list[Segment] = []
        tag = self._ids.get(token) if token is not None else None
        if tag is not None:
            self._text(text[: -len(tag)] if text.endswith(tag) else text, out)
            self._tag(tag, out)
            return out
        self._text(text, out)
        if token is not None and (self._state == _THINK or any(k == REASONING for k, _ in out)):
            self.reasoning_tokens += 1
        return out

    def flush(self) -> list[Segment]:
        """Whatever is held back at the end of the reply (a tag's start that never finished
        is text)."""
        out: list[Segment] = []
        buf, self._buf = self._buf, ""
        if self._state in (_START, _AFTER, _ANSWER) and buf:
            out.append((ANSWER, buf.lstrip() if self._state == _AFTER else buf))
        elif self._state == _THINK and buf:
            self._reason(buf, out)
        self._ws = ""
        return out

    # --- internals ---
    def _tag(self, tag: str, out: list[Segment]) -> None:
        if tag == self.open_tag and self._state == _START:
            self._open()
        elif tag == self.close_tag and self._state in (_START, _THINK):
            self._close(out)
        # any other tag (a second <think>, a tag inside the answer) is dropped

    def _open(self) -> None:
        self._state, self._buf, self._ws, self._reasoned = _THINK, "", "", False
        self._label = self.label
        self.saw_reasoning = True

    def _close(self, out: list[Segment]) -> None:
        if self._state == _THINK and self._buf:
            self._reason(self._buf, out)
        # (before any answer text, a bare </think> drops the whitespace held so far)
        self._state, self._buf, self._ws = _AFTER, "", ""

    def _text(self, text: str, out: list[Segment]) -> None:
        while text:
            if self._state == _ANSWER:
                text = self._answer(text, out)
            elif self._state == _AFTER:
                text = self._after(text)
            elif self._state == _START:
                text = self._start(text, out)
            else:
                text = self._think(text, out)

    def _start(self, text: str, out: list[Segment]) -> str:
        """Before any answer text: whitespace and a possible opening tag are held."""
        buf = self._buf + text
        body = buf.lstrip()
        if not self._ids and body.startswith(self.open_tag):
            self._open()
            return body[len(self.open_tag) :]
        if self.answer_open and body.startswith(self.answer_open):  # no reasoning this time
            self._buf, self._state = "", _ANSWER
            return body[len(self.answer_open) :]
        if (
            not body
            or (not self._ids and self.open_tag.startswith(body))
            or self.answer_open.startswith(body)
        ):
            self._buf = buf
            return ""
        self._buf, self._state = "", _ANSWER
        return buf

    def _after(self, text: str) -> str:
        """After the reasoning: whitespace, then the answer's own tag if the style has one."""
        body = (self._buf + text).lstrip()
        self._buf = ""
        if not body:
            return ""
        if self.answer_open:
            if body.startswith(self.answer_open):
                body = body[len(self.answer_open) :]
            elif self.answer_open.startswith(body):
                self._buf = body
                return ""
        self._state = _ANSWER
        return body

    def _answer(self, text: str, out: list[Segment]) -> str:
        """Answer text, as written; only the style's answer-closing tag is dropped."""
        buf, self._buf = self._buf + text, ""
        if self.answer_close:
            at = buf.find(self.answer_close)
            if at >= 0:
                if at:
                    out.append((ANSWER, buf[:at]))
                return buf[at + len(self.answer_close) :]
            keep = partial_suffix(buf, self.answer_close)
            buf, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if buf:
            out.append((ANSWER, buf))
        return ""

    def _think(self, text: str, out: list[Segment]) -> str:
        buf = self._buf + text
        self._buf = ""
        if self._label:  # a channel's name ("thought") opens it: not reasoning text
            body = buf.lstrip()
            if body.startswith(self._label):
                buf, self._label = body[len(self._label) :], ""
            elif self._label.startswith(body):
                self._buf = buf
                return ""
            else:
                self._label = ""
        if self._ids:  # tags come as tokens: all text here is reasoning
            self._reason(buf, out)
            return ""
        at = buf.find(self.close_tag)
        if at >= 0:
            self._reason(buf[:at], out)
            self._close(out)
            return buf[at + len(self.close_tag) :]
        keep = partial_suffix(buf, self.close_tag)
        self._buf = buf[len(buf) - keep :] if keep else ""
        self._reason(buf[: len(buf) - keep], out)
        return ""

    def _reason(self, text: str, out: list[Segment]) -> None:
        text = self._ws + text
        if not self._reasoned:
            text = text.lstrip()
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            out.append((REASONING, body))
            self._reasoned = True
