"""A GGUF vocabulary (`tokenizer.ggml.*`) as the `TableVocab` encoder llama.cpp would run.

One builder per `tokenizer.ggml.model` (llama.cpp's llama-vocab.cpp), each the plain-text
encoder behind `TableVocab`'s special-token cut:
- "gpt2" (byte-level BPE): a `tokenizers` BPE model built from tokens + merges, behind the
  split regexes llama.cpp uses for the file's `tokenizer.ggml.pre`.
- "llama" (SPM): `sentencepiece`, from a ModelProto of type BPE built from tokens / scores /
  types, because llama.cpp's SPM tokenizer *is* SentencePiece's BPE (merge the adjacent pair
  whose merged piece scores highest, leftmost on ties; characters with no piece fall back to
  <0xXX> byte pieces): no merge list to re-derive (transformers derives one, ~10 s for Gemma).
- "gemma4": llama.cpp's BPE session in its SentencePiece-style mode, a `tokenizers` BPE model
  with byte fallback (see `gguf_gemma4`).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxlis.errors import TokenizerError
from mlxlis.tokenizer.vocab import SPM_SPACE, PieceTable, TableVocab, spm_proto

import numpy as np
import tokenizers
from sentencepiece import SentencePieceProcessor

K = "tokenizer.ggml."  # GGUF metadata key prefix

# llama.cpp's pre-tokenizer split regexes (llama-vocab.cpp), applied in turn, matches isolated.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
# Qwen3.5: letters absorb combining marks (verbatim, llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "exaone4", "modern-bert"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), (_LLAMA3,)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (_LLAMA3,)),
}
# llama.cpp: a whole pre-split word that is itself a token is taken as is (llama-3 vocabularies).
IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"))
# Qwen2's own tokenizer NFC-normalises its input (transformers' Qwen2Tokenizer does; llama.cpp
# does not): "e" + U+0301 is then one token, as the model was trained. Not for qwen35, whose
# split keeps combining marks with their letter and whose llama.cpp test expects them unmerged.
_NFC = frozenset(("qwen2", "deepseek-r1-qwen"))
# llama.cpp's gemma4 split (LLAMA_VOCAB_PRE_TYPE_GEMMA4): lines and runs of newlines.
_GEMMA4_WORDS = re.compile(r"[^\n]+|\n+")


def gguf_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int], pre: Any, path: Path
) -> TableVocab:
    if pre is None:  # as llama.cpp: "missing pre-tokenizer type, using: 'default'"
        warnings.warn(f"{path}: no {K}pre; using llama.cpp's 'default' split", stacklevel=3)
        pre = "default"
    if pre not in PRE_SPLITS:
        msg = f"unknown pre-tokenizer {pre!r} (known: {', '.join(sorted(PRE_SPLITS))})"
        raise TokenizerError(msg, path=path, field=K + "pre")
    merges = _merges(metadata, "gpt2", path)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError("duplicate tokens", path=path, field=K + "tokens")
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
        bpe = tokenizers.models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES)
    except Exception as e:
        raise TokenizerError(f"bad merges: {e}", path=path, field=K + "merges") from e
    tk = tokenizers.Tokenizer(bpe)
    pt = tokenizers.pre_tokenizers
    splits = [pt.Split(tokenizers.Regex(r), "isolated") for r in PRE_SPLITS[pre]]
    tk.pre_tokenizer = pt.Sequence([*splits, pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _NFC:
        tk.normalizer = tokenizers.normalizers.NFC()
    plain = PieceTable(tokens, types, byte_level=True)
    return TableVocab(tokens, types, lambda s: tk.encode(s, add_special_tokens=False).ids, plain)


def gguf_spm(
    metadata: dict[str, Any],
    tokens: list[str],
    types: list[int],
    path: Path,
    *,
    unk: int | None,
    bos: int | None,
    eos: int | None,
) -> TableVocab:
    scores = array(metadata, "scores", len(tokens), path)
    scores = [0.0] * len(tokens) if scores is None else np.asarray(scores, np.float32).tolist()
    dummy = bool(metadata.get(K + "add_space_prefix", True))  # llama.cpp's SPM default
    proto = spm_proto(
        tokens, scores, types, unk_id=unk, bos_id=bos, eos_id=eos, add_dummy_prefix=dummy, path=path
    )
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto.SerializeToString())
    except Exception as e:  # e.g. a duplicate token
        raise TokenizerError(f"sentencepiece refuses it: {e}", path=path, field=K + "tokens") from e
    pieces = PieceTable(tokens, types, byte_level=False, strip_dummy_space=dummy)
    return TableVocab(tokens, types, sp.encode, pieces)


def gguf_gemma4(
    metadata: dict[str, Any], tokens: list[str], types: list[int], path: Path
) -> TableVocab:
    """llama.cpp's "gemma4" model: its BPE session with byte_encode=false and escaped spaces.

    Per text fragment (special tokens already cut out): every " " becomes "▁"; the text splits
    into lines and newline runs (`[^\\n]+|[\\n]+`); a newline run that is a token is that token;
    every other word is BPE-merged by merge rank (lowest first, leftmost on ties) over raw UTF-8
    characters, and a final symbol that is not a token falls back byte by byte to <0xXX>
    tokens. Scores are ignored. That BPE is the `tokenizers` BPE model with byte_fallback=True
    and no normaliser or pre-tokeniser: equal as long as every merge's parts and result are
    tokens (checked here; `tokenizers` refuses the file otherwise) -- then a character outside
    the vocabulary can join no merge, so falling back at the start (as `tokenizers` does) or at
    the end (as llama.cpp does) gives the same bytes.

    The model reaches `tokenizers` as its JSON form, written piecewise (`_bpe_json`). For the
    262k-token / 515k-merge Gemma 4 vocabulary (measured on a 2-core x86 VM): building it
    takes ~1.2 s, mostly `tokenizers` parsing; Python memory peaks at 34 MiB (a dict and a
    tuple per merge for the BPE constructor: 111 MiB for that step alone; one json.dumps of
    the whole: 90); the process at +170 MiB, of which the built tokenizer keeps ~90.
    """
    merges = _merges(metadata, "gemma4", path)
    if len(set(tokens)) != len(tokens):
        raise TokenizerError("duplicate tokens", path=path, field=K + "tokens")
    try:
        tk = tokenizers.Tokenizer.from_buffer(_bpe_json(tokens, merges))
    except Exception as e:  # a merge whose parts or result are not tokens, a bad "a b" form
        raise TokenizerError(f"bad merges: {e}", path=path, field=K + "merges") from e
    newline_runs = {t: i for i, t in enumerate(tokens) if t and not t.strip("\n")}

    def plain(text: str) -> list[int]:
        words: list[str | int] = [
            newline_runs.get(w, w) if w[0] == "\n" else w
            for w in _GEMMA4_WORDS.findall(text.replace(" ", SPM_SPACE))
        ]
        todo = [w for w in words if isinstance(w, str)]
        bpe: list[list[int]] = [[] for _ in todo]  # one call, one BPE word per entry of todo
        if todo:  # (not encode_batch: its thread pool would warn at every later fork)
            enc = tk.encode(todo, is_pretokenized=True, add_special_tokens=False)
            for i, w in zip(enc.ids, enc.word_ids, strict=True):
                bpe[w].append(i)
        done = iter(bpe)
        return [i for w in words for i in ([w] if isinstance(w, int) else next(done))]

    space_prefix = bool(metadata.get(K + "add_space_prefix", False))  # BPE's default: false
    pieces = PieceTable(
        tokens, types, byte_level=False, strip_dummy_space=space_prefix, clean_spaces=True
    )
    return TableVocab(tokens, types, plain, pieces)


def _bpe_json(tokens: list[str], merges: list[str], chunk: int = 8192) -> bytes:
    """`tokenizers`' JSON for a BPE model with byte fallback, no normaliser, no pre-tokeniser;
    merges in the "a b" form (`tokenizers` refuses one with a second space: a token holding a
    space, which llama.cpp would split at the first space past the first byte; SentencePiece
    style vocabularies spell spaces "▁"). Written a chunk of entries at a time, so that no
    Python object per token or merge outlives its chunk."""

    def entries(n: int, dump: Callable[[int], str]) -> bytes:  # inside a JSON object / array
        return b",".join(dump(a)[1:-1].encode() for a in range(0, n, chunk))

    vocab = entries(
        len(tokens), lambda a: json.dumps({t: a + k for k, t in enumerate(tokens[a : a + chunk])})
    )
    pairs = entries(len(merges), lambda a: json.dumps(merges[a : a + chunk]))
    head = b'{"version":"1.0","model":{"type":"BPE","byte_fallback":true,"vocab":{'
    return b"".join((head, vocab, b'},"merges":[', pairs, b"]}}"))


def _merges(metadata: dict[str, Any], kind: str, path: Path) -> list[str]:
    merges = metadata.get(K + "merges")
    if not isinstance(merges, list) or not merges or not isinstance(merges[0], str):
        raise TokenizerError(f"a {kind} vocabulary needs merges", path=path, field=K + "merges")
    return merges


def array(metadata: dict[str, Any], key: str, n: int, path: Path) -> Any:
    """`tokenizer.ggml.<key>` (None if absent), checked to hold one entry per token."""
    v = metadata.get(K + key)
    if v is not None and len(v) != n:
        raise TokenizerError(f"{len(v)} entries for {n} tokens", path=path, field=K + key)
    return v
