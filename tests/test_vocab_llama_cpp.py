"""llama.cpp's own tokenizer tests for Qwen3.5 (pre-tokenizer `qwen35`) and Gemma 4 (tokenizer
model `gemma4`), read through `mlxlis.load_tokenizer`.

Reference: llama.cpp's inputs and expected ids (tests/data/llama-cpp-vocab/, byte-exact copies
from the llama-cpp-python 0.3.36 source release; see the README there), run as its
tests/test-tokenizer-0.cpp runs them (no BOS/EOS, special-token text as plain text), on
llama.cpp's vocabulary-only GGUF files (`ggml-vocab-*.gguf`, extracted from the same archive
by scripts/fetch_references.py; the tests skip without them). The round trips are those of its
tests/test-tokenizer-1-bpe.cpp.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import mlxlis
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.tokenizer import Tokenizer
from mlxlis.tokenizer.vocab import BYTE, CONTROL, USER_DEFINED

import pytest
from conftest import llama_cpp_reference, memory_bound

DATA = Path(__file__).parent / "data" / "llama-cpp-vocab"
SEP = "\n__ggml_vocab_test__\n"
CASES = {"qwen35": 50, "gemma-4": 46}  # inputs in each .inp file
# The one clean-up llama.cpp's Gemma 4 detokenize makes on these inputs (clean_spaces: a space
# before ? ! . , goes), worked out by hand from llama_vocab::impl::detokenize.
GEMMA4_CLEANED = ("😁 ?", "😁?")


def read_tests(name: str) -> list[tuple[str, list[int]]]:
    """test-tokenizer-0.cpp's read_tests: the .inp bytes split on the separator (nothing after a
    final one), the .out read by getline (a final newline ends the last line), each line
    stripped and split on spaces into ids."""
    raw = (DATA / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    lines = (DATA / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("ascii").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines) == CASES[name], name
    return [(s, [int(t) for t in line.split()]) for s, line in zip(inputs, lines, strict=True)]


@functools.cache
def load(name: str) -> Tokenizer:
    """llama.cpp's vocabulary `name` through the public API, built once per session."""
    return mlxlis.load_tokenizer(llama_cpp_reference(f"ggml-vocab-{name}.gguf"))


@pytest.fixture(scope="module", params=list(CASES))
def vocab(request):
    name = request.param
    path = llama_cpp_reference(f"ggml-vocab-{name}.gguf")
    return SimpleNamespace(name=name, path=path, tok=load(name), cases=read_tests(name))


def test_committed_cases_are_llama_cpp_files(vocab):
    """Provenance: the .inp / .out committed here are byte for byte the files of the archive
    scripts/fetch_references.py verified by SHA-256."""
    for suffix in (".inp", ".out"):
        fetched = vocab.path.with_name(vocab.path.name + suffix).read_bytes()
        assert (DATA / (vocab.path.name + suffix)).read_bytes() == fetched, suffix


def test_encode_gives_llama_cpp_ids(vocab):
    """Reference parity: every input encodes to exactly llama.cpp's ids (add_special=false,
    parse_special=false, as test-tokenizer-0.cpp calls common_tokenize)."""
    bad = []
    for text, want in vocab.cases:
        got = vocab.tok.encode(text, special=False, add_bos=False, add_eos=False)
        if got != want:
            bad.append((text, got, want))
    assert not bad, f"{vocab.name}: {len(bad)} of {len(vocab.cases)} differ, first: {bad[0]}"


def test_decode_of_llama_cpp_ids_gives_the_input_back(vocab):
    """decode(llama.cpp's ids) is the input: exactly for qwen35 (clean_spaces=false there);
    for gemma-4 exactly with clean_spaces=False (the pieces: "▁" -> " ", <0xXX> -> the byte),
    and with llama.cpp's clean-up by default, which changes exactly the two inputs holding
    "😁 ?" (hand-derived; no other pattern it removes occurs in these inputs)."""
    cleaned = 0
    for text, ids in vocab.cases:
        assert vocab.tok.decode(ids, clean_spaces=False) == text
        want = text
        if vocab.name == "gemma-4" and GEMMA4_CLEANED[0] in text:
            want = text.replace(*GEMMA4_CLEANED)
            cleaned += 1
        assert vocab.tok.decode(ids) == want, text
    assert cleaned == (2 if vocab.name == "gemma-4" else 0)


def test_round_trips_as_llama_cpp_tokenizer_1(vocab):
    """test-tokenizer-1-bpe.cpp's self-consistency checks: a token's text (valid UTF-8 ones)
    encoded with special-token parsing decodes to that text again; a code point (no
    surrogates, not U+40000..U+E0000, not U+2581 "▁") encodes and decodes to itself. Strided:
    every 4th token and every 9th code point (the full sweep, 0.4 M tokens and 0.9 M code
    points for both vocabularies, passes too but takes ~11 s here)."""
    tok = vocab.tok
    bad = []
    for i in range(0, tok.vocab_size, 4):
        text = tok.decode([i])
        if "\ufffd" in text:  # not valid UTF-8 alone: the C++ test skips these too
            continue
        if tok.decode(tok.encode(text, special=True, add_bos=False)) != text:
            bad.append(i)
    for cp in range(0, 0x110000, 9):
        if 0xD800 <= cp <= 0xDFFF or 0x40000 <= cp <= 0xE0000 or cp == 0x2581:
            continue
        if tok.decode(tok.encode(chr(cp), add_bos=False)) != chr(cp):
            bad.append(f"U+{cp:04X}")
    assert not bad, f"{vocab.name}: {len(bad)} round trips fail, first: {bad[:5]}"


def test_qwen35_cases_need_the_qwen35_split():
    """The Qwen3.5 cases are not vacuous: the same vocabulary read with the qwen2 split (marks
    not absorbed into letters) fails the inputs with combining marks, and only those."""
    path = llama_cpp_reference("ggml-vocab-qwen35.gguf")
    with read_gguf(path) as g:
        md = dict(g.metadata)
    md["tokenizer.ggml.pre"] = "qwen2"
    md.pop("tokenizer.chat_template", None)
    qwen2 = Tokenizer.from_gguf(md, path)
    failing = [t for t, ids in read_tests("qwen35") if qwen2.encode(t, add_bos=False) != ids]
    assert failing and all(any(0x300 <= ord(c) < 0x370 for c in t) for t in failing), failing


def test_gemma4_vocabulary_conventions():
    """What llama.cpp reads from the gemma4 GGUF: 262144 tokens, BYTE tokens at 238..493 used
    for characters outside the vocabulary, BOS <bos> (2) added whatever add_bos_token says,
    EOS <eos> (1), and <turn|> and <|tool_response> as end-of-generation stops; the
    user-defined <|tool_call> is cut out of plain text, <|tool_response> (made a control token
    by llama.cpp as an EOG text) only with special=True."""
    tok = load("gemma-4")
    with read_gguf(llama_cpp_reference("ggml-vocab-gemma-4.gguf")) as g:
        types = g.metadata["tokenizer.ggml.token_type"]
    assert tok.vocab_size == 262144 and [i for i, t in enumerate(types) if t == BYTE] == list(
        range(238, 494)
    )
    assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.add_eos) == (2, (1,), True, False)
    stops = {tok.id_to_token(i) for i in tok.stop_ids}
    assert stops == {"<eos>", "<turn|>", "<|tool_response>"}
    assert types[tok.special_tokens["<turn|>"]] == CONTROL
    call, resp = (tok.encode(t, add_bos=False) for t in ("<|tool_call>", "<|tool_response>"))
    assert len(call) == 1 and types[call[0]] == USER_DEFINED
    assert len(resp) > 1 and tok.encode("<|tool_response>", special=True, add_bos=False) == [50]
    rare = tok.encode("\U0001d54f", add_bos=False)  # 𝕏: no token, four UTF-8 bytes
    assert [tok.id_to_token(i) for i in rare] == ["<0xF0>", "<0x9D>", "<0x95>", "<0x8F>"]
    assert tok.encode("Hello") == [2, *tok.encode("Hello", add_bos=False)]


@pytest.mark.extended  # `make test-all` (7 s)
def test_gemma4_build_is_lean():
    """A work bound on building the Gemma 4 tokenizer (262144 tokens, 514906 merges) from its
    metadata: the Python memory it allocates peaks at 34 MiB here (the BPE goes to
    `tokenizers` as JSON written a chunk at a time); one json.dumps of the whole model peaked
    at 95 MiB, a Python dict and a tuple per merge for the BPE constructor at 111."""
    path = llama_cpp_reference("ggml-vocab-gemma-4.gguf")
    with read_gguf(path) as g:
        md = dict(g.metadata)
    with memory_bound(56 << 20, "gemma-4"):
        Tokenizer.from_gguf(md, path)
