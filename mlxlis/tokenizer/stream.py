"""The streaming detokenizer: token ids in, each token's completed text out."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxlis.tokenizer.tokenizer import Tokenizer


class StreamDecoder:
    """Streaming detokenisation: `add(id)` returns the text that token completed.

    Decodes only a small window: the ids since the last fully emitted text (`_pending`) after
    the last two ids before them (`_context`), and emits the part of decode(context + pending)
    past decode(context). A window whose text ends in U+FFFD (an unfinished UTF-8 character,
    e.g. an emoji split over byte-fallback tokens) emits only what precedes the U+FFFD run and
    waits for the next token; `flush()` gives whatever is left, broken bytes included.

    Leading-space rules (SentencePiece's dummy prefix, tokenizer.json's `Strip` decoder) apply
    to the first visible token of a decode call, so a window starting mid-stream would drop the
    space of its first word. Until text has been emitted the window is the whole stream; after
    that it starts with a fixed anchor (the ids of "a"), which takes the first-token treatment
    in both decodes and leaves the window's own spaces alone.

    The text is the tokens' own pieces, without a vocabulary's clean-up pass (llama.cpp streams
    `token_to_piece` too): that pass looks across token boundaries, so it cannot be streamed.
    """

    def __init__(self, tok: Tokenizer, *, skip_special: bool = False):
        self._tok = tok
        self._skip = skip_special
        self._anchor = tok.encode("a", add_bos=False, add_eos=False)
        self._from_start = True  # no visible text yet: the window is the whole stream
        self._context: list[int] = []
        self._pending: list[int] = []
        self._sent = 0  # chars of the pending text already emitted

    def _new_text(self) -> str:
        prefix = [] if self._from_start else self._anchor

        def text(ids: list[int]) -> str:
            return self._tok.decode(prefix + ids, skip_special=self._skip, clean_spaces=False)

        before, after = text(self._context), text(self._context + self._pending)
        return after[len(before) :]

    def add(self, token_id: int) -> str:
        self._pending.append(int(token_id))
        new = self._new_text()
        if new.endswith("\ufffd"):
            stable = len(new.rstrip("\ufffd"))
            out = new[self._sent : stable]
            self._sent = max(self._sent, stable)
            return out
        out = new[self._sent :]
        window = self._context + self._pending
        if self._from_start and not (self._sent or out):
            self._context = window  # still invisible (e.g. a skipped BOS): keep it all
        else:
            self._context = window[-2:]
            self._from_start = False
        self._pending = []
        self._sent = 0
        return out

    def flush(self) -> str:
        """Whatever is held back (a trailing U+FFFD stays if the bytes really are broken)."""
        if not self._pending:
            return ""
        out = self._new_text()[self._sent :]
        self._context = (self._context + self._pending)[-2:]
        self._pending = []
        self._sent = 0
        self._from_start = False
        return out
