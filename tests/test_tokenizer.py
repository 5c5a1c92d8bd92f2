"""Tokenizer tests: GGUF vocabularies, folders (tokenizer.json / .model), streaming, errors.

Reference: transformers' own GGUF-built tokenizers (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), which matched llama.cpp's ids on every string tried. Building them
takes ~30 s for the three models, so each is built once, saved with `save_pretrained` into the
pytest cache (keyed by model file size / mtime and the transformers version), and reloaded from
there (~5 s for all three). The saved folder is also the input of the from_folder tests.
"""

from __future__ import annotations

import io
import json
import unicodedata
from pathlib import Path
from types import SimpleNamespace

from mlxlis.errors import TokenizerError
from mlxlis.loading import catalog
from mlxlis.tokenizer import StreamDecoder, Tokenizer
from mlxlis.tokenizer.vocab import BYTE, CONTROL, NORMAL, bytes_to_unicode, spm_proto

import numpy as np
import pytest
from conftest import hf_gguf_tokenizer_dir, memory_bound

REAL = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\tpass  # tabs\n\n\n    x = {'a': [1, 2]}\n",
    "multiple     spaces   here,\ttabs\t\tand  double  spaces",
    "   leading spaces",
    "trailing spaces   ",
    " one leading space",
    "\n\nnewlines first\n\n\n\nand\r\nCRLF\rCR\n",
    "digits 1234567890 0007 3.14159 1,000,000 2024-06-01 12:30",
    "emoji 🤗👍🏽🇫🇷🧑‍🚀 and CJK 日本語のテキスト 中文 한국어",
    "accents café naïve Ωmega Straße ñ — e\u0301 a\u0308 (combining)",
    "Arabic مرحبا بالعالم, Hebrew שלום, Hindi नमस्ते, Thai สวัสดี",
    "I'm sure they've done it; we'll see. DON'T SHOUT, it's 'quoted'",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "text with <|endoftext|> and <eos> <pad> <unk> <mask> inside",
    "<bos>a text that starts with the bos text",
    '<tool_call>{"name": "f"}</tool_call> [multimodal] <unused5> <|fim_prefix|>',
    "",
    " ",
    "\t",
    "x",
    "z" * 200 + " " * 40 + "\n" * 35,
    "mixed 😀 bytes \x00\x07 control\x1b[0m chars",
]
STREAM_TEXTS = [
    "Emoji 🤗👍🏽🇫🇷🧑‍🚀 in a row, then 日本語のテキスト and 한국어.",
    "Combining: e\u0301 a\u0308 o\u0302\u0323, rare CJK 𠀋𡈽𡌛 and 𝔹𝕆𝕃𝔻.",
    "  leading spaces, words after spaces: one two  three   four\n\tfive",
]


# -- helpers ---------------------------------------------------------------------------------


def gguf_metadata(path: Path) -> dict:
    """The `read_gguf(path).metadata` dict (mlxlis' reader; gguf-py's GGUFReader without it)."""
    try:
        from mlxlis.loading.gguf_split import read_gguf
    except ImportError:
        read_gguf = None
    if read_gguf is not None:
        with read_gguf(path) as g:
            return dict(g.metadata)
    from gguf import GGUFReader, GGUFValueType

    md: dict = {}
    for key, f in GGUFReader(path).fields.items():
        if f.types[0] != GGUFValueType.ARRAY:
            md[key] = f.contents()
        elif f.types[-1] == GGUFValueType.STRING:
            md[key] = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        else:
            md[key] = np.concatenate([f.parts[i] for i in f.data]) if f.data else np.array([])
    return md


def ref_ids(ref, text: str, special: bool, add_special: bool = False) -> list[int]:
    return ref(text, add_special_tokens=add_special, split_special_tokens=not special)["input_ids"]


def known_deviation(name: str, text: str) -> str | None:
    """Where transformers' GGUF-built tokenizer is not the reference, and why."""
    if name == "gemma3-270m" and " " * 32 in text:
        # Gemma marks space runs of 2..31 as user-defined tokens. llama.cpp (and SentencePiece's
        # user-defined matching) cut them out of the text longest first; transformers' GGUF
        # path re-merges them by BPE instead: 40 spaces -> 31 + 9 there, 16 + 24 here.
        return "long space run"
    return None


def nfc_if_qwen(name: str, text: str) -> str:
    """Qwen's tokenizer NFC-normalises its input, so a round trip gives the NFC form."""
    return unicodedata.normalize("NFC", text) if name.startswith("qwen") else text


def stream(tok: Tokenizer, ids: list[int], **kw) -> list[str]:
    dec = StreamDecoder(tok, **kw)
    chunks = [dec.add(i) for i in ids]
    return [*chunks, dec.flush()]


@pytest.fixture(scope="module", params=REAL)
def real(request):
    name = request.param
    if not catalog.is_pulled(name):
        pytest.skip(f"{name} is not pulled (make models)")
    from transformers import AutoTokenizer

    path = catalog.model_path(name)
    md = gguf_metadata(path)
    ours = Tokenizer.from_gguf(md, path)
    ref_folder = hf_gguf_tokenizer_dir(name)  # transformers' GGUF-built tokenizer, saved
    ref = AutoTokenizer.from_pretrained(ref_folder)
    return SimpleNamespace(name=name, md=md, ours=ours, ref=ref, folder=ref_folder)


# -- GGUF vocabularies vs transformers -----------------------------------------------------


@pytest.mark.real
def test_gguf_ids_match_transformers(real):
    """Reference parity: our GGUF tokenizer gives transformers' ids on the whole corpus, with
    special-token text parsed (special=True) and as plain text (special=False)."""
    bad = []
    for text in CORPUS:
        if known_deviation(real.name, text):
            continue
        for special in (False, True):
            ours = real.ours.encode(text, special=special, add_bos=False)
            want = ref_ids(real.ref, text, special)
            if ours != want:
                bad.append((text, special, ours, want))
    assert not bad, f"{real.name}: {len(bad)} mismatches, first: {bad[0]}"


@pytest.mark.real
def test_gguf_bos_like_transformers_without_double_bos(real):
    """BOS per tokenizer.ggml.add_bos_token gives transformers' ids; only where the text itself
    starts with the BOS token (special=True) do we not add a second one as transformers does."""
    ours, ref = real.ours, real.ref
    assert ours.add_bos == (real.name == "gemma3-270m")
    for text in (t for t in CORPUS if not known_deviation(real.name, t)):
        assert ours.encode(text) == ref_ids(ref, text, False, add_special=True), text
        want = ref_ids(ref, text, True, add_special=True)
        if ours.bos_token and text.startswith(ours.bos_token) and ours.add_bos:
            assert want[:2] == [ours.bos_id] * 2  # transformers doubles it
            want = want[1:]
        assert ours.encode(text, special=True) == want, text


@pytest.mark.real
def test_gguf_decode_round_trips_and_matches_transformers(real):
    """decode(encode(x)) == x (self-consistency), and decode of the special-parsed ids equals
    transformers' decode, with and without skipping special tokens (reference parity)."""
    for text in CORPUS:
        assert real.ours.decode(real.ours.encode(text, add_bos=False)) == nfc_if_qwen(
            real.name, text
        )
        ids = real.ours.encode(text, special=True)
        for skip in (False, True):
            got = real.ours.decode(ids, skip_special=skip)
            assert got == real.ref.decode(ids, skip_special_tokens=skip), (text, skip)


@pytest.mark.real
def test_gguf_user_defined_tokens_split_longest_first(real):
    """Gemma's space / newline runs are user-defined tokens, cut out longest first as llama.cpp's
    tokenizer_st_partition does (the one place transformers' GGUF tokenizer differs)."""
    if real.name != "gemma3-270m":
        pytest.skip("Gemma's vocabulary has the user-defined whitespace tokens")
    tokens = real.md["tokenizer.ggml.tokens"]
    ids = real.ours.encode("a" + " " * 40 + "b" + "\n" * 35, add_bos=False)
    assert [tokens[i] for i in ids] == ["a", " " * 31, " " * 9, "b", "\n" * 31, "\n" * 4]


@pytest.mark.real
def test_gguf_special_tokens_and_stop_ids(real):
    """BOS / EOS / end-of-turn ids and texts come from the metadata; the chat end-of-turn
    token is a stop id (Gemma's <end_of_turn> via llama.cpp's end-of-generation texts)."""
    tok = real.ours
    assert tok.bos_id == real.md["tokenizer.ggml.bos_token_id"]
    assert tok.eos_ids[0] == real.md["tokenizer.ggml.eos_token_id"]
    end = "<end_of_turn>" if real.name == "gemma3-270m" else "<|im_end|>"
    assert tok.special_tokens[end] in tok.stop_ids
    assert tok.bos_token == real.ref.convert_ids_to_tokens(tok.bos_id)
    assert tok.id_to_token(tok.eos_ids[0]) == tok.eos_token
    assert tok.vocab_size == len(real.md["tokenizer.ggml.tokens"])


@pytest.mark.real
def test_gguf_build_is_lean(real):
    """A work bound on building the tokenizer from metadata (its time is part of the load time
    `make bench` measures): the Python memory it allocates peaks at 12 / 26 / 38 MiB for
    SmolLM2 / Gemma 3 / Qwen2.5 here; a dense merge table or a per-token copy of the
    vocabulary would cross 160 MiB."""
    with memory_bound(160 << 20, real.name):
        Tokenizer.from_gguf(real.md, catalog.model_path(real.name))


# -- folders -------------------------------------------------------------------------------


@pytest.mark.real
def test_folder_tokenizer_json_matches_transformers(real):
    """from_folder on transformers' saved tokenizer.json + tokenizer_config.json gives
    transformers' ids, BOS included where its post-processor adds one (Gemma)."""
    tok = Tokenizer.from_folder(real.folder)
    assert tok.add_bos == (real.name == "gemma3-270m")
    for text in CORPUS:
        if nfc_if_qwen(real.name, text) != text:
            continue  # transformers' Qwen2Tokenizer adds NFC; the tokenizer.json it saved has none
        for special in (False, True):
            assert tok.encode(text, special=special, add_bos=False) == ref_ids(
                real.ref, text, special
            ), (text, special)
        assert tok.encode(text) == ref_ids(real.ref, text, False, add_special=True)
        ids = tok.encode(text, special=True)
        assert tok.decode(ids, skip_special=True) == real.ref.decode(ids, skip_special_tokens=True)


@pytest.mark.extended  # `make test-all` (8 s): the GGUF vocabularies match transformers here
@pytest.mark.real
def test_folder_sentencepiece_model_from_gemma_gguf(real, tmp_path):
    """The SentencePiece proto built from Gemma's GGUF, written as tokenizer.model, loads with
    from_folder and with transformers' GemmaTokenizer, and both give the same ids."""
    if real.name != "gemma3-270m":
        pytest.skip("Gemma's is the SentencePiece vocabulary")
    from transformers import GemmaTokenizer

    md = real.md
    proto = spm_proto(
        md["tokenizer.ggml.tokens"],
        md["tokenizer.ggml.scores"].tolist(),
        md["tokenizer.ggml.token_type"].tolist(),
        unk_id=3,
        bos_id=2,
        eos_id=1,
        add_dummy_prefix=False,
    )
    (tmp_path / "tokenizer.model").write_bytes(proto.SerializeToString())
    cfg = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer.from_folder(tmp_path)
    assert (ours.bos_id, ours.eos_ids, ours.add_bos) == (2, (1,), True)
    ref = GemmaTokenizer.from_pretrained(tmp_path)
    for text in CORPUS:
        assert ours.encode(text, add_bos=False) == real.ours.encode(text, add_bos=False)
        if known_deviation(real.name, text):
            continue
        assert ours.encode(text, add_bos=False) == ref_ids(ref, text, False), text
        assert ours.encode(text, special=True, add_bos=False) == ref_ids(ref, text, True), text


def test_folder_tokenizer_config_flags(tmp_path):
    """add_bos_token / add_eos_token and bos/eos given as a string or {"content": ...} in
    tokenizer_config.json decide BOS / EOS, whatever tokenizer.json's post-processor does."""
    from conftest import train_tokenizer

    train_tokenizer(tmp_path)
    base = Tokenizer.from_folder(tmp_path)
    assert (base.bos_token, base.eos_token, base.add_bos) == ("<|endoftext|>", "<|im_end|>", False)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=True, add_eos_token=True, bos_token={"content": "<|im_start|>"})
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(tmp_path)
    ids = tok.encode("hello world")
    assert ids[0] == tok.special_tokens["<|im_start|>"] == tok.bos_id
    assert ids[-1] == tok.special_tokens["<|im_end|>"] and ids[1:-1] == base.encode("hello world")
    assert tok.encode("<|im_start|>hi<|im_end|>", special=True).count(tok.bos_id) == 1
    assert tok.encode("hi", add_bos=False, add_eos=False) == base.encode("hi")


def test_folder_trained_sentencepiece_model(tmp_path):
    """A tiny SentencePiece BPE model trained here (identity normaliser and dummy prefix as
    Llama's, byte fallback, a user-defined and a control symbol): from_folder ids equal
    sentencepiece's own, decode round-trips every space, control text splits only with
    special=True, each text fragment then getting its dummy prefix as in llama.cpp."""
    import sentencepiece as spm

    text = "the quick brown fox jumps over the lazy dog. " * 20 + "hello world, hello there. "
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.split(". ")),
        model_writer=model,
        vocab_size=400,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<tool>"],
        control_symbols=["<ctl>"],
        minloglevel=2,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (sp.bos_id(), (sp.eos_id(),), True)
    for t in ("hello world", "  the  fox ", "jump 🤗 über", "a <tool> b", "quick\tbrown\n"):
        ids = tok.encode(t)
        assert ids == [sp.bos_id(), *sp.encode(t)], t
        assert tok.decode(ids, skip_special=True) == sp.decode(ids[1:]) == t
        assert "".join(stream(tok, ids, skip_special=True)) == t
    ctl = sp.piece_to_id("<ctl>")
    assert ctl not in tok.encode("x<ctl>y")
    assert tok.encode("x<ctl>y", special=True, add_bos=False) == [
        *sp.encode("x"),
        ctl,
        *sp.encode("y"),
    ]


# -- streaming -----------------------------------------------------------------------------


@pytest.mark.real
def test_stream_decoder_reproduces_decode(real):
    """Feeding ids one at a time reproduces decode(all) exactly (multi-byte characters split
    over several tokens: emoji, rare CJK, combining accents), and no chunk holds U+FFFD."""
    tok = real.ours
    split_chars = 0
    for text in STREAM_TEXTS + CORPUS:
        ids = tok.encode(text, special=True)
        for skip in (False, True):
            chunks = stream(tok, ids, skip_special=skip)
            assert "".join(chunks) == tok.decode(ids, skip_special=skip), text
            assert not any("\ufffd" in c for c in chunks), (text, chunks)
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
    assert split_chars > 10  # the corpus really splits characters over tokens
    if real.name == "gemma3-270m":  # byte-fallback tokens, not only byte-level BPE pieces
        types = real.md["tokenizer.ggml.token_type"]
        assert any(types[i] == BYTE for t in STREAM_TEXTS for i in tok.encode(t))


@pytest.mark.real
def test_stream_decoder_keeps_broken_bytes_for_flush(real):
    """A byte sequence that never completes a character is held, then given by flush() as the
    U+FFFD decode(all) has; nothing is lost or duplicated."""
    tok = real.ours
    ids = tok.encode("ok 𠀋", add_bos=False)  # a rare CJK character: several tokens
    broken = next(ids[:k] for k in range(len(ids) - 1, 0, -1) if "\ufffd" in tok.decode(ids[:k]))
    chunks = stream(tok, broken)
    assert "".join(chunks) == tok.decode(broken) and chunks[-1].endswith("\ufffd")
    assert not any("\ufffd" in c for c in chunks[:-1])


# -- errors --------------------------------------------------------------------------------


def tiny_gpt2_metadata(**extra) -> dict:
    """A byte-level BPE vocabulary: 256 byte tokens, a few merges, two control tokens."""
    alphabet = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    words = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    tokens = alphabet + words + ["<|endoftext|>", "<|im_end|>"]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([NORMAL] * (len(tokens) - 2) + [CONTROL] * 2),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    md.update(extra)
    return {k: v for k, v in md.items() if v is not None}


def test_tiny_gpt2_vocabulary_and_missing_model_key():
    """Without tokenizer.ggml.model the vocabulary is read as GPT-2 BPE (documented
    default); merges apply, control text splits only with special=True, decode round-trips."""
    tok = Tokenizer.from_gguf(tiny_gpt2_metadata(**{"tokenizer.ggml.model": None}), "tiny.gguf")
    n = len(bytes_to_unicode())
    assert tok.encode("hello world") == [n + 3, n + 8]
    assert tok.encode("hello<|im_end|>", special=True) == [n + 3, tok.eos_ids[0]]
    assert tok.eos_ids[0] not in tok.encode("hello<|im_end|>")
    for text in ("hello world", "ünïcödé 🤗\n\t x", "<|im_end|>"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("hi<|im_end|>", special=True), skip_special=True) == "hi"


@pytest.mark.parametrize(
    ("extra", "field", "word"),
    [
        ({"tokenizer.ggml.model": "rwkv"}, "tokenizer.ggml.model", "rwkv"),
        ({"tokenizer.ggml.model": "plamo2"}, "tokenizer.ggml.model", "plamo2"),
        ({"tokenizer.ggml.pre": "nonesuch"}, "tokenizer.ggml.pre", "nonesuch"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens", "missing"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges", "merges"),
        ({"tokenizer.ggml.merges": ["h e", "q x"]}, "tokenizer.ggml.merges", "merges"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id", "token id"),
        ({"tokenizer.ggml.token_type": np.ones(3)}, "tokenizer.ggml.token_type", "entries"),
    ],
)
def test_gguf_errors_name_file_and_field(extra, field, word):
    """Unsupported or broken GGUF vocabularies raise TokenizerError naming file and field."""
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf(tiny_gpt2_metadata(**extra), "/models/x.gguf")
    assert e.value.field == field and e.value.path == "/models/x.gguf"
    assert field in str(e.value) and word in str(e.value) and "/models/x.gguf" in str(e.value)


@pytest.mark.parametrize(
    ("files", "bad", "field"),
    [
        ({}, "", "tokenizer.json"),
        ({"tokenizer.json": '{"model": {"type": "BPE"'}, "tokenizer.json", "line 1 column 25"),
        ({"tokenizer.json": '{"version": "1.0"}'}, "tokenizer.json", "model"),
        ({"tokenizer.json": '{"model": {"type": "BPE", "vocab": 3}}'}, "tokenizer.json", None),
        ({"tokenizer.model": "not a protobuf"}, "tokenizer.model", "pieces"),
    ],
)
def test_folder_errors_name_file_and_field(tmp_path, files, bad, field):
    """Missing or corrupt tokenizer files raise TokenizerError naming the file and the field."""
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_folder(tmp_path)
    # the file at fault, or the folder itself when no tokenizer file exists at all
    expected_path = str(tmp_path / bad) if bad else str(tmp_path)
    assert e.value.path == expected_path
    assert e.value.field and (field is None or e.value.field == field)
    assert str(tmp_path) in str(e.value)


def test_folder_bad_config_field(tmp_path):
    """A wrongly typed tokenizer_config.json field is named, not ignored."""
    from conftest import train_tokenizer

    train_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": "yes"}))
    with pytest.raises(TokenizerError, match="tokenizer_config.json: add_bos_token"):
        Tokenizer.from_folder(tmp_path)
