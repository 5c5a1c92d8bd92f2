"""Reasoning ("thinking") split from the answer in a reply's stream.

Qwen3-style models open their reply with `<think>`, reason, close with `</think>` and then
answer; some templates (Qwen3.5, DeepSeek-R1) put `<think>\\n` at the end of the generation
prompt, so the reply starts inside the reasoning with no opening tag. Gemma 4 reasons in a
channel: `<|channel>thought\\n…<channel|>`; Mistral's reasoning models write `[THINK]…[/THINK]`
(STYLES: the tag pairs and the channel label).
`ReasoningSplitter` turns decoded pieces into ("reasoning", text) / ("answer", text) segments:

- the tags are matched by token id when the tokenizer has each as a single token (its
  special / added tokens), else by text, held back while a piece could be the start of a tag;
- an opening tag counts only before any visible answer text, a closing tag only inside the
  reasoning: later tags are answer text (text matching) or dropped (ids);
- the tags never show; whitespace around the reasoning and right after `</think>` is dropped.

A reply without tags is all answer, byte for byte.
"""

from __future__ import annotations

from typing import Any, Protocol

from mlxlis.prompt.harmony import HarmonySplitter, speaks_harmony
from mlxlis.prompt.segments import ANSWER, REASONING, Segment, join, partial_suffix

__all__ = ["ANSWER", "REASONING", "ReasoningSplitter", "Segment", "Splitter", "join"]

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
# (open tag, close tag, label right after the open tag that is not reasoning text)
STYLES = (
    (OPEN_TAG, CLOSE_TAG, ""),
    ("<|channel>", "<channel|>", "thought"),
    ("[THINK]", "[/THINK]", ""),  # Magistral, Ministral 3 Reasoning (tags of its vocabulary)
)

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


def ends_after_reasoning(prompt: str, close_tag: str = CLOSE_TAG) -> bool:
    """True when the prompt ends right after a closed block (`<think>\\n\\n</think>\\n\\n`)."""
    return prompt.rstrip().endswith(close_tag)


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
    ):
        self.open_tag, self.close_tag, self.label = open_tag, close_tag, label
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
    def for_prompt(cls, tokenizer: Any, prompt: str) -> Splitter:
        """A splitter for the reply to `prompt`: harmony's after its generation prompt
        (gpt-oss, harmony.py); else this one with `tokenizer`'s tag ids when it has them,
        the first style whose two tags are tokens of the vocabulary, else `<think>` as text."""
        if speaks_harmony(prompt):
            return HarmonySplitter()
        style, ids = STYLES[0], {}
        for candidate in STYLES:
            if found := tag_ids(tokenizer, candidate[:2]):
                style, ids = candidate, found
                break
        open_tag, close_tag, label = style
        return cls(
            ids=ids,
            in_reasoning=starts_in_reasoning(prompt, open_tag),
            after_reasoning=ends_after_reasoning(prompt, close_tag),
            open_tag=open_tag,
            close_tag=close_tag,
            label=label,
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
        """Whatever is held back at the end of the reply."""
        out: list[Segment] = []
        buf, self._buf = self._buf, ""
        if self._state == _START and buf:
            out.append((ANSWER, buf))
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
                out.append((ANSWER, text))
                return
            if self._state == _AFTER:
                text = text.lstrip()
                if text:
                    self._state = _ANSWER
                continue
            if self._state == _START:
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
        if not body or (not self._ids and self.open_tag.startswith(body)):
            self._buf = buf
            return ""
        self._buf, self._state = "", _ANSWER
        return buf

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
