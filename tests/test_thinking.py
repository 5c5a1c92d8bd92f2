"""Reasoning models (Qwen3-style `<think>…</think>`): the splitter, ChatSession, the CLI.

The model is real and tiny, and scripted: a 3-layer Llama checkpoint written by transformers
whose tokenizer has `<think>` / `</think>` as added special tokens and whose chat template is
the official Qwen3 text (llama.cpp's copy, fetched at test time). Its weights make the greedy
next token a fixed function of the current one — one-hot embeddings for the tokens of a chain,
attention and MLP output projections zero (the residual carries the embedding through), lm_head
rows pointing each chain token at its successor:

    "\\n" (the generation prompt's last token) -> <think> -> The quick brown fox -> </think>
    -> "\\n\\n" -> Hello, world! -> <|im_end|>

So every reply is exactly "<think>The quick brown fox</think>\\n\\nHello, world!", made by
mlxlis' own loader, network, sampler and detokenizer; and after a prompt that ends in
"</think>\\n\\n" (enable_thinking=false) the reply is the answer alone. References are the
official template rendered with jinja2 directly, never mlxlis' renderer.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import mlxlis
from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter, join, tag_ids
from mlxlis.prompt.template import ChatTemplate, builtin_template

import pytest
from conftest import CORPUS, TINY, build_tiny, llama_cpp_reference
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_TEXT, ANSWER_TEXT = "The quick brown fox", "Hello, world!"
RAW_REPLY = f"<think>{REASONING_TEXT}</think>\n\n{ANSWER_TEXT}"
QWEN3 = "templates/Qwen-Qwen3-0.6B.jinja"
QWEN35 = "templates/Qwen3.5-4B.jinja"


@dataclass
class Thinker:
    folder: Path
    template: str  # the official Qwen3 template text


def build_thinker(folder: Path) -> Thinker:
    """The scripted reasoning model described in the module docstring."""
    import torch
    from tokenizers import Tokenizer

    template = llama_cpp_reference(QWEN3).read_text()
    # "\n\n" after "</think>" must be one token (as in Qwen's vocabulary): a corpus that has it
    tokenizer_kw = dict(
        extra_special=("<think>", "</think>"), corpus=(CORPUS,) + ("Hello, world!\n\n",) * 40
    )
    net = build_tiny(folder, TINY["llama"], tokenizer_kw=tokenizer_kw)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def ids(text: str) -> list[int]:
        return tok.encode(text).ids

    chain = [
        *ids("\n"),
        *ids("<think>"),
        *ids(REASONING_TEXT),
        *ids("</think>"),
        *ids("\n\n"),
        *ids(ANSWER_TEXT),
        *ids("<|im_end|>"),
    ]
    assert len(chain) == 13 and len(set(chain)) == len(chain), chain  # one successor each
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # attention and MLP add nothing: the residual is the embedding
            elif name == "model.norm.weight":
                p.fill_(1.0)
        emb, head = net.model.embed_tokens.weight, net.lm_head.weight
        emb.zero_()
        head.zero_()
        for i, (a, b) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
            emb[a, i] = 1.0  # token a -> unit vector i
            head[b, i] = 10.0  # unit vector i -> logit 80 (after the norm) for b, 0 elsewhere
    net.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(template)
    return Thinker(folder, template)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Thinker:
    return build_thinker(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="module")
def model(thinker):
    return mlxlis.load(thinker.folder, "float32")


def official(
    template: str, messages: list[dict], add_generation_prompt: bool = True, **variables
) -> str:
    """The template rendered by jinja2 itself, as transformers' apply_chat_template sets it up."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def split_all(splitter: ReasoningSplitter, pieces, ids=None) -> tuple[str, str]:
    segments = []
    for i, piece in enumerate(pieces):
        segments += splitter.feed(piece, None if ids is None else ids[i])
    segments += splitter.flush()
    return join(segments, REASONING), join(segments, ANSWER)


# ---------------------------------------------------------------- the splitter


def test_splitter_tags_split_anywhere_across_pieces():
    """Text matching: cut the reply at every pair of places (tags split over pieces included):
    the reasoning and answer are always the same, tags and the whitespace around the reasoning
    and after </think> removed."""
    text = "<think>\nHmm, 2 + 2.\nSo 4.\n</think>\n\nThe answer is 4."
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            got = split_all(ReasoningSplitter(), [text[:i], text[i:j], text[j:]])
            assert got == ("Hmm, 2 + 2.\nSo 4.", "The answer is 4."), (i, j)


def test_splitter_without_opening_tag_after_a_think_prompt():
    """Qwen3.5's generation prompt ends with "<think>\\n": the reply starts inside the
    reasoning, detected from the prompt's tail; a prompt that ends after "</think>" starts
    in the answer."""
    prompt = "<|im_start|>assistant\n<think>\n"
    s = ReasoningSplitter.for_prompt(_NoTags(), prompt)
    assert s.in_reasoning
    assert split_all(s, ["Let me", " see.\n</th", "ink>\n\n", "Yes."]) == ("Let me see.", "Yes.")
    closed = ReasoningSplitter.for_prompt(_NoTags(), prompt + "\n</think>\n\n")
    assert split_all(closed, ["\n", "Yes."]) == ("", "Yes.") and not closed.saw_reasoning


def test_splitter_without_tags_is_all_answer_byte_for_byte():
    """No tags: every byte is answer, leading whitespace and tag-like text included; a <think>
    after the answer has started is answer text."""
    for pieces in (
        ["  ", "<", "b>hi</b>"],
        ["\n", "<thi", "s is not a tag"],
        ["A ", "<think>", " B </think>"],
        ["<thin"],
        [" "],
    ):
        assert split_all(ReasoningSplitter(), pieces) == ("", "".join(pieces)), pieces


def test_splitter_matches_tags_by_token_id(model):
    """The tokenizer's added special tokens are matched by id (their text is never shown);
    text that merely looks like a tag is not a tag when the vocabulary has the real ones."""
    tok = model.tokenizer
    ids = tag_ids(tok)
    assert ids == {
        tok.special_tokens["<think>"]: "<think>",
        tok.special_tokens["</think>"]: "</think>",
    }
    reply = tok.encode(RAW_REPLY, special=True)
    pieces = [tok.decode([i]) for i in reply]
    s = ReasoningSplitter(ids=ids)
    assert split_all(s, pieces, reply) == (REASONING_TEXT, ANSWER_TEXT)
    assert s.reasoning_tokens == len(tok.encode(REASONING_TEXT))
    plain = tok.encode("<think>x</think>y")  # special=False: the tags as ordinary pieces
    got = split_all(ReasoningSplitter(ids=ids), [tok.decode([i]) for i in plain], plain)
    assert got == ("", "<think>x</think>y")
    assert tag_ids(_NoTags()) == {}


class _NoTags:
    """A vocabulary where a tag is several tokens (byte-level)."""

    def encode(self, text: str, **kw) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode()


# ---------------------------------------------------------------- templates and sessions


def test_enable_thinking_detected_from_the_template_parse():
    """jinja2's parser finds enable_thinking in the Qwen3 and Qwen3.5 templates, not in ChatML;
    a session passes it only to a template that reads it."""
    for name in (QWEN3, QWEN35):
        t = ChatTemplate(name, llama_cpp_reference(name).read_text())
        assert "enable_thinking" in t.variables
    assert "enable_thinking" not in builtin_template("chatml").variables
    # a mention in a comment or a string is not a use
    assert ChatTemplate("x", "{# enable_thinking #}{{ 'enable_thinking' }}").variables == set()


def test_session_thinking_setting_reaches_only_templates_that_read_it(model, thinker, tiny):
    session = mlxlis.ChatSession(model)
    msgs = [user("Hi")]
    assert session.prompt_preview("Hi") == official(thinker.template, msgs)  # template default
    session.thinking = False
    assert session.template_vars == {"enable_thinking": False}
    no_think = session.prompt_preview("Hi")
    assert no_think == official(thinker.template, msgs, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    session.thinking = True
    assert session.prompt_preview("Hi") == official(thinker.template, msgs, enable_thinking=True)
    chatml = mlxlis.load(tiny("llama")[0], "float32", chat_template="chatml")
    assert not chatml.supports_thinking
    other = mlxlis.ChatSession(chatml, thinking=False)
    assert other.template_vars == {} and other.prompt_preview("Hi") == chatml.render_chat(msgs)


def test_session_history_rerenders_as_the_official_template(model, thinker):
    """A reply streams as reasoning then answer, tags never in either; the history holds the
    answer as content and the reasoning as reasoning_content, so every re-render equals the
    official template given the raw generated text: the reasoning shown for the last turn,
    dropped from earlier ones."""
    session = mlxlis.ChatSession(model)
    events = list(session.send("Hi"))
    raw = model.tokenizer.decode([e.token for e in events if e.token is not None])
    assert raw == RAW_REPLY and "".join(e.text for e in events) == RAW_REPLY
    assert "".join(e.reasoning for e in events) == REASONING_TEXT
    assert "".join(e.answer for e in events) == ANSWER_TEXT
    assert events[-1].finish_reason == "stop" and events[-1].reasoning_tokens == 4
    turn = session.turns[-1]
    assert (turn.content, turn.reasoning) == (ANSWER_TEXT, REASONING_TEXT)
    history = [user("Hi"), {"role": "assistant", "content": raw}]
    assert session.render(add_generation_prompt=False) == official(thinker.template, history, False)
    assert f"<think>\n{REASONING_TEXT}\n</think>\n\n{ANSWER_TEXT}" in session.render(False)
    nxt = official(thinker.template, [*history, user("Next")])
    assert session.prompt_preview("Next") == nxt and REASONING_TEXT not in nxt
    # the next turn, thinking off: the model answers at once, no reasoning is stored
    session.thinking = False
    events = list(session.send("Next"))
    assert "".join(e.reasoning for e in events) == "" and session.turns[-1].reasoning is None
    assert session.turns[-1].content == ANSWER_TEXT
    assert session.last_prompt_tokens == len(
        model.tokenizer.encode(
            official(thinker.template, [*history, user("Next")], enable_thinking=False),
            special=True,
        )
    )


def test_qwen35_prompt_ends_in_think_and_history_matches(thinker):
    """Qwen3.5's template opens the reasoning in the prompt ("<think>\\n"): the reply is split
    from its first token on, and the re-render equals the official Qwen3.5 template's."""
    path = llama_cpp_reference(QWEN35)
    qwen35 = mlxlis.load(thinker.folder, "float32", chat_template=str(path))
    session = mlxlis.ChatSession(qwen35)
    assert session.prompt_preview("Hi").endswith("<think>\n")
    events = list(session.send("Hi"))
    raw = qwen35.tokenizer.decode([e.token for e in events if e.token is not None])
    turn = session.turns[-1]
    assert (turn.content, turn.reasoning) == (ANSWER_TEXT, REASONING_TEXT)
    history = [user("Hi"), {"role": "assistant", "content": raw}]
    template = path.read_text()
    assert session.render(False) == official(template, history, False)
    assert session.prompt_preview("Next") == official(template, [*history, user("Next")])


# ---------------------------------------------------------------- the command line


def mlxlis_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxlis", *args], capture_output=True, text=True, timeout=300
    )


def prompt_tokens(stderr: str) -> int:
    return int(re.search(r"prompt: (\d+) tokens", stderr).group(1))


def test_cli_answer_on_stdout_reasoning_on_stderr(thinker, model):
    """`python -m mlxlis` (stderr not a terminal): stdout is the answer alone, stderr the
    reasoning alone, plain text; --think renders the template with enable_thinking=true."""
    res = mlxlis_cli("-m", str(thinker.folder), "Hi")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ANSWER_TEXT + "\n"
    assert res.stderr == REASONING_TEXT + "\n"
    think = mlxlis_cli("-m", str(thinker.folder), "--think", "--verbose", "Hi")
    assert think.returncode == 0 and think.stdout == ANSWER_TEXT + "\n", think.stderr
    expected = official(thinker.template, [user("Hi")], enable_thinking=True)
    assert prompt_tokens(think.stderr) == len(model.tokenizer.encode(expected, special=True))


def test_cli_no_think_renders_the_empty_think_block(thinker, model):
    """--no-think: the prompt is the official template with enable_thinking=false (same text
    through the CLI's prompt function; same token count in the subprocess), and the model
    answers at once. On a template without the switch it says so on stderr and still hides
    the reasoning the model writes."""
    from mlxlis.commands.one_shot import chat_prompt

    expected = official(thinker.template, [user("Hi")], enable_thinking=False)
    assert chat_prompt(model, "Hi", thinking=False) == expected
    res = mlxlis_cli("-m", str(thinker.folder), "--no-think", "--verbose", "Hi")
    assert res.returncode == 0 and res.stdout == ANSWER_TEXT + "\n", res.stderr
    assert REASONING_TEXT not in res.stderr
    assert prompt_tokens(res.stderr) == len(model.tokenizer.encode(expected, special=True))
    # ChatML has no thinking switch; its prompt ends in "\n", so the model still reasons
    chatml_dir = thinker.folder.parent / "thinker-chatml"
    shutil.copytree(thinker.folder, chatml_dir, dirs_exist_ok=True)
    (chatml_dir / "chat_template.jinja").write_text(builtin_template("chatml").text)
    res = mlxlis_cli("-m", str(chatml_dir), "--no-think", "Hi")
    assert res.returncode == 0 and res.stdout == ANSWER_TEXT + "\n", res.stderr
    assert res.stderr.splitlines() == [
        "mlxlis: note: --no-think: the chat template has no thinking switch; "
        "the prompt is the same without it"
    ]
    bad = mlxlis_cli("-m", str(thinker.folder), "--no-chat", "--think", "Hi")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--think" in bad.stderr and "--no-chat" in bad.stderr


def test_a_constraint_starts_after_the_reasoning(model):
    """Structured output on the scripted reasoning model: the reasoning ("The quick brown
    fox", which the pattern forbids) comes out unconstrained, the answer after `</think>`
    follows the regex, the reply ends on the template's stop. With thinking off the prompt
    ends after the closed block and the pattern binds from the first token; given no prompt
    (token ids alone) it binds from the first token too, so `<think>` is never allowed."""
    rf = {"type": "regex", "regex": r"\s*Hello, world!"}
    chat = mlxlis.ChatSession(
        model, response_format=rf, sampling=mlxlis.SamplingParams(max_tokens=30)
    )
    events = list(chat.send("Hi"))
    assert events[-1].finish_reason == "stop"
    assert chat.turns[-1].reasoning == REASONING_TEXT and chat.turns[-1].content == ANSWER_TEXT
    chat = mlxlis.ChatSession(
        model, response_format=rf, thinking=False, sampling=mlxlis.SamplingParams(max_tokens=30)
    )
    events = list(chat.send("Hi"))
    assert chat.turns[-1].reasoning is None and chat.turns[-1].content == ANSWER_TEXT
    ids = model.tokenizer.encode(model.render_chat([user("Hi")]), special=True)
    tokens = [
        e.token
        for e in mlxlis.generate(model, ids, max_tokens=30, response_format=rf)
        if e.token is not None
    ]
    think = model.tokenizer.encode("<think>", special=True, add_bos=False)[0]
    assert think not in tokens and tokens
