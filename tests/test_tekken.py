"""Mistral's tekken.json vocabularies against tiktoken, the BPE engine Mistral's own tokenizer
(mistral_common's Tekkenizer) runs on the same ranks and pattern.

The vocabulary: a tiny byte-level BPE's tokens, ranked as tiktoken ranks them (the 256 bytes,
then each merge's result in merge order), written as tekken.json with Tekken's split pattern
and Mistral's special tokens (a few named, the rest fillers). Reference parity: every text's
ids equal tiktoken's ids shifted past the specials; text decodes back; a folder with only a
tekken.json opens; a folder with no vocabulary at all names what is missing. And Ministral 3
Reasoning's official template (llama.cpp's copy): the [THINK]…[/THINK] block it renders for a
thinking chunk comes back as the reasoning, by the tags' token ids.
"""

from __future__ import annotations

import base64
import json
import shutil

import mlxlis
from mlxlis.errors import TokenizerError
from mlxlis.tokenizer import Tokenizer

import pytest
from conftest import train_tokenizer

PATTERN = (  # Tekken's split pattern (tekken.json config.pattern of Mistral's models)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[THINK]", "[/THINK]"]
N_SPECIAL = 10  # the rest are <SPECIAL_i> fillers, as in Mistral's files
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\r\nnewlines\n\n\nend  ",
    "numbers 1234567 and 3.14159, CamelCaseWords and ALLCAPS",
    "unicode: café, naïve, 日本語, emoji 🙂👍, Ωμέγα",
    "code: def f(x):\n    return x**2  # square",
]
UNSEEN = [  # words the vocabulary was not trained on: BPE merges them by rank, piece by piece
    "photosynthesis, bureaucracy and a quixotic zephyr",
    "Überraschung: naïveté 42nd codewords returned squarely",
]


def gpt2_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes (the inverse of GPT-2's byte -> character table)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        table[chr(b) if b in keep else chr(256 + extra)] = b
        extra += b not in keep
    return bytes(table[c] for c in token)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[bytes, int]:
    """tiktoken-style ranks: the 256 bytes, then the tiny BPE's merges in order."""
    folder = tmp_path_factory.mktemp("bpe")
    train_tokenizer(folder, 600, corpus=tuple(TEXTS) * 3)
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    out = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        out.setdefault(gpt2_bytes(a) + gpt2_bytes(b), len(out))
    return out


@pytest.fixture(scope="module")
def tekken_file(ranks, tmp_path_factory):
    path = tmp_path_factory.mktemp("tekken") / "tekken.json"
    vocab = sorted(ranks.items(), key=lambda kv: kv[1])
    path.write_text(
        json.dumps(
            {
                "config": {
                    "pattern": PATTERN,
                    "default_vocab_size": N_SPECIAL + len(vocab),
                    "default_num_special_tokens": N_SPECIAL,
                    "version": "v7",
                },
                "vocab": [
                    {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
                    for t, r in vocab
                ],
                "special_tokens": [
                    {"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIALS)
                ],
            }
        )
    )
    return path


def test_ids_match_tiktoken_on_the_same_ranks(ranks, tekken_file, tmp_path):
    """Reference parity: ids == tiktoken's + the special count, text decodes back, the
    special tokens sit at their ranks and fillers after them."""
    import tiktoken

    ref = tiktoken.Encoding("tekken", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tekken_file, folder / "tekken.json")
    tok = Tokenizer.from_folder(folder)
    assert tok.vocab_size == N_SPECIAL + len(ranks)
    for text in TEXTS + UNSEEN:
        ids = tok.encode(text, add_bos=False, add_eos=False)
        assert ids == [i + N_SPECIAL for i in ref.encode_ordinary(text)], text
        assert tok.decode(ids) == text
    assert tok.encode("[INST]hi", special=True, add_bos=False, add_eos=False)[0] == 3
    assert tok.id_to_token(N_SPECIAL - 1) == f"<SPECIAL_{N_SPECIAL - 1}>"


def test_a_folder_with_tekken_only_opens_and_none_is_named(tiny, tekken_file, tmp_path):
    """A model folder whose vocabulary is tekken.json alone loads; one with no vocabulary
    file names tokenizer.json and the two others it looked for."""
    folder, _ = tiny("llama")
    out = tmp_path / "m"
    shutil.copytree(folder, out)
    (out / "tokenizer.json").unlink()
    (out / "tokenizer_config.json").unlink()
    shutil.copy(tekken_file, out / "tekken.json")
    model = mlxlis.load(out, "float32")
    text = TEXTS[0]
    alone = Tokenizer.from_folder(tekken_file.parent)
    want = alone.encode(text, add_bos=False, add_eos=False)
    assert model.tokenizer.encode(text, add_bos=False, add_eos=False) == want
    assert model.tokenizer.decode(want) == text
    (out / "tekken.json").unlink()
    with pytest.raises(TokenizerError) as e:
        mlxlis.load(out, "float32")
    assert e.value.field == "tokenizer.json" and "tekken.json" in str(e.value)


def test_think_blocks_of_the_official_template_split_back(tekken_file):
    """A reply as Ministral 3 Reasoning's template renders an assistant turn with a thinking
    chunk, streamed token by token: its thinking is the reasoning, its text the answer."""
    from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter
    from mlxlis.prompt.template import ChatTemplate

    from conftest import llama_cpp_reference

    path = llama_cpp_reference("templates/mistralai-Ministral-3-14B-Reasoning-2512.jinja")
    template = ChatTemplate("ministral3", path.read_text())
    tok = Tokenizer.from_folder(tekken_file.parent)
    user = [{"role": "user", "content": "2 + 2?"}]
    thinking, answer = "Two and two make four.", "It is 4."
    turn = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": thinking}, {"type": "text", "text": answer}],
    }
    kw = {"bos_token": "<s>", "eos_token": "</s>"}
    head = template.render(user, add_generation_prompt=True, **kw)
    whole = template.render([*user, turn], add_generation_prompt=False, **kw)
    assert whole.startswith(head)
    reply = whole[len(head) :].removesuffix("</s>")
    splitter = ReasoningSplitter.for_prompt(tok, head)
    parts = []
    for i in tok.encode(reply, special=True, add_bos=False, add_eos=False):
        parts += splitter.feed(tok.decode([i]), i)
    parts += splitter.flush()
    got = {k: "".join(t for kk, t in parts if kk == k) for k in (REASONING, ANSWER)}
    assert got == {REASONING: thinking, ANSWER: answer}


def test_bad_tekken_files_are_named(tekken_file, tmp_path):
    raw = json.loads(tekken_file.read_text())
    for fld, change in (
        ("config.pattern", {"config": {**raw["config"], "pattern": 3}}),
        ("special_tokens", {"special_tokens": [{"rank": 1, "token_str": "<s>"}]}),
        ("vocab", {"vocab": [{"rank": 0, "token_bytes": "not base64!"}]}),
    ):
        path = tmp_path / fld / "tekken.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**raw, **change}))
        with pytest.raises(TokenizerError) as e:
            Tokenizer.from_folder(path.parent)
        assert e.value.field == fld, (fld, e.value)
