"""An agent's session reuses every cached token it can, exactly, on every kind of cache.

A scripted 10-turn tool-using session (a system prompt with tools, then assistant replies with
reasoning and a tool call, each followed by the tool's result) is rendered by a ChatML-style
template that, as reasoning templates do, drops past reasoning and trims past replies, and whose
generation prompt opens the reasoning (`<|im_start|>assistant\\n<think>\\n`). Each reply is the
"model's" own output (forced token by token: on random weights only the caches matter), so the
prefix cache holds the prompt and the reply exactly as a server's would. From turn 2 on:

(a) the engine's `cached_tokens` equals what the test computes from the token ids alone: the
    longest prefix the new prompt shares with the ids the cache holds on full attention (Llama);
    on a sliding-window ring past its window (Gemma 3, window 16) and on a hybrid with Gated
    DeltaNet layers (Qwen3.5) the latest snapshot within that prefix, which is where the
    previous prompt ended before its generation prompt (the template re-renders the reply
    after it differently);
(b) the first two steps' logits equal a cold run of the same prompt on fresh caches, within
    2e-5 (float32; measured at most ~5e-6): not bitwise, because the reused prefix was
    prefilled in other chunks (earlier turns') than the cold run's, and a chunk's shape
    changes the order of the sums in its products and its attention.

Self-consistency (ours reused vs ours cold); the cold paths are checked against transformers in
test_llama_parity.py, test_gemma_parity.py and test_qwen3_5.py. Also: the ring's snapshots
are copies no later in-place write reaches, restorable more than once; their bytes and the
recurrent ones count in the prefix cache; the core ends prefill chunks at the requested
snapshot positions; prepare_chat and ChatSession ask for the snapshot where the server's and
the chat's next turn part from this one. A version past 4 000 tokens on the real SmolLM2 and
Gemma 3 270M is marked extended.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import mlxlis
from mlxlis.cache import KVBatch, RecurrentCache, RotatingKVCache, common_prefix
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core, Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.generate import run
from mlxlis.generation.processors import LogitsProcessor
from mlxlis.generation.request import turn_start
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.steps import LocalSteps, StepKind

import mlx.core as mx
import numpy as np
import pytest
from conftest import CORPUS, build_tiny, need_pulled
from test_qwen3_5 import SPECS as QWEN35_SPECS
from test_qwen3_5 import realistic

WINDOW = 16
GEMMA3 = dict(
    kind="gemma3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=8192,
)
LLAMA = dict(
    kind="llama",
    hidden_size=64,
    intermediate_size=144,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)
CALLS = [{"type": "object"}, *({"name": n, "arguments": {"a": 1}} for n in ("read", "test"))]
# the template's tags are single tokens, as in Qwen's vocabularies
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# and the tokenizer learns the words of tool calls and turns (else one token per letter)
WORDS = (" ".join(["system user assistant Fox Hi Hello # Tools", *map(json.dumps, CALLS)]) * 20,)
BOUND = 2e-5  # |Δ| of reused vs cold logits (float32)
# how far back from the cached end of `held` ids every layer returns without a snapshot (a
# ring within its window, a recurrent state only at its end); None: anywhere (full attention)
Exact = Callable[[int], int] | None

# DeepSeek-R1-style: past reasoning never rendered, replies trimmed, the generation prompt
# opens the reasoning; tool results as user turns (Qwen's <tool_response>)
TEMPLATE = r"""
{%- for m in messages %}
{%- if m.role == 'system' %}
{{- '<|im_start|>system\n' + m.content }}
{%- if tools %}
{{- '\n\n# Tools' }}
{%- for t in tools %}
{{- '\n- ' + t.function.name + ': ' + (t.function.parameters | tojson) }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (m.content | trim) }}
{%- for c in m.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' }}
{{- (c.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %}"""
GEMMA_TEMPLATE = (  # the same with Gemma's turn markers (the real Gemma 3 270M)
    TEMPLATE.replace("<|im_start|>assistant", "<start_of_turn>model")
    .replace("<|im_start|>", "<start_of_turn>")
    .replace("<|im_end|>", "<end_of_turn>")
)
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("read", "test")
]


def script(turns: int, scale: int = 1) -> list[tuple[str, str, dict, str]]:
    """(reasoning, answer text, tool call, tool result) of each turn, short (the tiny
    tokenizer spends a token on two characters); `scale` repeats the tool results' text (a
    longer session)."""
    out = []
    for i in range(turns):
        call = {"name": TOOLS[i % 2]["function"]["name"], "arguments": {"a": i}}
        reasoning = f"Fox {i}."
        answer = f"  Hi {i}! " if i % 3 else f"Hello {i}.\n\n"  # trimmed on re-render
        result = "\n".join(f"def add(a, b):  # {i}" for _ in range(scale))
        out.append((reasoning, answer, call, result))
    return out


def forced_reply(reasoning: str, answer: str, call: dict) -> str:
    """What the model wrote: the reasoning the prompt opened, closed, the answer, the call."""
    return f"{reasoning}\n</think>\n\n{answer}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def assistant(reasoning: str, answer: str, call: dict, i: int) -> dict:
    function = {"name": call["name"], "arguments": call["arguments"]}
    return {
        "role": "assistant",
        "content": answer,
        "reasoning_content": reasoning,
        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": function}],
    }


class Scripted(LogitsProcessor):
    """A logits processor forcing `ids` as the reply (greedy on a one-hot row) that keeps the
    logits it was given at the reply's first `keep` steps."""

    def __init__(self, start: int, ids: list[int], keep: int = 2):
        self.start, self.ids, self.keep = start, ids, keep
        self.seen: list[np.ndarray] = []

    def __call__(self, logits: mx.array, history) -> mx.array:
        i = len(history) - self.start
        if i < self.keep:
            self.seen.append(np.array(logits[0]))
        hot = (mx.arange(logits.shape[-1]) == self.ids[i])[None]  # (1, vocab)
        return mx.where(hot, mx.array(0.0, logits.dtype), mx.array(-mx.inf, logits.dtype))


def cold(model, ids: list[int], reply: list[int]) -> list[np.ndarray]:
    """The first two steps' logits of `ids` on fresh caches (the core on its own)."""
    core = Core(model, LocalSteps(model, PrefixCache(0)))
    force = Scripted(len(ids), reply)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    list(run(core, core.start(Request(ids, params, processors=(force,)))))
    return force.seen


def snapshot_point(model, messages: list[dict], ids: list[int], **variables) -> int:
    """The test's own reckoning of where the prompt ends before its generation prompt."""
    text = model.render_chat(messages, add_generation_prompt=False, **variables)
    return common_prefix(model.tokenizer.encode(text, special=True), ids)


def expected_reuse(held: list[int], ids: list[int], points: list[int], exact: Exact) -> int:
    """What caches holding `held` can give the prompt `ids`: the shared prefix (its last id
    always fed again) when every layer returns there (`exact`), else the latest snapshot point
    within it."""
    shared = min(common_prefix(held, ids), len(ids) - 1)
    if exact is None or len(held) - shared <= exact(len(held)):
        return shared
    return max((p for p in points if p <= shared), default=0)


def ring(window: int) -> Callable[[int], int]:
    """A ring returns anywhere until positions rotate out, then to its newest one only."""
    return lambda held: held if held <= window else 1


def session(
    model,
    exact: Exact,
    end: str = "<|im_end|>",
    turns: int = 10,
    scale: int = 1,
    cold_turns: frozenset[int] | None = None,
):
    """The scripted session through the serving engine, replies ending with `end`; per turn
    from the second on: the prompt's length, the reused and expected counts, the previous
    prompt's snapshot point, the worst logits difference from a cold run (of the turns in
    `cold_turns`, None: all; 0.0 for the others), the reuse note."""
    tok = model.tokenizer
    stop = tok.encode(end, special=True, add_bos=False)  # Gemma adds a BOS
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "The tests fail in src/: find the bug and fix it."},
    ]
    engine = Engine(model, prefix_cache_bytes=1 << 30)
    held: list[int] = []
    points: list[int] = []
    rows = []
    try:
        for i, (reasoning, answer, call, result) in enumerate(script(turns, scale)):
            prompt = model.render_chat(messages, add_generation_prompt=True, tools=TOOLS)
            ids = tok.encode(prompt, special=True)
            text = forced_reply(reasoning, answer, call)
            reply = tok.encode(text, special=True, add_bos=False) + stop
            force = Scripted(len(ids), reply)
            req = Request(
                ids,
                SamplingParams(max_tokens=len(reply) + 1, temperature=0.0),
                frozenset(stop),
                processors=(force,),
                snapshot_at=turn_start(model, messages, ids, tools=TOOLS),
            )
            final = list(engine.submit(req))[-1]
            assert final.finish_reason == "stop", final.error
            if i:
                want = expected_reuse(held, ids, points, exact)
                delta = 0.0
                if cold_turns is None or i in cold_turns:
                    pairs = zip(force.seen, cold(model, ids, reply), strict=True)
                    delta = max(float(np.abs(a - b).max()) for a, b in pairs)
                u = final.usage
                shared = min(common_prefix(held, ids), len(ids) - 1)
                rows.append(
                    (len(ids), u.cached_tokens, want, points[-1], delta, u.reuse_note, shared)
                )
            points.append(snapshot_point(model, messages, ids, tools=TOOLS))
            held = ids + reply  # the stop token is fed too (the step after it was queued)
            messages += [
                assistant(reasoning, answer, call, i),
                {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
            ]
    finally:
        engine.shutdown()
    return rows


def with_template(ref, folder, template: str = TEMPLATE):
    """The model at `ref` with the agent template (written to `folder`), in float32."""
    path = folder / "agent_template.jinja"
    path.write_text(template)
    return mlxlis.load(ref, "float32", chat_template=str(path))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, spec, adjust in (
        ("llama", LLAMA, None),
        ("gemma3", GEMMA3, None),
        ("qwen3_5", QWEN35_SPECS["qwen3_5"], realistic),
    ):
        folder = tmp_path_factory.mktemp(name)
        build_tiny(
            folder,
            spec,
            tokenizer_kw=dict(vocab_size=700, extra_special=TAGS, corpus=(CORPUS, *WORDS)),
            adjust=adjust,
        )
        out[name] = with_template(folder, folder)
    return out


# each model: how far back from the cached end its layers return without a snapshot (Exact)
EXACT = {"llama": None, "gemma3": ring(WINDOW), "qwen3_5": lambda held: 0}


def check_session(rows, bound: float = BOUND) -> None:
    for prompt, cached, want, before, delta, note, shared in rows:
        assert cached == want, (prompt, cached, want, note)
        assert cached >= before > 0  # at least the previous prompt's end before its reply
        assert delta < bound, (prompt, delta)
        assert note.startswith("prefix ") and f"; reused {cached}" in note, note
        assert cached == shared or f"snapshot at {cached}" in note, note


@pytest.mark.parametrize("name", list(EXACT))
def test_agent_session_reuses_every_cached_token_exactly(models, name):
    """(a) and (b) of the module docstring over 10 turns, prompts growing to a few hundred
    tokens (Gemma 3's window is 16: every prompt is far past it)."""
    model = models[name]
    rows = session(model, EXACT[name])
    assert len(rows) == 9 and rows[-1][0] > 20 * WINDOW
    check_session(rows)
    if name != "llama":  # past the window, every turn came back to a snapshot
        assert all(r[1] < r[6] for r in rows)


@pytest.mark.extended
@pytest.mark.real
@pytest.mark.parametrize(
    "name, template, end, exact",
    [
        ("smollm2-135m", TEMPLATE, "<|im_end|>", None),
        ("gemma3-270m", GEMMA_TEMPLATE, "<end_of_turn>", ring(512)),
    ],
)
def test_real_agent_session_past_4000_tokens(name, template, end, exact, tmp_path):
    """The same on the real catalog models, the session growing past 4 000 tokens (past
    Gemma 3 270M's 512-position window many times over); logits against a cold run on the
    second turn and the last (a cold prefill of 4 000 tokens takes a minute on 2 cores),
    within 1e-4 (float32 through 30 and 18 layers, logits of tens: measured 2.9e-5)."""
    model = with_template(need_pulled(name), tmp_path, template)
    rows = session(model, exact, end, scale=34, cold_turns=frozenset({1, 9}))
    assert rows[-1][0] > 4000
    check_session(rows, bound=1e-4)


# ---------------------------------------------------------------- the caches' snapshots


def rand(*shape: int) -> mx.array:
    return mx.random.normal(shape)


def ordered(ring: RotatingKVCache) -> tuple[np.ndarray, np.ndarray]:
    k, v = ring._ordered()
    return np.array(k), np.array(v)


def test_ring_snapshot_is_its_own_copy_and_restores_more_than_once():
    """A wrapped ring's snapshot (taken mid-ring, where single-token writes go in place)
    keeps the window as it was; trimming back to it restores it exactly, and again after the
    restored ring was written in place; a position past the window with no snapshot is
    refused, the ring untouched; writing on after a restore equals a ring that never went
    further."""
    mx.random.seed(0)
    feed = [rand(1, 2, 13, 4)] + [rand(1, 2, 1, 4) for _ in range(3)]  # wrapped at 16
    ring = RotatingKVCache(8)
    for x in feed:
        ring.update_and_fetch(x, 2 * x)
    ring.snapshot()
    kept = ordered(ring)
    assert ring.rewind_point(16) == 16 and ring.rewind_point(14) == 0
    for x in [rand(1, 2, 1, 4) for _ in range(5)] + [rand(1, 2, 6, 4)]:
        ring.update_and_fetch(x, 2 * x)
    assert ring.rewind_point(26) == 26 and ring.rewind_point(25) == 16
    assert ring.trim(10) == 0 and ring.offset == 27  # no snapshot at 17: untouched
    later = [rand(1, 2, 1, 4) for _ in range(4)]
    for _ in range(2):  # the second time after writes into the restored buffers
        n = ring.offset - 16
        assert ring.trim(n) == n and ring.offset == 16
        assert all(np.array_equal(a, b) for a, b in zip(ordered(ring), kept, strict=True))
        twin = RotatingKVCache(8)
        for x in feed + later:
            twin.update_and_fetch(x, 2 * x)
        for x in later:
            ring.update_and_fetch(x, 2 * x)
        assert all(np.array_equal(a, b) for a, b in zip(ordered(ring), ordered(twin), strict=True))


def test_ring_lent_to_a_batch_restores_its_snapshot():
    """A ring decoding in a KVBatch (its buffers lent) takes them back before a restore."""
    mx.random.seed(1)
    rings = [RotatingKVCache(8), RotatingKVCache(8)]
    for r in rings:
        r.update_and_fetch(rand(1, 2, 11, 4), rand(1, 2, 11, 4))
        r.snapshot()
    kept = [ordered(r) for r in rings]
    for _ in range(3):
        KVBatch.step_of(rings, rand(2, 2, 1, 4), rand(2, 2, 1, 4))
    assert rings[0]._batch is not None
    assert rings[0].trim(3) == 3 and rings[0]._batch is None
    for a, b in zip(ordered(rings[0]), kept[0], strict=True):
        assert np.array_equal(a, b)
    assert rings[1].offset == 14 and rings[1].trim(3) == 3
    for a, b in zip(ordered(rings[1]), kept[1], strict=True):
        assert np.array_equal(a, b)


def test_snapshot_bytes_count_in_the_prefix_cache():
    """The prefix cache's bound counts every snapshot: a ring's copy of its window, a
    recurrent layer's older states."""
    ring = RotatingKVCache(8)
    ring.update_and_fetch(rand(1, 2, 12, 4), rand(1, 2, 12, 4))
    live = sum(a.nbytes for a in ring.state)
    ring.snapshot()
    assert sum(a.nbytes for a in ring.state) == 2 * live
    rec = RecurrentCache()
    rec.conv_state, rec.recurrent, rec.offset = rand(1, 3, 8), rand(1, 2, 4, 4), 5
    rec.snapshot()
    one = sum(a.nbytes for a in rec.state) - rec.conv_state.nbytes  # the state, shared once
    rec.conv_state, rec.recurrent, rec.offset = rand(1, 3, 8), rand(1, 2, 4, 4), 6
    assert sum(a.nbytes for a in rec.state) == 2 * one  # the live state and the snapshot's
    prefix = PrefixCache(1 << 20)
    prefix.put(list(range(12)), [ring])
    assert prefix.bytes == 2 * live


# ---------------------------------------------------------------- asking for the snapshots


CHUNK, MARK, PROMPT, LAST = StepKind.CHUNK, StepKind.MARK, StepKind.PROMPT, StepKind.LAST


class Recording(LocalSteps):
    def __init__(self, model, prefix):
        super().__init__(model, prefix)
        self.log: list[tuple[int, StepKind]] = []

    def run(self, rids, caches, tokens, kind, inserts=None, *, hidden=False, lanes=None):
        if kind != StepKind.DECODE:
            self.log.append((tokens.size, kind))
        return super().run(rids, caches, tokens, kind, inserts, hidden=hidden, lanes=lanes)


@pytest.mark.parametrize(
    "name, marks, chunks",
    [
        ("gemma3", (), [(8, CHUNK), (8, CHUNK), (8, CHUNK), (6, PROMPT)]),
        ("gemma3", (5, 20), [(5, MARK), (8, CHUNK), (7, MARK), (8, CHUNK), (2, LAST)]),
        ("gemma3", (16, 30), [(8, CHUNK), (8, MARK), (8, CHUNK), (6, PROMPT)]),
        ("llama", (5, 20), [(8, CHUNK), (8, CHUNK), (8, CHUNK), (6, PROMPT)]),
    ],
)
def test_prefill_chunks_end_at_the_snapshot_positions(models, name, marks, chunks):
    """The core's chunks end at each requested position (MARK: the caches snapshot there);
    the prompt's end is snapshotted only when no position was asked for, or it was. A model
    of full attention alone needs no snapshot: its chunks are not cut (a cut costs one more
    forward: on the bench's hybrid, 0.2 s of a reused turn's 1.9 s to the first token)."""
    model = models[name]
    steps = Recording(model, PrefixCache(0))
    core = Core(model, steps, chunk=8)
    req = Request(list(range(3, 33)), SamplingParams(max_tokens=1), snapshot_at=marks)
    list(run(core, core.start(req)))
    assert steps.log == chunks


def test_prepare_chat_and_chat_session_ask_for_the_snapshot(models):
    """The server's chat requests and ChatSession's turns ask for a snapshot where the
    prompt ends before its generation prompt; the next turn of a chat on the hybrid model
    comes back exactly there (its reply re-rendered without its reasoning)."""
    from mlxlis.serve.prepare import Target, prepare_chat
    from mlxlis.serve.schemas import ChatCompletionRequest

    model = models["qwen3_5"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    target = Target(model, SamplingParams(), 4096, frozenset({2}))
    prepared = prepare_chat(target, ChatCompletionRequest(model="m", messages=messages))
    point = snapshot_point(model, messages, prepared.gen.prompt)
    assert prepared.gen.snapshot_at == (point,) and 0 < point < len(prepared.gen.prompt)

    chat = mlxlis.ChatSession(model, system="Be brief.")
    first = model.tokenizer.encode(chat.prompt_preview("Hi!"), special=True)
    point = snapshot_point(model, messages, first)
    list(chat.send("Hi!", max_tokens=6))
    list(chat.send("And then?", max_tokens=6))
    assert chat.last_reused_tokens == point > 0
