"""Gemma 4's thinking channel: `<|channel>thought\\n…<channel|>` before the answer.

Gemma 4's own vocabulary (llama.cpp's ggml-vocab-gemma-4.gguf, opened with
mlxlis.load_tokenizer) and its official chat template (llama.cpp's copy, rendered by jinja2
itself): the channel tags are single tokens there, so the splitter matches them by id, drops
the channel's name, and keeps reasoning and answer apart; a prompt rendered with thinking off
already holds the empty channel, so the reply is all answer. Proves the split for Gemma 4 the
way test_thinking.py proves it for Qwen3's `<think>` tags.
"""

from __future__ import annotations

import mlxlis
from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter, join
from mlxlis.tokenizer import StreamDecoder

from conftest import llama_cpp_reference
from test_thinking import official, user

REPLY = "<|channel>thought\nThe user greets me; answer briefly.<channel|>Hello! How can I help?"


def stream(tok, splitter: ReasoningSplitter, text: str) -> tuple[str, str]:
    """Feed `text` token by token as generation would: decoded pieces with their ids."""
    ids = tok.encode(text, special=True, add_bos=False, add_eos=False)
    decoder = StreamDecoder(tok)
    segments = []
    for i in ids:
        segments += splitter.feed(decoder.add(i), i)
    segments += splitter.flush()
    return join(segments, REASONING), join(segments, ANSWER)


def test_gemma4_channel_split_by_token_id():
    tok = mlxlis.load_tokenizer(llama_cpp_reference("ggml-vocab-gemma-4.gguf"))
    template = llama_cpp_reference("templates/google-gemma-4-31B-it.jinja").read_text()
    on = official(template, [user("Hi")], enable_thinking=True, bos_token="<bos>")
    off = official(template, [user("Hi")], enable_thinking=False, bos_token="<bos>")
    assert off.endswith("<|channel>thought\n<channel|>") and not on.endswith("<channel|>")

    splitter = ReasoningSplitter.for_prompt(tok, on)
    assert (splitter.open_tag, splitter.close_tag) == ("<|channel>", "<channel|>")
    assert stream(tok, splitter, REPLY) == (
        "The user greets me; answer briefly.",
        "Hello! How can I help?",
    )
    assert splitter.saw_reasoning and splitter.reasoning_tokens > 3
    # thinking off: the template closed the channel already; the reply is all answer
    assert stream(tok, ReasoningSplitter.for_prompt(tok, off), "Hello!") == ("", "Hello!")
