"""The GGUF vocabularies of llama.cpp's encoder models as `tokenizers` pipelines, with the
post-processor a cross-encoder's pairs need ([CLS] a [SEP] b [SEP] / <s> a </s></s> b </s>).

- "bert" (llama.cpp's WPM): the converter stores WordPiece's vocabulary in "phantom space"
  form: a word-initial piece as "▁piece", a continuation "##piece" as "piece", control tokens
  as they are. Spelled back, it is `tokenizers`' WordPiece behind BERT's normaliser and
  pre-tokeniser, which is the split llama.cpp's session makes: whitespace and control
  characters dropped, punctuation (and ASCII symbols) and CJK ideographs single words, then
  longest-first matching inside each word, a word with any unmatched rest becoming [UNK].
  Lowercasing and accent stripping are the file's tokenizer.ggml.normalizer.* keys (absent:
  lowercase, as llama.cpp's default; strip_accents absent: as lowercase), as llama.cpp reads
  them. [CLS] is bos_token_id (absent: 101), [SEP] seperator_token_id (absent: 102).
  llama.cpp puts no length limit on a word (transformers' WordPiece: 100 characters): none
  here either.
- "gpt2" of a ModernBERT (`modern-bert`) file: byte-level BPE from tokens + merges behind the
  split llama.cpp uses for the file's pre-tokenizer (tokenizer.gguf.PRE_SPLITS), [CLS] a [SEP]
  b [SEP] around it. (A RoBERTa file's BPE would need RoBERTa's pairs: refused.)
- "t5" (llama.cpp's UGM, XLM-RoBERTa's SentencePiece unigram): `tokenizers`' Unigram over the
  pieces and scores, normalised by the file's precompiled_charsmap, extra whitespace removed
  where remove_extra_whitespaces says, a "▁" prefixed where add_space_prefix says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxlis.errors import TokenizerError
from mlxlis.tokenizer.gguf import PRE_SPLITS
from mlxlis.tokenizer.vocab import CONTROL, UNKNOWN, USER_DEFINED

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

K = "tokenizer.ggml."
PHANTOM = "\u2581"  # "▁": the converter's mark of a word's first piece
NO_WORD_LIMIT = 1 << 30  # llama.cpp matches words of any length


def _id(md: dict[str, Any], key: str, n: int, path: Path, default: int | None = None) -> int:
    v = md.get(K + key, default)
    if v is None or not isinstance(v, int | np.integer) or not 0 <= v < n:
        raise TokenizerError(f"{v!r} is not a token id", path=path, field=K + key)
    return int(v)


def _specials(tk: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as `tokenizers`' special added tokens (cut out of text only
    where asked), user-defined ones as added tokens matched whole, as llama.cpp does."""
    kinds = list(zip(tokens, types, strict=True))
    tk.add_special_tokens(
        [AddedToken(t, special=True) for t, k in kinds if k in (CONTROL, UNKNOWN)]
    )
    tk.add_tokens([AddedToken(t) for t, k in kinds if k == USER_DEFINED])


def wordpiece(
    md: dict[str, Any], tokens: list[str], types: list[int], path: Path
) -> tokenizers.Tokenizer:
    """A "bert" vocabulary: single texts as [CLS] text [SEP], pairs [CLS] a [SEP] b [SEP] with
    token types 0 then 1."""
    n = len(tokens)
    spelled = []
    for t, k in zip(tokens, types, strict=True):
        if t.startswith(PHANTOM):
            spelled.append(t[len(PHANTOM) :])
        elif k == CONTROL:  # the converter writes control tokens as they are
            spelled.append(t)
        else:
            spelled.append("##" + t)
    vocab = {t: i for i, t in enumerate(spelled)}
    if len(vocab) != n:
        raise TokenizerError("two tokens spell the same piece", path=path, field=K + "tokens")
    unk = _id(md, "unknown_token_id", n, path, 100)  # llama.cpp's WPM defaults
    cls = _id(md, "bos_token_id", n, path, 101)
    sep = _id(md, "seperator_token_id", n, path, 102)
    tk = tokenizers.Tokenizer(
        models.WordPiece(vocab, unk_token=spelled[unk], max_input_chars_per_word=NO_WORD_LIMIT)
    )
    lower = bool(md.get(K + "normalizer.lowercase", True))
    strip = bool(md.get(K + "normalizer.strip_accents", lower))
    tk.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip, lowercase=lower
    )
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    c, s = spelled[cls], spelled[sep]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{c} $A {s}", pair=f"{c} $A {s} $B:1 {s}:1", special_tokens=[(c, cls), (s, sep)]
    )
    _specials(tk, spelled, types)
    return tk


def unigram(
    md: dict[str, Any], tokens: list[str], types: list[int], path: Path
) -> tokenizers.Tokenizer:
    """A "t5" vocabulary as XLM-RoBERTa uses it: single texts as <s> text </s>, pairs as
    <s> a </s></s> b </s> (one token type)."""
    n = len(tokens)
    scores = md.get(K + "scores")
    if scores is None or len(scores) != n:
        raise TokenizerError(
            "a unigram vocabulary needs one score a token", path=path, field=K + "scores"
        )
    unk = _id(md, "unknown_token_id", n, path, 2)
    bos = _id(md, "bos_token_id", n, path)
    eos = _id(md, "eos_token_id", n, path, 1)
    try:
        model = models.Unigram(
            list(zip(tokens, np.asarray(scores, np.float64).tolist(), strict=True)), unk, False
        )
    except Exception as e:
        raise TokenizerError(f"bad unigram vocabulary: {e}", path=path, field=K + "tokens") from e
    tk = tokenizers.Tokenizer(model)
    steps = []
    charsmap = md.get(K + "precompiled_charsmap")
    if charsmap is not None:
        try:
            steps.append(normalizers.Precompiled(bytes(np.asarray(charsmap, np.uint8))))
        except Exception as e:
            raise TokenizerError(
                f"unreadable: {e}", path=path, field=K + "precompiled_charsmap"
            ) from e
    if md.get(K + "remove_extra_whitespaces", False):
        steps += [normalizers.Strip(), normalizers.Replace(tokenizers.Regex(" {2,}"), " ")]
    if steps:
        tk.normalizer = normalizers.Sequence(steps)
    prefix = "always" if md.get(K + "add_space_prefix", True) else "never"
    tk.pre_tokenizer = pre_tokenizers.Metaspace(PHANTOM, prepend_scheme=prefix)
    tk.decoder = decoders.Metaspace(PHANTOM, prepend_scheme=prefix)
    b, e = tokens[bos], tokens[eos]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{b} $A {e}", pair=f"{b} $A {e} {e} $B {e}", special_tokens=[(b, bos), (e, eos)]
    )
    _specials(tk, tokens, types)
    return tk


def byte_bpe(
    md: dict[str, Any], tokens: list[str], types: list[int], path: Path
) -> tokenizers.Tokenizer:
    """A ModernBERT "gpt2" vocabulary: single texts as [CLS] text [SEP], pairs as [CLS] a
    [SEP] b [SEP]."""
    n, pre = len(tokens), md.get(K + "pre", "default")
    if pre not in PRE_SPLITS:
        raise TokenizerError(f"unknown pre-tokenizer {pre!r}", path=path, field=K + "pre")
    merges = md.get(K + "merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise TokenizerError("a gpt2 vocabulary needs merges", path=path, field=K + "merges")
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
        tk = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs))
    except Exception as e:
        raise TokenizerError(f"bad merges: {e}", path=path, field=K + "merges") from e
    split = [pre_tokenizers.Split(tokenizers.Regex(r), "isolated") for r in PRE_SPLITS[pre]]
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [*split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    cls = _id(md, "bos_token_id", n, path)
    sep = _id(md, "seperator_token_id", n, path, md.get(K + "eos_token_id"))
    c, s = tokens[cls], tokens[sep]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{c} $A {s}", pair=f"{c} $A {s} $B {s}", special_tokens=[(c, cls), (s, sep)]
    )
    _specials(tk, tokens, types)
    return tk


# tokenizer.ggml.model -> its builder (metadata, tokens, types, path) -> tokenizers.Tokenizer
ENCODER_VOCABS = {"bert": wordpiece, "t5": unigram, "modern-bert": byte_bpe}


def encoder_vocab(md: dict[str, Any], path: Path) -> tokenizers.Tokenizer:
    """The file's encoder vocabulary with its post-processor; any other kind refused by name."""
    kind = md.get(K + "model")
    if kind == "gpt2" and md.get("general.architecture") == "modern-bert":
        kind = "modern-bert"
    if kind not in ENCODER_VOCABS:
        raise TokenizerError(
            f"an encoder's vocabulary of kind {kind!r} is not read (known: bert, t5; gpt2 for"
            " modern-bert)",
            path=path,
            field=K + "model",
        )
    tokens = md.get(K + "tokens")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise TokenizerError("missing or not a string array", path=path, field=K + "tokens")
    types = md.get(K + "token_type")
    if types is None or len(types) != len(tokens):
        raise TokenizerError("expected one type a token", path=path, field=K + "token_type")
    return ENCODER_VOCABS[kind](md, tokens, np.asarray(types).tolist(), path)
