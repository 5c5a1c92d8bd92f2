"""gpt-oss's harmony format, read from a reply's stream.

After the generation prompt `<|start|>assistant` the model writes messages, each a header up
to `<|message|>` and a body up to `<|end|>` (more follows), `<|return|>` (the answer is done)
or `<|call|>` (a tool call is done; the last two are end-of-reply tokens the engine stops at):

    <|channel|>analysis<|message|>…reasoning…<|end|>
    <|start|>assistant<|channel|>final<|message|>…answer…<|return|>
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{…}<|call|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}

(the template renders the recipient before the channel; the model writes it on either side).
`HarmonySplitter` has ReasoningSplitter's interface: the `analysis` channel is reasoning, the
`final` channel and commentary without a recipient (a preamble to the user) are answer, two
answer messages joined by a blank line; a message to `functions.NAME` comes out as answer
text in one canonical form, `to=functions.NAME<|message|>{…}<|call|>`, which the tool-call
parser reads (tool_formats.HARMONY), so that calls go the way of every other format. The
special tokens come as text (the stream decodes them), so everything is matched as text.
A reply that writes no header at all is answer text, as it came.
"""

from __future__ import annotations

import re

from mlxlis.prompt.segments import ANSWER, REASONING, Segment, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
GENERATION_PROMPT = "<|start|>assistant"
CALL_OPEN = "to=functions."  # the canonical call text the tool-call parser reads
BODY_ENDS = (END, CALL, RETURN, START)
HEADER_MAX = 512  # characters of header without <|message|>: the model is not writing one
# how a header starts: a tag, or the recipient the template writes before the channel
HEADS = ("<|", "to=")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def speaks_harmony(prompt: str) -> bool:
    """The prompt ends with harmony's generation prompt (its tags are matched as text, so a
    vocabulary without them as tokens is read the same way)."""
    return prompt.endswith(GENERATION_PROMPT)


class HarmonySplitter:
    """Feed `(text, token)` per generated token; get the segments that text completes."""

    # what Anthropic's thinking budget matches and forces (processors.ReasoningBudget)
    open_tag = CHANNEL + "analysis" + MESSAGE
    close_tag = END + GENERATION_PROMPT + CHANNEL + "final" + MESSAGE

    def __init__(self) -> None:
        self._buf = ""  # the header so far, or body text that may be the start of a tag
        self._kind: str | None = None  # the open message's: REASONING, ANSWER, or "call"
        self._ws = ""  # the body's whitespace, held until more text follows it
        self._fresh = True  # nothing of the open message's body emitted yet (none open)
        self._answered = False  # some answer text was emitted (a next one needs a break)
        self.saw_reasoning = False
        self.reasoning_tokens = 0

    @property
    def in_reasoning(self) -> bool:
        return self._kind == REASONING

    @property
    def end_tags(self) -> tuple[str, ...]:
        """The analysis message ends at <|end|>, whichever message follows it."""
        return (END,)

    def feed(self, text: str, token: int | None = None) -> list[Segment]:
        out: list[Segment] = []
        if token is not None and self._kind == REASONING:
            self.reasoning_tokens += 1
        self._buf += text
        while self._buf:
            if self._kind is None and not self._header(out):
                break
            if self._kind is not None and not self._body(out):
                break
        return out

    def flush(self) -> list[Segment]:
        """Whatever is held at the end of the reply (a call the end-of-reply token closed
        gets its canonical end; an unfinished header shows nothing)."""
        out: list[Segment] = []
        buf, self._buf = self._buf, ""
        if self._kind is None:
            head = buf.lstrip()
            if head and not head.startswith(HEADS):  # never a header: plain answer text
                self._open(ANSWER)
                self._emit(buf, out)
        else:
            self._emit(buf, out)
        self._end(out)
        return out

    # --- internals ---
    def _header(self, out: list[Segment]) -> bool:
        """Read the header when it is whole; False while it is not."""
        at = self._buf.find(MESSAGE)
        if at < 0:
            head = self._buf.lstrip()
            if len(self._buf) > HEADER_MAX or (
                head and not any(head.startswith(h) or h.startswith(head) for h in HEADS)
            ):  # not harmony: answer text as it came, to the next tag
                self._open(ANSWER)
                cut = self._buf.find(START, 1)
                cut = len(self._buf) if cut < 0 else cut
                self._emit(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return True
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE) :]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            self._open("call")
            out.append((ANSWER, CALL_OPEN + recipient.group(1) + MESSAGE))
        elif channel is not None and channel.group(1) == "analysis":
            self._open(REASONING)
            self.saw_reasoning = True
        else:
            self._open(ANSWER)
        return True

    def _open(self, kind: str) -> None:
        self._kind, self._ws, self._fresh = kind, "", True

    def _body(self, out: list[Segment]) -> bool:
        """Emit the body up to its end tag (then back to a header); False when the rest may
        be the start of a tag."""
        ends = [(i, tag) for tag in BODY_ENDS if (i := self._buf.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self._emit(self._buf[:at], out)
            self._end(out)
            self._buf = self._buf[at + (0 if tag == START else len(tag)) :]
            return True
        keep = max(partial_suffix(self._buf, tag) for tag in BODY_ENDS)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        self._emit(text, out)
        return False

    def _emit(self, text: str, out: list[Segment]) -> None:
        if self._kind == "call":  # arguments verbatim: the parser reads them whole
            if text:
                out.append((ANSWER, text))
            return
        text = text.lstrip() if self._fresh else self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if not body:
            return
        if self._kind == REASONING:
            out.append((REASONING, body))
        else:  # a second answer message (after a preamble) starts on a paragraph of its own
            out.append((ANSWER, ("\n\n" if self._fresh and self._answered else "") + body))
            self._answered = True
        self._fresh = False

    def _end(self, out: list[Segment]) -> None:
        if self._kind == "call":
            out.append((ANSWER, CALL))
        self._kind, self._ws = None, ""
