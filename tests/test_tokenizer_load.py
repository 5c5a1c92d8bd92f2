"""`mlxlis.load_tokenizer`: a tokenizer alone, from a GGUF's metadata (vocabulary-only files
included), a folder's tokenizer files or a catalog name; and the Gemma 4 ("gemma4") GGUF
tokenizer model's rules on a tiny vocabulary written here with gguf-py.

The tiny Gemma 4 expectations are worked out by hand from llama.cpp's llama-vocab.cpp
(llm_tokenizer_bpe_session::tokenize with LLAMA_VOCAB_PRE_TYPE_GEMMA4, token_to_piece,
detokenize): they pin each rule on its own, where llama.cpp's own test file (see
test_vocab_llama_cpp.py) exercises them only together.
"""

from __future__ import annotations

from pathlib import Path

import mlxlis
from mlxlis.errors import (
    FileFormatError,
    MlxlisError,
    ModelNotFoundError,
    TokenizerError,
    UnsupportedFormatError,
)
from mlxlis.tokenizer import StreamDecoder
from mlxlis.tokenizer.vocab import BYTE, CONTROL, NORMAL, USER_DEFINED

import gguf
import pytest
from conftest import CORPUS, need_pulled
from test_conventions import write_llama_gguf

TEXTS = [CORPUS[:300], "", " ", "<|im_start|>user\nHi<|im_end|>\n", "a <|endoftext|> b", "日本 🙂"]

# A tiny Gemma 4 vocabulary: specials, user-defined tokens, the 256 byte tokens, a few pieces.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn|>"]
USER = ["<|tool_call>", "<|tool_response>"]
PIECES = ["\n", "\n\n", "\n\n\n", "▁", "a", "b", "ab", "▁a", "▁ab", ",", "▁,"]
TOKENS = SPECIALS + USER + [f"<0x{b:02X}>" for b in range(256)] + PIECES
TYPES = [CONTROL] * 5 + [USER_DEFINED] * 2 + [BYTE] * 256 + [NORMAL] * len(PIECES)
MERGES = ["a b", "▁ a", "▁a b", "▁ ,", "\n \n"]  # by rank; nothing merges into "\n\n\n"
ID = {t: i for i, t in enumerate(TOKENS)}


def write_vocab_gguf(path: Path, model: str | None = "gemma4", **keys) -> Path:
    """A vocabulary-only GGUF (metadata, no tensors), as llama.cpp's ggml-vocab-*.gguf files;
    `keys` override tokenizer.ggml.* entries (None drops one)."""
    w = gguf.GGUFWriter(str(path), "gemma4")
    values = {"tokens": TOKENS, "token_type": TYPES, "merges": MERGES, **keys}
    if model is not None:
        w.add_tokenizer_model(model)
    for key, add in (
        ("tokens", w.add_token_list),
        ("token_type", w.add_token_types),
        ("merges", w.add_token_merges),
    ):
        if values[key] is not None:
            add(values[key])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)  # llama.cpp adds BOS for Gemma 4 all the same
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same(ours, theirs) -> None:
    """Two tokenizers agree: specials, BOS/EOS/stop conventions, ids and decoded text."""
    for attr in (
        "vocab_size",
        "special_tokens",
        "bos_id",
        "eos_ids",
        "eot_ids",
        "pad_id",
        "add_bos",
        "add_eos",
        "bos_token",
        "eos_token",
    ):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, special=special)
            assert ids == theirs.encode(text, special=special), (text, special)
            assert ours.decode(ids) == theirs.decode(ids)


# -- the same tokenizer as mlxlis.load ----------------------------------------------------------


def test_load_tokenizer_on_a_folder_equals_load(tiny):
    """On a model folder (tokenizer.json + tokenizer_config.json + config.json, written by
    transformers), load_tokenizer gives the tokenizer mlxlis.load(folder).tokenizer has."""
    folder, _ = tiny("llama")
    assert_same(mlxlis.load_tokenizer(folder), mlxlis.load(folder, "float32").tokenizer)


def test_load_tokenizer_on_a_model_gguf_equals_load(tiny, tmp_path):
    """On a full GGUF model (a tiny Llama written with gguf-py as llama.cpp's converter does,
    tensors and all), load_tokenizer reads the metadata alone and gives the tokenizer
    mlxlis.load(path).tokenizer has."""
    folder, ref = tiny("llama")
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, ref, folder)
    assert_same(mlxlis.load_tokenizer(path), mlxlis.load(path, "float32").tokenizer)


@pytest.mark.real
def test_load_tokenizer_on_a_catalog_name_equals_load():
    """A catalog name resolves as mlxlis.load resolves it, to the same tokenizer."""
    need_pulled("smollm2-135m")
    ours = mlxlis.load_tokenizer("smollm2-135m")
    assert_same(ours, mlxlis.load("smollm2-135m", "float32").tokenizer)
    assert ours.source.endswith(".gguf")


def test_load_refuses_a_vocabulary_only_gguf_and_names_load_tokenizer(tmp_path):
    """mlxlis.load on a GGUF without tensors says what the file is and what opens it (naming
    file and field), instead of a missing-tensor error; load_tokenizer opens it."""
    path = write_vocab_gguf(tmp_path / "vocab.gguf")
    with pytest.raises(UnsupportedFormatError) as e:
        mlxlis.load(path)
    assert (e.value.path, e.value.field) == (str(path), "tensor_count")
    assert "mlxlis.load_tokenizer" in str(e.value) and str(path) in str(e.value)
    assert mlxlis.load_tokenizer(path).vocab_size == len(TOKENS)


# -- bad input -----------------------------------------------------------------------------


def _bad_gguf(tmp_path: Path, **kw) -> Path:
    return write_vocab_gguf(tmp_path / "bad.gguf", **kw)


@pytest.mark.parametrize(
    ("make", "error", "field", "word"),
    [
        (lambda p: p / "none.gguf", ModelNotFoundError, None, "no such file"),
        (lambda p: _write(p / "notes.txt", b"hi"), UnsupportedFormatError, None, ".gguf"),
        (lambda p: _write(p / "model.bin", b"x"), UnsupportedFormatError, None, "pickle"),
        (lambda p: _write(p / "x.gguf", b"NOPE" + bytes(40)), FileFormatError, "magic", "magic"),
        (lambda p: _bad_gguf(p, tokens=None), TokenizerError, "tokenizer.ggml.tokens", "missing"),
        (lambda p: _bad_gguf(p, merges=None), TokenizerError, "tokenizer.ggml.merges", "merges"),
        (lambda p: _bad_gguf(p, merges=["a z"]), TokenizerError, "tokenizer.ggml.merges", "bad"),
        (
            lambda p: _bad_gguf(p, token_type=[1]),
            TokenizerError,
            "tokenizer.ggml.token_type",
            "entries",
        ),
        (lambda p: _bad_gguf(p, model="rwkv"), TokenizerError, "tokenizer.ggml.model", "rwkv"),
        (lambda p: p, TokenizerError, "tokenizer.json", "missing"),
        (
            lambda p: _write(p / "config.json", b"[" * 80 + b"]" * 80),
            TokenizerError,
            None,
            "config.json",
        ),
    ],
)
def test_load_tokenizer_errors_name_file_and_field(tmp_path, make, error, field, word):
    """Bad input raises an MlxlisError subclass whose message names the file and, where there
    is one, the field: a missing path, a file that is no tokenizer, a pickle, a broken GGUF
    header, GGUF vocabularies without tokens or merges, with a merge outside the vocabulary or
    a short type array, an unknown tokenizer model, a folder with no tokenizer file, and a
    folder's config.json nested too deep (read with the same bounds as mlxlis.load)."""
    target = make(tmp_path)
    with pytest.raises(error) as e:
        mlxlis.load_tokenizer(target)
    assert isinstance(e.value, MlxlisError) and e.value.path and e.value.path in str(e.value)
    assert e.value.path.startswith(str(tmp_path))
    if field is not None:
        assert e.value.field == field and field in str(e.value)
    assert word in str(e.value)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path.parent if path.name == "config.json" else path


# -- the gemma4 tokenizer model's rules, one by one ----------------------------------------------


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return mlxlis.load_tokenizer(write_vocab_gguf(tmp_path_factory.mktemp("g4") / "v.gguf"))


def ids(*tokens: str) -> list[int]:
    return [ID[t] for t in tokens]


def test_gemma4_spaces_become_the_visible_space_and_merges_go_by_rank(gemma4):
    """Each space is "▁" before BPE; merges apply lowest rank first over the whole line (no
    split at spaces, nothing greedy): in "ab ab" the rank-0 "a b" makes both "ab" before
    "▁ a" (rank 1) could make "▁a", so the token "▁ab" is never reached ("▁ ab" is no merge)."""
    assert gemma4.encode(" a", add_bos=False) == ids("▁a")
    assert gemma4.encode("ab ab", add_bos=False) == ids("ab", "▁", "ab")
    assert gemma4.encode(" a, ab", add_bos=False) == ids("▁a", ",", "▁", "ab")


def test_gemma4_newline_runs_and_byte_fallback(gemma4):
    """A run of newlines that is a token is that token even where no merge builds it ("\\n\\n\\n";
    BPE would give "\\n\\n" + "\\n"); a run that is not a token is BPE-merged ("\\n\\n" twice);
    characters with no token become their UTF-8 bytes' <0xXX> tokens."""
    assert gemma4.encode("a\n\n\nb", add_bos=False) == ids("a", "\n\n\n", "b")
    assert gemma4.encode("\n\n\n\n", add_bos=False) == ids("\n\n", "\n\n")
    assert gemma4.encode("cé", add_bos=False) == ids("<0x63>", "<0xC3>", "<0xA9>")


def test_gemma4_special_tokens_bos_and_stops(gemma4):
    """BOS is added although add_bos_token is false (llama.cpp's Gemma 4 override); <eos>,
    <turn|> and <|tool_response> stop generation; the user-defined <|tool_call> is cut out of
    plain text, <|tool_response> (control for llama.cpp, being an end-of-generation text) and
    <turn|> only with special=True."""
    assert gemma4.add_bos and gemma4.encode("a") == ids("<bos>", "a")
    assert gemma4.stop_ids == set(ids("<eos>", "<turn|>", "<|tool_response>"))
    assert gemma4.encode("<|tool_call>a", add_bos=False) == ids("<|tool_call>", "a")
    for text in ("<|tool_response>", "<turn|>"):
        assert gemma4.encode(text, special=True, add_bos=False) == [ID[text]]
        plain = gemma4.encode(text, add_bos=False)
        assert plain == [ID[f"<0x{b:02X}>"] for b in text.encode()]


def test_gemma4_decode_clean_spaces_and_streaming(gemma4):
    """decode: "▁" -> " ", byte tokens -> their bytes, control and user-defined tokens as their
    text (control ones dropped with skip_special), then llama.cpp's clean_spaces (" ," -> ",");
    clean_spaces=False and the stream decoder give the pieces as they are, as llama.cpp
    streams token_to_piece."""
    tokens = ids("<bos>", "a", "▁,", "b", "<0xC3>", "<0xA9>", "<|tool_call>", "<turn|>")
    assert gemma4.decode(tokens) == "<bos>a,bé<|tool_call><turn|>"
    assert gemma4.decode(tokens, skip_special=True) == "a,bé<|tool_call>"
    assert gemma4.decode(tokens, clean_spaces=False) == "<bos>a ,bé<|tool_call><turn|>"
    dec = StreamDecoder(gemma4)
    assert "".join([*(dec.add(i) for i in tokens), dec.flush()]) == "<bos>a ,bé<|tool_call><turn|>"
