"""The samplers through the server's APIs, on the real `mlxlis serve` process every API's
tests share (the tiny random Llama): OpenAI's presence_penalty, frequency_penalty and
logit_bias change the greedy reply exactly as a numpy reference of OpenAI's definition,
applied to the model's own logits in this process, says (and the change is real: the reply
without them differs); Ollama's options through the ollama client give what the same fields
give on the OpenAI endpoint; every refusal names its field in its API's shape."""

from __future__ import annotations

import mlxlis

import numpy as np
import ollama
import pytest

MODEL = "llama_long"
PROMPT = [5, 17, 33, 9, 17, 5, 60]  # token ids: a raw completion prompt, no template
STEPS = 10


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def reference_model(tiny):
    return mlxlis.load(tiny("llama_long")[0])


def reference_greedy(model, presence=0.0, frequency=0.0, bias=None, dry=None) -> str:
    """Greedy decoding of PROMPT under OpenAI's definition, in numpy: logit[j] −=
    c[j]·frequency + (c[j] > 0)·presence over the generated tokens, plus logit_bias, ids past
    the tokenizer masked (the head is wider than the vocabulary); `dry` (multiplier, base,
    allowed): DRY's definition by brute force over the whole history, no breakers."""
    vocab = model.tokenizer.vocab_size
    out: list[int] = []
    for _ in range(STEPS):
        logits = np.array(model.logits(PROMPT + out)[-1], np.float64)
        logits[vocab:] = -np.inf
        for j, b in (bias or {}).items():
            logits[int(j)] += b
        for j in set(out):
            logits[j] -= out.count(j) * frequency + presence
        if dry is not None:
            mult, base, allowed = dry
            h = PROMPT + out
            longest: dict[int, int] = {}
            for i in range(len(h) - 1):
                n = 0
                while n <= i and h[i - n] == h[-1 - n]:
                    n += 1
                if n >= allowed:
                    longest[h[i + 1]] = max(longest.get(h[i + 1], 0), n)
            for j, n in longest.items():
                logits[j] -= mult * base ** (n - allowed)
        out.append(int(np.argmax(logits)))
    return model.tokenizer.decode(out)


def served(server, extra: dict | None = None, **kw) -> str:
    r = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=STEPS,
        temperature=0,
        extra_body={"ignore_eos": True, **(extra or {})},
        **kw,
    )
    return r.choices[0].text


@pytest.mark.parametrize(
    "kw",
    [
        dict(frequency_penalty=2.0),
        dict(presence_penalty=2.0),
        dict(presence_penalty=-1.0, frequency_penalty=0.5),
        "ban the first token",
    ],
)
def test_penalties_and_bias_change_the_reply_as_the_reference(server, reference_model, kw):
    """The served greedy completion equals the numpy reference's, and differs from the reply
    without the field (so the field was used, not ignored)."""
    plain = reference_greedy(reference_model)
    assert served(server) == plain
    if kw == "ban the first token":
        first = reference_model.tokenizer.encode(plain, add_bos=False)[0]
        kw = dict(logit_bias={str(first): -100})
    ref = reference_greedy(
        reference_model,
        kw.get("presence_penalty", 0.0),
        kw.get("frequency_penalty", 0.0),
        kw.get("logit_bias"),
    )
    assert ref != plain
    assert served(server, **kw) == ref


def test_llama_cpp_names_in_the_body(server, reference_model):
    """llama-server's DRY fields in the body change the greedy reply exactly as DRY's
    definition (numpy, brute force) says, and differ from the plain reply; its other names
    set to their "off" values (typical_p 1, top_n_sigma -1, xtc_probability 0) change
    nothing."""
    plain = reference_greedy(reference_model)
    dry = dict(
        dry_multiplier=3.0,
        dry_base=1.5,
        dry_allowed_length=1,
        dry_penalty_last_n=-1,
        dry_sequence_breakers=[],
    )
    ref = reference_greedy(reference_model, dry=(3.0, 1.5, 1))
    assert ref != plain
    assert served(server, dry) == ref
    off = dict(typical_p=1.0, top_n_sigma=-1, xtc_probability=0.0, repeat_penalty=1.0)
    assert served(server, off) == plain


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"mirostat": 1}, "mirostat"),
        ({"xtc_threshold": 0.9}, "xtc_threshold"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"dry_base": 0.5}, "dry_base"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_refusals_name_the_field(server, path, extra, param):
    """Out of range, an id past the vocabulary, mirostat 1 (not implemented): a 400 in
    OpenAI's error shape naming the field as the body spells it."""
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    status, got = server.request("POST", path, body)
    assert status == 400, got
    assert got["error"]["param"] == param, got
    assert got["error"]["message"].startswith(f"{param}:"), got


def test_ollama_options_as_the_openai_fields(server):
    """Ollama's repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
    typical_p, top_k, top_p, min_p, seed, mirostat 2 (τ, η), stop and num_predict, sent by the
    ollama client to /api/chat, give the reply the OpenAI endpoint gives for the same values
    (the tiny model's noise is sampled noise here: seeded, so the two runs match)."""
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)
    messages = [{"role": "user", "content": "Hello, world!"}]
    options = {
        "temperature": 0.8,
        "seed": 7,
        "num_predict": 12,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.01,
        "typical_p": 0.95,
        "repeat_penalty": 1.3,
        "repeat_last_n": 16,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "mirostat": 2,
        "mirostat_tau": 4.0,
        "mirostat_eta": 0.2,
        "stop": ["zzzz"],
    }
    got = client.chat(model=MODEL, messages=messages, options=options)
    ref = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0.8,
        seed=7,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        stop=["zzzz"],
        extra_body={
            "top_k": 40,
            "min_p": 0.01,
            "typical_p": 0.95,
            "repeat_penalty": 1.3,
            "repeat_last_n": 16,
            "mirostat": 2,
            "mirostat_tau": 4.0,
            "mirostat_eta": 0.2,
        },
    )
    assert got.message.content == ref.choices[0].message.content
    plain = client.chat(
        model=MODEL, messages=messages, options={"temperature": 0.8, "seed": 7, "num_predict": 12}
    )
    assert plain.message.content != got.message.content


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/api/chat", {"options": {"mirostat": 1}}, "options.mirostat"),
        ("/api/chat", {"options": {"presence_penalty": 9}}, "options.presence_penalty"),
        ("/api/chat", {"options": {"typical_p": 0}}, "options.typical_p"),
        ("/api/chat", {"options": {"tfs_z": 0.9}}, "options.tfs_z"),
        ("/api/chat", {"options": {"penalize_newline": False}}, "options.penalize_newline"),
        ("/api/chat", {"options": {"repeat_last_n": -2}}, "options.repeat_last_n"),
        ("/api/generate", {"width": 512}, "width"),
        ("/api/generate", {"steps": 4}, "steps"),
    ],
)
def test_ollama_refusals_name_the_option(server, path, body, param):
    """An option that cannot be honoured: a 400 whose only field is `error`, starting with
    the option's name as Ollama calls it."""
    base = {"model": MODEL, "stream": False}
    base |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    status, got = server.request("POST", path, {**base, **body})
    assert status == 400 and set(got) == {"error"}, got
    assert got["error"].startswith(f"{param}:"), got


def test_ollama_num_ctx_bounds_the_request(server):
    """options.num_ctx is this request's context: with room for 3 tokens after the prompt,
    num_predict 10 gives 3 (the reply the unbounded request starts with); a num_ctx the
    prompt does not fit in is a 400; one past --max-context is bounded by it (no change)."""
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)
    messages = [{"role": "user", "content": "Hello, world!"}]
    greedy = {"temperature": 0, "num_predict": 10}
    whole = client.chat(model=MODEL, messages=messages, options=greedy)
    n = whole.prompt_eval_count
    cut = client.chat(model=MODEL, messages=messages, options={**greedy, "num_ctx": n + 3})
    assert cut.eval_count == 3 and whole.eval_count == 10
    assert whole.message.content.startswith(cut.message.content)
    big = client.chat(model=MODEL, messages=messages, options={**greedy, "num_ctx": 10**6})
    assert big.message.content == whole.message.content
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=messages, options={**greedy, "num_ctx": n - 1})
    assert e.value.status_code == 400


def test_a_speculating_server_refuses_xtc_and_mirostat_by_name():
    """With the server's speculative decoding, a request's XTC or mirostat is a 400 naming
    it (their draws have no fixed distribution for the ratio test); without it, they pass."""
    from mlxlis.generation.sampling import SamplingParams
    from mlxlis.generation.speculative import Speculation
    from mlxlis.serve.openai_format import APIError
    from mlxlis.serve.prepare import Target, speculable

    t = Target(None, SamplingParams(), 64, frozenset(), speculation=Speculation("ngram"))
    for name, value in (("xtc_probability", 0.5), ("mirostat", 2)):
        params = SamplingParams(temperature=1.0, **{name: value})
        with pytest.raises(APIError) as e:
            speculable(t, params)
        assert e.value.param == name
        assert speculable(Target(None, SamplingParams(), 64, frozenset()), params) is params
