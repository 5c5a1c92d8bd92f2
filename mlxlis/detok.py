"""Ids back to text: per-token byte tables for GGUF / SentencePiece vocabularies, and streaming.

A GGUF vocabulary is decoded the way llama.cpp's `token_to_piece` does it: every token maps to
a fixed byte string (byte-level BPE spelling undone, SentencePiece's "▁" turned back into a
space, `<0xAB>` byte tokens into that byte), and the text is the UTF-8 decoding of their
concatenation. `StreamDecoder` works on any `Tokenizer` through its `decode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# GGUF `tokenizer.ggml.token_type` values (the same numbering as SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class PieceTable:
    """Token id -> the bytes it stands for, computed lazily (a 262k vocabulary costs nothing up front).

    byte_level: GPT-2 style vocabulary (normal tokens spelled in the byte alphabet); otherwise
    SentencePiece style. Control / unknown / unused tokens are rendered as their text unless
    skipped; user-defined tokens are raw text in both styles (as llama.cpp stores them).
    strip_dummy_space: drop the one space SentencePiece's add_dummy_prefix put before the first
    visible word, as sentencepiece's own decoder does.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int],
        *,
        byte_level: bool,
        strip_dummy_space: bool = False,
    ):
        self._tokens = tokens
        self._types = types
        self._byte_level = byte_level
        self._strip = strip_dummy_space
        self._cache: dict[int, bytes] = {}

    def piece(self, i: int) -> bytes:
        b = self._cache.get(i)
        if b is None:
            b = self._cache[i] = self._compute(i)
        return b

    def _compute(self, i: int) -> bytes:
        tok, kind = self._tokens[i], self._types[i]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            return tok.encode("utf-8")
        if self._byte_level:
            if kind == USER_DEFINED:
                return tok.encode("utf-8")
            return b"".join(
                bytes((_UNICODE_TO_BYTE[c],)) if c in _UNICODE_TO_BYTE else c.encode("utf-8")
                for c in tok
            )
        if kind == BYTE and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            return bytes((int(tok[3:5], 16),))
        return tok.replace(SPM_SPACE, " ").encode("utf-8")

    def decode(self, ids: Sequence[int], skip: frozenset[int] | set[int] = frozenset()) -> str:
        n = len(self._tokens)
        parts: list[bytes] = []
        for i in ids:
            i = int(i)
            if i < 0 or i >= n:
                raise IndexError(f"token id {i} is outside the vocabulary (size {n})")
            if i in skip:
                continue
            piece = self.piece(i)
            if self._strip and not parts and self._types[i] == NORMAL and piece[:1] == b" ":
                piece = piece[1:]
            parts.append(piece)
        return b"".join(parts).decode("utf-8", errors="replace")


class StreamDecoder:
    """Streaming detokenisation: `add(id)` returns the text that token completed.

    Decodes only a small window of recent ids: the ids since the last emitted text (`_pending`)
    and the few before them (`_context`), and emits the part of decode(context + pending) past
    decode(context). Text ending in U+FFFD is held back (an unfinished UTF-8 character, e.g.
    an emoji split over byte-fallback tokens) until a later token completes it, or `flush()`.

    Leading-space rules (SentencePiece's dummy prefix, the `Strip` decoder of tokenizer.json)
    apply to the first visible token of a decode call, so a window that starts mid-stream would
    lose the space of its first word. Mid-stream windows therefore start with a fixed anchor
    token (the encoding of "a"), which takes that first-token treatment in both decodes.
    """

    def __init__(self, tok: Tokenizer, *, skip_special: bool = False):
        self._tok = tok
        self._skip = skip_special
        self._anchor = tok.encode("a", add_bos=False)
        self._at_start = True  # nothing emitted yet and no context: decode as from the start
        self._context: list[int] = []
        self._pending: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        if self._at_start:
            return self._tok.decode(ids, skip_special=self._skip)
        return self._tok.decode(self._anchor + ids, skip_special=self._skip)

    def add(self, token_id: int) -> str:
        self._pending.append(int(token_id))
        before = self._decode(self._context)
        after = self._decode(self._context + self._pending)
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        self._context = self._pending[-2:] if len(self._pending) > 1 else self._pending
        self._pending = []
        self._at_start = False
        return after[len(before):]

    def flush(self) -> str:
        """Everything still held back (a trailing U+FFFD stays if the bytes really are broken)."""
        if not self._pending:
            return ""
        before = self._decode(self._context)
        after = self._decode(self._context + self._pending)
        self._pending = []
        return after[len(before):] if after.startswith(before) else after
