"""Mistral's Tekken vocabulary (`tekken.json`) as a `tokenizers` byte-level BPE.

tekken.json holds a tiktoken-style vocabulary: a split `pattern`, the tokens' bytes in rank
order (base64) and the special tokens by rank. Ids: the specials first (0 … n − 1, `<SPECIAL_i>`
filling ranks the file does not name, up to config.default_num_special_tokens), then each
vocabulary token at n + its rank; the vocabulary cut to config.default_vocab_size − n (the
layout of mistral_common's Tekkenizer). BPE merges are the ranks' own: a token of rank r is the
merge of its two parts (both in the vocabulary) ranked lowest, at r — what tiktoken's encoder
does by ranks, written as a merge list so that the `tokenizers` library runs it (the same
construction as transformers' MistralConverter). Its vocabularies (~130 000 tokens) build in a
few seconds.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from mlxlis.errors import TokenizerError
from mlxlis.tokenizer.vocab import bytes_to_unicode

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

FILLER = "<SPECIAL_{}>"


def load_tekken(path: Path) -> tokenizers.Tokenizer:
    def bad(msg: str, fld: str) -> TokenizerError:
        return TokenizerError(msg, path=path, field=fld)

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TokenizerError(f"cannot read: {e}"[:300], path=path) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("config"), dict):
        raise bad("missing or not an object", "config")
    config = raw["config"]
    pattern = config.get("pattern")
    if not isinstance(pattern, str):
        raise bad("expected the split pattern (a string)", "config.pattern")
    specials = raw.get("special_tokens")
    if not isinstance(specials, list) or not all(
        isinstance(s, dict)
        and isinstance(s.get("rank"), int)
        and isinstance(s.get("token_str"), str)
        for s in specials
    ):
        raise bad(
            "expected a list of {rank, token_str} (an older tekken.json without it is not "
            "supported)",
            "special_tokens",
        )
    ranks = sorted(s["rank"] for s in specials)
    if ranks != list(range(len(ranks))):
        raise bad("ranks must run 0, 1, … without gaps", "special_tokens")
    n_special = config.get("default_num_special_tokens", len(specials))
    if not isinstance(n_special, int) or n_special < len(specials):
        raise bad(f"must be at least {len(specials)}", "config.default_num_special_tokens")
    names = [s["token_str"] for s in sorted(specials, key=lambda s: s["rank"])]
    names += [FILLER.format(i) for i in range(len(names), n_special)]
    vocab_raw = raw.get("vocab")
    if not isinstance(vocab_raw, list):
        raise bad("expected a list of tokens", "vocab")
    size = config.get("default_vocab_size")
    if size is not None:
        if not isinstance(size, int) or size <= n_special:
            raise bad(f"must exceed the {n_special} special tokens", "config.default_vocab_size")
        vocab_raw = vocab_raw[: size - n_special]
    try:
        tokens = [base64.b64decode(t["token_bytes"], validate=True) for t in vocab_raw]
    except (TypeError, KeyError, binascii.Error):
        raise bad("each token needs its token_bytes (base64)", "vocab") from None
    rank_of = {t: r for r, t in enumerate(tokens)}
    if len(rank_of) != len(tokens) or any(bytes([b]) not in rank_of for b in range(256)):
        raise bad("tokens must be distinct and include every single byte", "vocab")

    enc = bytes_to_unicode()
    text = {t: "".join(enc[b] for b in t) for t in tokens}
    merges: list[tuple[int, str, str]] = []
    for tok, rank in rank_of.items():
        if len(tok) < 2:
            continue
        parts = [
            (rank_of[tok[:i]], rank_of[tok[i:]], i)
            for i in range(1, len(tok))
            if tok[:i] in rank_of and tok[i:] in rank_of
        ]
        for _, _, i in sorted(parts):
            merges.append((rank, text[tok[:i]], text[tok[i:]]))
    merges.sort(key=lambda m: m[0])  # stable: a token's own splits stay in rank order
    ids = {text[t]: r + n_special for t, r in rank_of.items()}
    clash = next((n for n in names if n in ids), None)
    if clash is not None:
        raise bad(f"special token {clash!r} is also a vocabulary token", "special_tokens")
    ids.update({name: i for i, name in enumerate(names)})  # the specials at their ranks
    model = tokenizers.models.BPE(ids, [(a, b) for _, a, b in merges], fuse_unk=False)
    if hasattr(model, "ignore_merges"):
        model.ignore_merges = True  # a whole pre-token in the vocabulary is one token (tiktoken)
    tk = tokenizers.Tokenizer(model)
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    except Exception as e:  # the regex engine's own message
        raise bad(f"not a valid pattern: {e}"[:300], "config.pattern") from None
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(n, special=True) for n in names])
    return tk
