"""OpenAI's `n` through the real `mlxlis serve` process and the official openai client: the
samples of one prompt (the prompt read once, its caches forked, the samples decoded as rows
of one batch; generation/samples.py) against lone runs of the same server.

What is proved: n = 4 greedy gives four choices (index 0..3) each equal to the n = 1 reply,
its tokens and logprobs included; n = 4 sampled with seed s gives choice i equal to a lone run
with seed s + i (the stated per-sample seed; the lone runs differ from each other, so a shared
seed stream or a leaking cache shows); a streamed n = 2 reassembled per index equals the whole
n = 2 response, each index with its own finish_reason, the usage chunk combined; the prompt is
read once (measured: the server's prefill counter in /metrics grows by the prompt's length, as
for n = 1, not n times it) and counted once in `usage`; n past the server's batch (or 0) is a
400 naming `n` in OpenAI's error shape; a hybrid model (the tiny Qwen3.5: Gated DeltaNet
recurrent and convolution states beside KV caches) gives n = 2 samples equal to lone runs.
"""

from __future__ import annotations

import re

import openai
import pytest
from conftest import tiny_models
from serve_process import ServeProcess, events
from test_qwen3_5 import SPECS as QWEN35_SPECS

MODEL = "llama_long"
PROMPT = [7, 21, 40, 3, 21, 7, 55, 12]  # token ids: a raw completion prompt
STEPS = 8
SEED = 1234
REL = 1e-5  # float32: a batched row vs a lone one, last bits


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def complete(server, prompt=PROMPT, model=MODEL, **kw):
    return server.client().completions.create(
        model=model,
        prompt=prompt,
        max_tokens=STEPS,
        extra_body={"ignore_eos": True, "top_k": 0},
        **kw,
    )


def prefilled(server, model: str = MODEL) -> float:
    """The server's count of prompt tokens its model read (/metrics)."""
    conn = server.connect()
    try:
        conn.request("GET", "/metrics", headers=server.headers())
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    m = re.search(rf'^mlxlis_prefill_tokens_total\{{model="{model}"\}} (\S+)$', text, re.M)
    assert m, text
    return float(m.group(1))


def test_greedy_n4_equals_n1(server):
    """Greedy: four identical choices equal to n = 1's reply, text, tokens and logprobs (to
    float32's last bits), each with its index and finish_reason; usage counts the prompt once
    and the four samples' tokens."""
    one = complete(server, temperature=0, logprobs=2)
    four = complete(server, temperature=0, logprobs=2, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    ref = one.choices[0]
    for c in four.choices:
        assert c.text == ref.text and c.finish_reason == "length"
        assert c.logprobs.tokens == ref.logprobs.tokens
        assert c.logprobs.token_logprobs == pytest.approx(ref.logprobs.token_logprobs, rel=REL)
    assert four.usage.prompt_tokens == len(PROMPT) == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * STEPS
    assert four.usage.total_tokens == len(PROMPT) + 4 * STEPS


def test_seeded_samples_equal_lone_runs_with_seed_plus_index(server):
    """Sampled with seed s: choice i is the lone run with seed s + i, through the chat API too
    (each choice's message and logprobs its own)."""
    kw = dict(temperature=1.0)
    four = complete(server, n=4, seed=SEED, **kw)
    lone = [complete(server, seed=SEED + i, **kw).choices[0].text for i in range(4)]
    assert len(set(lone)) > 1  # the seeds give different replies: the check below has teeth
    assert [c.text for c in four.choices] == lone
    msgs = [{"role": "user", "content": "Tell me something"}]
    chat = server.client().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=STEPS, n=2, seed=SEED, logprobs=True, **kw
    )
    for i, c in enumerate(chat.choices):
        alone = server.client().chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=STEPS, seed=SEED + i, logprobs=True, **kw
        )
        a = alone.choices[0]
        assert c.index == i and c.message.content == a.message.content
        assert c.finish_reason == a.finish_reason
        assert [t.token for t in c.logprobs.content] == [t.token for t in a.logprobs.content]


def test_streamed_n2_reassembled_per_index_equals_the_whole(server):
    """A streamed n = 2 chat, its chunks put together by choice index, equals the whole
    response of the same request; each index ends with its own finish_reason and the usage
    chunk counts the prompt once."""
    body = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=STEPS,
        n=2,
        seed=SEED,
        temperature=1.0,
    )
    whole = server.client().chat.completions.create(**body)
    conn, resp = server.open_stream(
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    text, finish, usage = ["", ""], [None, None], None
    try:
        for ev in events(resp):
            if ev == "[DONE]":
                break
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev["choices"]:
                text[ch["index"]] += ch["delta"].get("content") or ""
                finish[ch["index"]] = ch["finish_reason"] or finish[ch["index"]]
    finally:
        conn.close()
    assert text == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage["prompt_tokens"] == whole.usage.prompt_tokens
    assert usage["completion_tokens"] == whole.usage.completion_tokens


def test_prompt_is_read_once(server):
    """n = 4 of a prompt no cache holds: the model reads its tokens once (the server's prefill
    counter grows by its length, as for n = 1 of another such prompt), and usage counts it
    once, none of it cached."""
    fresh = [91, *PROMPT, 5, 6]  # its first id is no other test's: no cached prefix
    before = prefilled(server)
    one = complete(server, prompt=[92, *fresh[1:]], temperature=0)
    middle = prefilled(server)
    four = complete(server, prompt=fresh, temperature=0, n=4)
    after = prefilled(server)
    assert middle - before == len(fresh) == one.usage.prompt_tokens
    assert after - middle == len(fresh)
    assert four.usage.prompt_tokens == len(fresh)
    assert four.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("n", [5, 0])
def test_n_beyond_the_batch_is_refused_by_name(server, n):
    """n past the server's batch (--max-batch 4), or 0: a 400 naming `n` in OpenAI's error
    shape, on both endpoints."""
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, n=n)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    assert "4" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=n
        )
    assert e.value.body["param"] == "n"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder, _ = tiny_models(tmp_path_factory, QWEN35_SPECS)("qwen3_5")
    srv = ServeProcess(folder, "-m", str(folder), "--max-batch", "2", "--max-context", "512")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_hybrid_model_samples_equal_lone_runs(hybrid):
    """The tiny Qwen3.5 (DeltaNet recurrent + convolution states, KV caches): n = 2 greedy
    equals n = 1 twice; n = 2 with seed s equals the lone runs with seeds s and s + 1, with
    dense KV caches and with 8-bit ones."""
    name = hybrid.model
    prompt = [11, 4, 29, 8, 11, 4, 60, 2, 19]
    greedy = complete(hybrid, prompt=prompt, model=name, temperature=0).choices[0].text
    two = complete(hybrid, prompt=prompt, model=name, temperature=0, n=2)
    assert [c.text for c in two.choices] == [greedy, greedy]
    kw = dict(temperature=1.0)
    two = complete(hybrid, prompt=prompt, model=name, n=2, seed=SEED, **kw)
    lone = [complete(hybrid, prompt=prompt, model=name, seed=SEED + i, **kw) for i in range(2)]
    texts = [r.choices[0].text for r in lone]
    assert texts[0] != texts[1]
    assert [c.text for c in two.choices] == texts
    # the KV layers quantized (8 bits, groups of 32: the head's width), a tail kept dense
    q = {"ignore_eos": True, "kv_bits": 8, "kv_group_size": 32}
    kw = dict(prompt=prompt, model=name, temperature=1.0, extra_body=q)
    two = hybrid.client().completions.create(max_tokens=STEPS, n=2, seed=SEED, **kw)
    lone = [
        hybrid.client().completions.create(max_tokens=STEPS, seed=SEED + i, **kw) for i in range(2)
    ]
    assert [c.text for c in two.choices] == [r.choices[0].text for r in lone]


def test_structured_output_follows_each_choice(server):
    """n = 3 under a JSON schema, sampled with seed s: choice i equals the lone run with seed
    s + i under the same schema (each sample's grammar mask follows its own tokens)."""
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "pick",
            "schema": {
                "type": "object",
                "properties": {"word": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["word", "n"],
            },
        },
    }
    msgs = [{"role": "user", "content": "Pick"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=1.0, response_format=fmt)
    three = server.client().chat.completions.create(n=3, seed=SEED, **kw)
    lone = [
        server.client().chat.completions.create(seed=SEED + i, **kw).choices[0].message.content
        for i in range(3)
    ]
    assert len(set(lone)) > 1 and all(t.startswith("{") for t in lone), lone
    assert [c.message.content for c in three.choices] == lone


def test_best_of_returns_the_samples_of_highest_logprob_per_token(server):
    """best_of = 3, n = 2, seed s: the two choices are, best first, the lone runs (seeds s,
    s + 1, s + 2) of highest mean token logprob; usage counts all three samples' tokens; no
    logprobs in the reply when none were asked."""
    got = complete(server, n=2, best_of=3, seed=SEED, temperature=1.0)
    lone = [complete(server, seed=SEED + i, temperature=1.0, logprobs=0) for i in range(3)]
    mean = [sum(r.choices[0].logprobs.token_logprobs) / STEPS for r in lone]
    assert len(set(mean)) == 3
    order = sorted(range(3), key=lambda i: -mean[i])
    assert [c.text for c in got.choices] == [lone[k].choices[0].text for k in order[:2]]
    assert [c.index for c in got.choices] == [0, 1]
    assert all(c.logprobs is None for c in got.choices)
    assert got.usage.completion_tokens == 3 * STEPS
    assert got.usage.prompt_tokens == len(PROMPT)
