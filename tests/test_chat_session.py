"""ChatSession: KV reuse across turns, stop tokens, BOS handling, context limit, cancellation.

KV reuse is checked as self-consistency at the logits level: the logits after
prefilling only the new suffix onto the reused cache equal those of a fresh full forward over
the whole rendered conversation.
"""

from __future__ import annotations

import mlxlis
from mlxlis.errors import ContextLimitError, NoChatTemplateError
from mlxlis.generation.steps import prefill

import numpy as np
import pytest


@pytest.fixture(scope="module")
def chat_model(tiny):
    folder, _ = tiny("llama")
    return mlxlis.load(folder, "float32", chat_template="chatml")


def test_template_source_and_stop_tokens(chat_model):
    """An explicitly named built-in is used and reported; its end-of-turn token stops."""
    assert chat_model.template_source == "builtin:chatml"
    im_end = chat_model.tokenizer.special_tokens["<|im_end|>"]
    assert im_end in chat_model.stop_ids()


def test_second_turn_reuses_cache_and_matches_fresh_forward(chat_model):
    session = mlxlis.ChatSession(chat_model, system="Be brief.")
    list(session.send("Hello there, how are you?", max_tokens=6))
    assert session.turns[-1].role == "assistant"
    list(session.send("Tell me more.", max_tokens=6))
    assert session.last_reused_tokens > 10  # the system + first exchange were not re-run
    # logits-level check of the reuse path on the next (third) prompt
    session.turns.append(mlxlis.generation.session.Turn("user", "And then?"))
    ids = chat_model.tokenizer.encode(session.render(), special=True)
    cache, reuse = session._prefix.take(ids, None)  # the caches the next turn would start from
    assert reuse > 0
    reused = np.array(prefill(chat_model.net, ids[reuse:], cache))
    fresh = np.array(chat_model.logits(ids))[-1]
    assert np.abs(reused[0] - fresh).max() < 1e-5  # measured 6.9e-7


def test_reply_tokens_equal_fresh_generation(chat_model):
    """Greedy reply of turn 2 with cache reuse == greedy generation from scratch on the same
    rendered prompt (deterministic setting, few tokens)."""
    session = mlxlis.ChatSession(chat_model)
    list(session.send("One two three", max_tokens=5))
    events = list(session.send("four five", max_tokens=5))
    with_reuse = [e.token for e in events if e.token is not None]
    session.turns.pop()  # drop the reply to re-render the prompt that produced it
    ids = chat_model.tokenizer.encode(session.render(), special=True)
    fresh = [e.token for e in mlxlis.generate(chat_model, ids, max_tokens=5) if e.token is not None]
    assert with_reuse == fresh


def test_no_double_bos(tiny):
    """A template that writes bos_token itself: encoding the rendered text adds no second BOS."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32", chat_template="llama2")
    text = model.render_chat([{"role": "user", "content": "hi"}])
    bos = model.tokenizer.bos_token
    assert text.startswith(bos)
    ids = model.tokenizer.encode(text, special=True)
    assert ids[0] == model.tokenizer.bos_id and ids[1] != model.tokenizer.bos_id


def test_context_limit_is_explicit(chat_model):
    session = mlxlis.ChatSession(chat_model, context_limit=24)
    with pytest.raises(ContextLimitError, match="context"):
        list(session.send("word " * 40, max_tokens=4))
    assert session.turns == []  # the refused turn left no trace


def test_cancel_keeps_partial_reply_and_next_turn_works(chat_model):
    session = mlxlis.ChatSession(chat_model)
    seen = []
    events = list(
        session.send(
            "Count with me",
            max_tokens=20,
            stop_ids=set(),
            should_stop=lambda: len(seen.append(1) or seen) >= 3,
        )
    )
    assert events[-1].finish_reason == "cancelled"
    assert session.turns[-1].stopped and session.turns[-1].role == "assistant"
    assert session.context_used == len(session._cached) > 0
    list(session.send("Go on", max_tokens=3))
    assert session.turns[-1].role == "assistant" and not session.turns[-1].stopped


def test_no_template_refuses_chat(tiny):
    """A model without a template raises NoChatTemplateError with the ways out, never guesses."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    assert model.template is None
    with pytest.raises(NoChatTemplateError, match="--no-chat"):
        model.render_chat([{"role": "user", "content": "hi"}])


def test_reset_clears_cache(chat_model):
    session = mlxlis.ChatSession(chat_model)
    list(session.send("Hi", max_tokens=3))
    session.reset()
    assert session.turns == [] and session.context_used == 0


def test_stop_during_prefill_keeps_whole_chunks_and_a_consistent_cache(chat_model):
    """A stop seen between prefill chunks ends generation before any token; the cache holds
    exactly the whole chunks reported in `fed`, so feeding the rest on top gives the full
    forward's last logits (self-consistency; measured max |Δ| ~1e-6, bound 1e-5)."""
    from conftest import trajectory

    ids = trajectory(20, vocab=chat_model.config.vocab_size)
    cache = chat_model.make_cache()
    checks: list[int] = []
    events = list(
        mlxlis.generate(
            chat_model,
            ids,
            max_tokens=5,
            cache=cache,
            prefill_step=8,
            should_stop=lambda: not checks.append(1),
        )
    )
    assert len(checks) == 1  # stopped at the first check, after the first chunk
    (final,) = events
    assert final.token is None and final.finish_reason == "cancelled"
    assert final.fed == ids[:8] and cache[0].offset == 8
    rest = np.array(prefill(chat_model.net, ids[8:], cache))[0]
    full = np.array(chat_model.logits(ids))[-1]
    assert np.abs(rest - full).max() < 1e-5
