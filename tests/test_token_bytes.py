"""Each token's own bytes (the `bytes` of the server's logprobs): joined over the tokens of a
text they give back that text's UTF-8 exactly — with the one space a SentencePiece
vocabulary puts before the first word — even where a token holds part of a character (byte
fallback, byte-level pieces), which decoding the token alone cannot show (it gives U+FFFD).
The reference is the text itself; the tokenizers are GGUF vocabularies (catalog models,
llama.cpp's test vocabularies) and tokenizer.json files (transformers' own conversion)."""

from __future__ import annotations

import mlxlis

import pytest
from conftest import hf_gguf_tokenizer_dir, llama_cpp_reference, need_pulled

TEXT = "Grüße aus 東京 🙂 — naïve ⟨x⟩ \t ok\n𝔘 ǅ"


def sources():
    yield "smollm2 gguf", lambda: mlxlis.load_tokenizer(need_pulled("smollm2-135m"))
    yield "gemma3 gguf", lambda: mlxlis.load_tokenizer(need_pulled("gemma3-270m"))
    yield (
        "gemma4 gguf",
        lambda: mlxlis.load_tokenizer(llama_cpp_reference("ggml-vocab-gemma-4.gguf")),
    )
    yield (
        "llama-spm gguf",
        lambda: mlxlis.load_tokenizer(llama_cpp_reference("ggml-vocab-llama-spm.gguf")),
    )
    yield (
        "smollm2 tokenizer.json",
        lambda: mlxlis.load_tokenizer(hf_gguf_tokenizer_dir("smollm2-135m")),
    )
    yield (
        "gemma3 tokenizer.json",
        lambda: mlxlis.load_tokenizer(hf_gguf_tokenizer_dir("gemma3-270m")),
    )


@pytest.mark.real
@pytest.mark.parametrize("name", [n for n, _ in sources()])
def test_token_bytes_join_to_the_text(name):
    tok = dict(sources())[name]()
    ids = tok.encode(TEXT, add_bos=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) in (TEXT.encode(), b" " + TEXT.encode()), (name, pieces)
    partial = [p for p in pieces if not _utf8(p)]
    assert partial, f"{name}: no token holds part of a character; the test proves nothing"
    assert all(
        "\ufffd" in tok.decode([i]) for i, p in zip(ids, pieces, strict=True) if not _utf8(p)
    )


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
