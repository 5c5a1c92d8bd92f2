"""An encoder's tokenizer: tokenizer.json through `tokenizers` with its post-processor, so a
text gets its [CLS] ... [SEP] (or <s> ... </s>) and a pair its separators and token types, and
truncation is the library's own "longest_first" — what transformers' fast tokenizers run for
sentence-transformers' `encode` and `CrossEncoder.predict`, hence the same ids.
"""

from __future__ import annotations

from pathlib import Path

from mlxlis.errors import TokenizerError

import tokenizers


class EncoderTokenizer:
    """Texts and pairs -> (ids, token types), cut to `max_length` tokens where asked."""

    def __init__(self, path: Path, max_length: int, built: tokenizers.Tokenizer | None = None):
        """tokenizer.json at `path`, or `built` (a GGUF vocabulary's; `path` names its file)."""
        try:
            if built is not None:
                full, cut = (tokenizers.Tokenizer.from_str(built.to_str()) for _ in range(2))
            else:
                full = tokenizers.Tokenizer.from_file(str(path))
                cut = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises bare Exceptions on a bad file
            raise TokenizerError(f"cannot read: {e}"[:300], path=path) from None
        full.no_truncation()
        full.no_padding()
        cut.no_padding()
        cut.enable_truncation(max_length, strategy="longest_first")
        self._full, self._cut = full, cut
        self.max_length = max_length
        self.path = path

    def encode(
        self, text: str, pair: str | None = None, truncate: bool = True
    ) -> tuple[list[int], list[int]]:
        """The ids and token types of `text` (and `pair`), special tokens added; longer than
        max_length: cut when `truncate`, else returned whole (the caller refuses it)."""
        enc = self._full.encode(text, pair)
        if truncate and len(enc.ids) > self.max_length:
            enc = self._cut.encode(text, pair)
        return list(enc.ids), list(enc.type_ids)
