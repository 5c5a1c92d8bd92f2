"""gpt-oss's harmony format, proven against OpenAI's own chat template (llama.cpp's copy).

What the template renders for an assistant turn (its `thinking`, its `content`, its
`tool_calls`) is the text the model was trained to write after the generation prompt
`<|start|>assistant`. Each test renders a conversation through the real template, takes the
assistant's part, streams it in small pieces through what the server runs (the splitter
`ReasoningSplitter.for_prompt` picks for that prompt, then the tool-call parser of the format
`for_template` picks for that template) and gets the thinking, the answer and the calls
back. A round trip through independent text, not the parser checked against itself.
"""

from __future__ import annotations

import json

from mlxlis.prompt.harmony import HarmonySplitter
from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter
from mlxlis.prompt.template import ChatTemplate
from mlxlis.prompt.tool_calls import ToolCallParser
from mlxlis.prompt.tool_formats import for_template
from mlxlis.tokenizer import Tokenizer

import pytest
from conftest import llama_cpp_reference, train_tokenizer

HARMONY_TOKENS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = "The user wants the weather.\n\nI should call get_weather."


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(
        "gpt-oss", llama_cpp_reference("templates/openai-gpt-oss-120b.jinja").read_text()
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A vocabulary with harmony's tags as special tokens, as gpt-oss's has."""
    folder = tmp_path_factory.mktemp("harmony-tok")
    train_tokenizer(folder, extra_special=HARMONY_TOKENS)
    return Tokenizer.from_folder(folder)


def reply_of(template: ChatTemplate, assistant: dict) -> tuple[str, str]:
    """(the generation prompt, the text the template writes for `assistant` after it)."""
    kw = {"tools": TOOLS}
    head = template.render(USER, add_generation_prompt=True, **kw)
    whole = template.render([*USER, assistant], add_generation_prompt=False, **kw)
    assert whole.startswith(head) and head.endswith("<|start|>assistant")
    return head, whole[len(head) :]


def stream(tokenizer, template, prompt: str, text: str, piece: int):
    """(reasoning, content, calls) as the server's ChatReply would build them."""
    splitter = ReasoningSplitter.for_prompt(tokenizer, prompt)
    assert isinstance(splitter, HarmonySplitter)
    parser = ToolCallParser(frozenset({"get_weather"}), for_template(template.text))
    reasoning, content, calls = "", "", []
    parts = []
    for i in range(0, len(text), piece):
        parts += splitter.feed(text[i : i + piece])
    parts += splitter.flush()
    for kind, t in parts:
        if kind == REASONING:
            reasoning += t
        else:
            shown, new = parser.feed(t)
            content, calls = content + shown, calls + new
    shown, new = parser.flush()
    return reasoning, content + shown, calls + new


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_thinking_and_answer_split_back(template, tokenizer, piece):
    """The analysis channel comes back as reasoning, the final channel as the answer (the
    template ends the turn with <|return|>, the end-of-reply token the engine stops at)."""
    answer = "It is sunny in Paris, 21 °C."
    prompt, text = reply_of(
        template, {"role": "assistant", "thinking": THINKING, "content": answer}
    )
    text = text.removesuffix("<|return|>")
    assert "<|channel|>analysis" in text and "<|channel|>final" in text
    assert stream(tokenizer, template, prompt, text, piece) == (THINKING, answer, [])


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_tool_call_after_thinking_parses_back(template, tokenizer, piece):
    """An assistant turn that reasons and calls a tool (the template's recipient before the
    channel; <|call|> ends the reply), and the same call with the recipient after the
    channel and a <|constrain|> type, as the model also writes it."""
    args = {"city": "Paris", "days": [1, 2]}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    prompt, text = reply_of(
        template, {"role": "assistant", "thinking": THINKING, "tool_calls": [call]}
    )
    text = text.removesuffix("<|call|>")
    moved = text.replace(
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
    )
    assert moved != text
    for reply in (text, moved):
        reasoning, content, calls = stream(tokenizer, template, prompt, reply, piece)
        assert (reasoning, content) == (THINKING, "")
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert got == [("get_weather", args)]


def test_past_reasoning_reaches_the_template_as_thinking(template):
    """The server hands a message's reasoning_content to this template as `thinking`, the
    field it reads (it renders the analysis before a past tool call)."""
    from mlxlis.serve.chat_messages import message_dict
    from mlxlis.serve.schemas import ChatMessage

    class Model:  # only what message_dict reads of a model: its template
        vision = None

    Model.template = template
    msg = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": THINKING,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        }
    )
    rendered = template.render(
        [*USER, message_dict(msg, 1, Model)], add_generation_prompt=True, tools=TOOLS
    )
    assert f"<|channel|>analysis<|message|>{THINKING}<|end|>" in rendered


def test_plain_text_is_the_answer_and_headers_are_never_shown():
    """A reply with no harmony header is answer text as it came; an unfinished header at the
    end of a reply shows nothing."""
    s = HarmonySplitter()
    assert s.feed("Hello <b>there</b>") + s.flush() == [(ANSWER, "Hello <b>there</b>")]
    s = HarmonySplitter()
    assert s.feed("<|channel|>analysis") + s.flush() == []


def test_a_header_that_never_ends_is_answer_text_and_an_unfinished_one_is_dropped():
    """A model that writes a header past any header's length without <|message|> gets its
    text shown (the splitter does not hold it, nor loop); a reply cut inside the next
    message's header shows nothing of it."""
    s = HarmonySplitter()
    parts = s.feed("<|channel|>final<|message|>x<|end|>") + s.feed("<|start|>assistant" + "y" * 600)
    parts += s.flush()
    assert parts[0] == (ANSWER, "x") and "y" * 600 in parts[1][1]
    s = HarmonySplitter()
    got = s.feed("<|channel|>final<|message|>A<|end|><|start|>assistant") + s.flush()
    assert got == [(ANSWER, "A")]


def test_a_forced_call_opens_through_the_splitter(template, tokenizer):
    """tool_choice naming a function whose call cannot be a grammar opens the call in the
    prompt (HARMONY.forced): the server's reply reads that header as the model's own, and
    the arguments the model then writes come back as the call."""
    from mlxlis.generation.events import Event, Usage
    from mlxlis.prompt.tool_formats import HARMONY
    from mlxlis.serve.reply import ChatReply

    prompt = template.render(USER, add_generation_prompt=True, tools=TOOLS)
    forced = HARMONY.forced("get_weather")
    reply = ChatReply(
        tokenizer,
        None,
        prompt,
        logprobs=False,
        tools=frozenset({"get_weather"}),
        tool_format=HARMONY,
        forced=forced,
    )
    for piece in ('{"city": ', '"Oslo"}'):
        reply.feed(Event(None, piece, Usage()))
    reply.feed(Event(None, "", Usage(), finish_reason="stop"))
    msg = reply.message()
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_harmony_vocabularies_stop_at_return_and_call_not_end(tokenizer, template, tmp_path):
    """<|end|> ends a harmony message, not the reply: a model with gpt-oss's template and tags
    stops at <|return|> and <|call|> only (llama.cpp's rule for o200k_harmony)."""
    import mlxlis

    from conftest import build_tiny
    from test_gpt_oss import SPECS

    folder = tmp_path / "oss"
    build_tiny(folder, SPECS["oss"], tokenizer_kw={"extra_special": HARMONY_TOKENS})
    (folder / "chat_template.jinja").write_text(template.text)
    model = mlxlis.load(folder, "float32")
    special = model.tokenizer.special_tokens
    stops = model.stop_ids()
    assert special["<|end|>"] not in stops
    assert {special["<|return|>"], special["<|call|>"]} <= stops


def test_a_thinking_budget_forces_the_whole_switch_to_final_and_stops_at_end(tokenizer):
    """Anthropic's budget_tokens on harmony: past the budget, every token of
    <|end|><|start|>assistant<|channel|>final<|message|> is forced in turn; an analysis
    message the model ends itself (<|end|>, then any message, a call too) is not touched."""
    from mlxlis.generation.processors import ReasoningBudget

    import mlx.core as mx

    s = HarmonySplitter()

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, special=True, add_bos=False, add_eos=False)

    def budget() -> ReasoningBudget:
        ends = [ids(t) for t in s.end_tags]
        return ReasoningBudget(2, 0, ids(s.open_tag), ids(s.close_tag), False, ends)

    logits = mx.zeros((1, tokenizer.vocab_size))
    word = ids("hm")[:1]
    limit, history = budget(), ids(s.open_tag) + word * 2
    forced = []
    for _ in ids(s.close_tag):
        pick = int(mx.argmax(limit(logits, history), axis=-1).item())
        forced.append(pick)
        history.append(pick)
    assert forced == ids(s.close_tag)
    assert bool(mx.array_equal(limit(logits, history), logits))  # answering: free again
    limit, history = budget(), ids(s.open_tag) + word + ids("<|end|><|start|>assistant") + word * 5
    assert bool(mx.array_equal(limit(logits, history), logits))
