"""The vocabulary backends a `Tokenizer` drives, and ids back to text.

- `TableVocab`: a GGUF or SentencePiece vocabulary as token texts + types; `Splitter` cuts
  special and user-defined token text out of the input before the model encoder sees it.
- `JsonVocab`: a tokenizer.json through the `tokenizers` library.
- `PieceTable`: ids -> text the way llama.cpp's `token_to_piece` does it: every token maps to
  fixed bytes (byte-level BPE spelling undone, SentencePiece's "▁" turned back into a space,
  `<0xAB>` byte tokens into that byte); the text is the UTF-8 decoding of their concatenation,
  after llama.cpp's `clean_spaces` pass where the vocabulary has one (`clean_spaces`).
- `spm_proto`: a GGUF "llama" vocabulary as a SentencePiece model.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mlxlis.errors import TokenizerError

import numpy as np
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

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
    """Token id -> the bytes it stands for, computed lazily (free to build for 262k tokens).

    byte_level: GPT-2 style vocabulary (normal tokens spelled in the byte alphabet); otherwise
    SentencePiece style. Control / unknown / unused tokens are rendered as their text unless
    skipped; user-defined tokens are raw text in both styles (as llama.cpp stores them).
    strip_dummy_space: drop the one space SentencePiece's add_dummy_prefix put before the first
    visible word, as sentencepiece's own decoder does.
    clean_spaces: `decode` applies llama.cpp's detokenize clean-up (see `clean_spaces`) unless
    told not to.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int],
        *,
        byte_level: bool,
        strip_dummy_space: bool = False,
        clean_spaces: bool = False,
    ):
        self._tokens = tokens
        self._types = types
        self._byte_level = byte_level
        self._strip = strip_dummy_space
        self._clean = clean_spaces
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

    def decode(
        self, ids: Sequence[int], skip: frozenset[int] | set[int] = frozenset(), clean: bool = True
    ) -> str:
        n = len(self._tokens)
        parts: list[bytes] = []
        for i in ids:
            i = int(i)
            if i < 0 or i >= n:
                raise TokenizerError(f"token id {i} is outside the vocabulary (size {n})")
            if i in skip:
                continue
            piece = self.piece(i)
            if self._strip and not parts and self._types[i] == NORMAL and piece[:1] == b" ":
                piece = piece[1:]
            parts.append(piece)
        text = b"".join(parts)
        if self._clean and clean:
            text = clean_spaces(text)
        return text.decode("utf-8", errors="replace")


def clean_spaces(text: bytes) -> bytes:
    """llama.cpp's `clean_spaces` (llama_vocab::impl::detokenize), its three passes over the
    bytes in order: drop a space before ? ! . , -- then " ' " becomes "'" (left to right, a
    match's closing space never opens the next) -- then drop a space before 's 'm 're 've."""
    text = re.sub(rb" (?=[?!.,])", b"", text)
    text = re.sub(rb" ' ", b"'", text)
    return re.sub(rb" (?='[sm]|'re|'ve)", b"", text)


# llama.cpp's end-of-generation texts (llama-vocab.cpp `special_eog_ids`): stop tokens, since a
# GGUF rarely carries tokenizer.ggml.eot_token_id (Gemma's <end_of_turn> is found this way).
EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|eom_id|> <EOT> _<EOT> "
    "<|end_of_text|> <end_of_utterance> <eos> <turn|> <|tool_response>".split()
)


class Splitter:
    """Cuts special-token text out of a string (leftmost, longest match) with a character trie."""

    def __init__(self, always: dict[str, int], special: dict[str, int]):
        self._tables = {False: always, True: {**special, **always}}
        self._built: dict[bool, tuple[dict, re.Pattern[str]] | None] = {}

    def _get(self, special: bool) -> tuple[dict, re.Pattern[str]] | None:
        if special not in self._built:  # built on first use: Gemma has 6k control tokens
            trie: dict = {}
            for text, i in self._tables[special].items():
                node = trie
                for ch in text:
                    node = node.setdefault(ch, {})
                node[""] = i  # "" is never a character: it marks where a token ends
            starts = "[" + "".join(re.escape(c) for c in trie) + "]"
            self._built[special] = (trie, re.compile(starts)) if trie else None
        return self._built[special]

    def split(self, text: str, special: bool) -> list[str | int]:
        """Text pieces (str) and token ids (int), in order."""
        built = self._get(special)
        if built is None:
            return [text]
        trie, starts = built
        out: list[str | int] = []
        pos = i = 0
        while (m := starts.search(text, i)) is not None:
            j = k = m.start()
            node, best = trie, None
            while k < len(text) and (node := node.get(text[k])) is not None:
                k += 1
                if "" in node:
                    best = (k, node[""])
            if best is None:
                i = j + 1
                continue
            out += [text[pos:j], best[1]] if j > pos else [best[1]]
            pos = i = best[0]
        return out + [text[pos:]] if pos < len(text) else out


class TableVocab:
    """A vocabulary of token texts + types (GGUF, tokenizer.model) and a plain-text encoder.

    Special / user-defined token text is cut out before `plain` sees the text, as llama.cpp's
    `tokenizer_st_partition` does: user-defined tokens always, control tokens with special=True.
    `user_defined` replaces the user-defined table (a tokenizer.model matches its own).
    """

    def __init__(
        self,
        tokens: list[str],
        types: list[int],
        plain: Callable[[str], list[int]],
        pieces: PieceTable,
        user_defined: dict[str, int] | None = None,
    ):
        t = np.asarray(types)
        ids = np.flatnonzero
        self.vocab_size = len(tokens)
        self._tokens, self._plain, self._pieces = tokens, plain, pieces
        self.special_tokens = {tokens[i]: int(i) for i in ids((t == CONTROL) | (t == UNKNOWN))}
        for i, tok in enumerate(tokens):  # llama.cpp makes these control whatever their type
            if tok in EOG_TEXTS:
                self.special_tokens.setdefault(tok, i)
        if user_defined is None:  # ... so a user-defined one is no longer cut out of plain text
            user_defined = {tokens[i]: int(i) for i in ids(t == USER_DEFINED)}
            user_defined = {k: i for k, i in user_defined.items() if k not in EOG_TEXTS}
        self._splitter = Splitter(user_defined, self.special_tokens)
        self.special_ids = frozenset(self.special_tokens.values()) | set(ids(t == UNUSED).tolist())
        self._ids: dict[str, int] | None = None

    def encode(self, text: str, special: bool) -> list[int]:
        ids: list[int] = []
        for part in self._splitter.split(text, special):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids += self._plain(part)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool, clean: bool = True) -> str:
        return self._pieces.decode(ids, self.special_ids if skip_special else frozenset(), clean)

    def id_to_token(self, i: int) -> str:
        return self._tokens[i]

    def token_bytes(self, i: int) -> bytes:
        return self._pieces.piece(i)

    def token_to_id(self, text: str) -> int | None:
        if self._ids is None:
            self._ids = {t: i for i, t in enumerate(self._tokens)}
        return self._ids.get(text)


class JsonVocab:
    """tokenizer.json through `tokenizers`, its added-token handling included."""

    def __init__(self, tk: Any):
        tk.no_truncation()
        tk.no_padding()
        self._tk = tk
        self._lock = threading.Lock()  # encode_special_tokens is a flag on the shared object
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        added = tk.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        self.id_to_token, self.token_to_id = tk.id_to_token, tk.token_to_id
        self._pieces: PieceTable | None = None

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for, read through the same tables as a GGUF vocabulary:
        `tokenizers` only decodes whole sequences (a lone byte-fallback token gives U+FFFD)."""
        if self._pieces is None:
            self._pieces = self._piece_table()
        return self._pieces.piece(i)

    def _piece_table(self) -> PieceTable:
        import json

        spec = json.loads(self._tk.to_str())
        decoders = [spec.get("decoder") or {}]
        decoders += decoders[0].get("decoders") or []  # a Sequence decoder's parts
        byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        added = self._tk.get_added_tokens_decoder()
        tokens, types = [], []
        for i in range(self.vocab_size):
            tok = self._tk.id_to_token(i) or ""
            if i in added:
                kind = CONTROL if added[i].special else USER_DEFINED
            elif byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
                kind = BYTE
            else:
                kind = NORMAL
            tokens.append(tok)
            types.append(kind)
        return PieceTable(tokens, types, byte_level=byte_level)

    def encode(self, text: str, special: bool, add_special_tokens: bool = False) -> list[int]:
        with self._lock:
            self._tk.encode_special_tokens = not special
            return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special: bool, clean: bool = True) -> str:
        ids = [int(i) for i in ids]  # `clean`: tokenizer.json's decoder has no such pass
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise TokenizerError(f"a token id in {ids} is outside the vocabulary")
        return self._tk.decode(ids, skip_special_tokens=skip_special)


def spm_proto(
    tokens: list[str],
    scores: Sequence[float],
    types: list[int],
    *,
    unk_id: int | None,
    add_dummy_prefix: bool,
    bos_id: int | None = None,
    eos_id: int | None = None,
    path: str | os.PathLike = "",
) -> spm_pb2.ModelProto:
    """A SentencePiece BPE model equal to a GGUF "llama" vocabulary (save it as tokenizer.model)."""
    if unk_id is None:  # sentencepiece needs exactly one unknown piece
        raise TokenizerError("no unknown token", path=path, field="tokenizer.ggml.unknown_token_id")
    proto = spm_pb2.ModelProto()
    ts, ns = proto.trainer_spec, proto.normalizer_spec
    ts.model_type, ts.vocab_size = spm_pb2.TrainerSpec.BPE, len(tokens)
    ts.unk_id, ts.unk_piece = unk_id, tokens[unk_id]
    ts.bos_id = -1 if bos_id is None else bos_id
    ts.eos_id = -1 if eos_id is None else eos_id
    ts.pad_id = -1
    ts.bos_piece = "" if bos_id is None else tokens[bos_id]
    ts.eos_piece = "" if eos_id is None else tokens[eos_id]
    ns.name = "identity"  # llama.cpp only escapes spaces: no NFKC, no whitespace collapsing
    ns.add_dummy_prefix = add_dummy_prefix
    ns.remove_extra_whitespaces, ns.escape_whitespaces = False, True
    kinds = np.array(types)
    kinds[(kinds < NORMAL) | (kinds > BYTE)] = NORMAL  # undefined types: normal, as llama.cpp
    kinds[kinds == UNKNOWN] = CONTROL
    kinds[unk_id] = UNKNOWN
    ts.byte_fallback = int((kinds == BYTE).sum()) == 256
    pieces = list(tokens)
    spaced = [i for i in np.flatnonzero(kinds == USER_DEFINED).tolist() if " " in pieces[i]]
    if spaced:  # sentencepiece matches user-defined pieces in space-escaped text: "  " -> "▁▁"
        known = set(pieces)
        for i in spaced:
            respelled = pieces[i].replace(" ", SPM_SPACE)
            pieces[i] = pieces[i] if respelled in known else respelled
    for i in (i for i, p in enumerate(pieces) if not p):
        pieces[i] = f"[EMPTY_{i}]"  # llama.cpp's name for them; sentencepiece refuses ""
    add = proto.pieces.add
    for piece, score, kind in zip(pieces, scores, kinds.tolist(), strict=True):
        add(piece=piece, score=score, type=kind)
    return proto
