"""`mlxlis serve` with several models: three catalog models under a memory budget that holds
two, driven by the official openai, anthropic and ollama clients.

What is proved against independent references: the sizes listed are the files' (os.stat),
the families the catalog's records; an unloaded model's memory returns (MLX's active memory and the
process's RSS, read from /proc). The rest is the server against itself: a model's greedy
tokens with other models loaded, evicted and streaming at once equal its tokens when it runs
alone (nothing else in flight), and a busy model is never the one unloaded.

The budget (MLXLIS_MAX_MEMORY=950M, less the 256 MiB margin: 694 MiB) holds SmolLM2 (93 MiB)
with either Gemma 3 (249 MiB) or Qwen2.5-Coder (495 MiB), each with a 16 MiB prefix cache,
but not all three, nor Gemma 3 with Qwen2.5-Coder. The tests run in order on one server; each
says the state it starts from.
"""

from __future__ import annotations

import threading

import anthropic
import ollama
import openai
import pytest
from conftest import need_pulled
from serve_process import ServeProcess, events

pytestmark = pytest.mark.real

SMOL, GEMMA, QWEN = "smollm2-135m", "gemma3-270m", "qwen"
MODELS = {SMOL: "smollm2-135m", GEMMA: "gemma3-270m", QWEN: "qwen2.5-coder-0.5b"}
PROMPT = "The quick brown"
N = 12  # greedy tokens per reference reply
HUGE = 4 << 30  # a sparse file listed by --models-dir: never read


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    for name in MODELS.values():
        need_pulled(name)
    tmp = tmp_path_factory.mktemp("models")
    big = tmp / "big"
    big.mkdir()
    with open(big / "huge.gguf", "wb") as f:  # garbage: a read would fail loudly
        f.truncate(HUGE)
    server = ServeProcess(
        tmp,
        "-m",
        SMOL,
        "-m",
        GEMMA,
        "-m",
        f"{QWEN}={MODELS[QWEN]}",
        "--models-dir",
        str(big),
        "--alias",
        f"claude-haiku-4-5={SMOL}",
        "--alias",
        f"claude-sonnet-4-5={QWEN}",
        "--prefix-cache-mb",
        "16",
        env={"MLXLIS_MAX_MEMORY": "950M"},
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def oai(srv):
    return srv.client()


@pytest.fixture(scope="module")
def olm(srv):
    return ollama.Client(host=f"http://127.0.0.1:{srv.port}")


def complete(client: openai.OpenAI, model: str, n: int = N, **kw) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, **kw)
    return r.choices[0].text


def loaded(olm: ollama.Client) -> set[str]:
    return {m.model.removesuffix(":latest") for m in olm.ps().models}


def rss_mib(srv: ServeProcess) -> float:
    with open(f"/proc/{srv.proc.pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def active_mib(srv: ServeProcess) -> float:
    return srv.request("GET", "/health")[1]["memory_bytes"] / 2**20


LONE: dict[str, str] = {}  # each model's greedy reply with nothing else in flight
START: dict[str, float] = {}  # MLX's active memory with only the first -m loaded


def test_every_model_is_listed_with_what_its_files_say(srv, oai, olm):
    """/v1/models and /api/tags list the three models and the --models-dir file, sizes as the
    files have them (os.stat) and families as the catalog records them; only the first -m is
    loaded (/api/ps)."""
    from mlxlis.loading import catalog

    cards = {m.id: m.model_extra for m in oai.models.list().data}
    assert list(cards) == [SMOL, GEMMA, QWEN, "huge"]
    for name, ref in MODELS.items():
        assert cards[name]["size"] == catalog.model_path(ref).stat().st_size
        assert cards[name]["family"] == catalog.CATALOG[ref].family  # the catalog's record
        assert cards[name]["loaded"] == (name == SMOL)
    assert cards["huge"]["size"] == HUGE
    srv.wait_idle()
    START["active"] = active_mib(srv)  # SmolLM2's weights, nothing run yet
    tags = {m.model: m.size for m in olm.list().models}
    assert tags == {f"{n}:latest": cards[n]["size"] for n in [*MODELS, "huge"]}
    assert loaded(olm) == {SMOL}
    assert [m.id for m in oai.models.list(extra_query={"loaded": "true"}).data] == [SMOL]


def test_a_model_loads_when_named_and_the_least_recently_used_idle_one_makes_room(srv, oai, olm):
    """From SmolLM2 alone: a request to Gemma 3 loads it beside SmolLM2; SmolLM2 is then used,
    so Gemma 3 is the least recently used. While a SmolLM2 stream is in flight a request to
    Qwen2.5-Coder needs room: Gemma 3 (idle) is unloaded, SmolLM2 (busy, and enough) is kept,
    and the stream's tokens are those SmolLM2 gives alone."""
    LONE[GEMMA] = complete(oai, GEMMA)
    assert loaded(olm) == {SMOL, GEMMA}
    kept = srv.request("GET", "/health")[1]["loaded"]
    assert kept[SMOL]["expires_in_s"] is None  # the first -m: kept without --keep-alive
    assert 250 < kept[GEMMA]["expires_in_s"] <= 300  # loaded on demand: 5 minutes
    LONE[SMOL] = complete(oai, SMOL)
    long_alone = complete(oai, SMOL, n=48)
    conn, resp = srv.open_stream(
        "/v1/completions",
        {"model": SMOL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True},
    )
    stream = events(resp)
    text = next(stream)["choices"][0]["text"]  # in flight now
    r = olm.generate(model=QWEN, prompt=PROMPT, raw=True, options={"num_predict": N})
    for ev in stream:
        if ev == "[DONE]":
            break
        text += ev["choices"][0]["text"]
    conn.close()
    assert text == long_alone
    assert loaded(olm) == {SMOL, QWEN}
    assert "unloaded gemma3-270m" in srv.log() and "unloaded smollm2-135m" not in srv.log()
    LONE[QWEN] = complete(oai, QWEN)
    assert r.response == LONE[QWEN]  # loaded while SmolLM2 streamed, the same tokens


def test_a_busy_model_is_never_unloaded_to_make_room(srv, oai, olm):
    """From SmolLM2 and Qwen2.5-Coder loaded: with a stream in flight on each, a request to
    Gemma 3 (which needs one of them gone) is refused with a 503 naming the busy models, in
    each API's shape, and nothing is unloaded; Ollama's keep_alive 0 on one of them unloads it
    only once its stream has ended; then Gemma 3 loads."""
    open_streams = []
    for name in (SMOL, QWEN):
        body = {"model": name, "prompt": PROMPT, "max_tokens": 400, "stream": True}
        conn, resp = srv.open_stream("/v1/completions", body)
        next(events(resp))
        open_streams.append(conn)
    with pytest.raises(openai.APIStatusError) as e:
        complete(oai, GEMMA)
    assert e.value.status_code == 503 and e.value.body["code"] == "memory_full"
    assert "retry when they finish" in e.value.body["message"]
    assert e.value.response.headers["retry-after"]
    with pytest.raises(anthropic.APIStatusError) as a:
        srv.anthropic_client().messages.create(
            model=GEMMA, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert a.value.status_code == 503 and a.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(ollama.ResponseError) as o:
        olm.generate(model=GEMMA, prompt="Hi")
    assert o.value.status_code == 503
    assert loaded(olm) == {SMOL, QWEN}
    # keep_alive 0 on a busy model: unloaded once its requests end, not under them
    lines = len(srv.log().splitlines())
    assert olm.generate(model=QWEN, keep_alive=0).done_reason == "unload"
    assert loaded(olm) == {SMOL, QWEN}
    for conn in open_streams:
        conn.close()  # the clients leave: their requests are cancelled
    srv.log_line(f"unloaded {QWEN}", skip=lines)
    srv.wait_idle()
    assert complete(oai, GEMMA) == LONE[GEMMA]


def test_one_models_requests_count_against_the_others_room(srv, oai, olm):
    """From any loaded: with SmolLM2 and Gemma 3 loaded, 320 MiB are left for requests'
    caches. A SmolLM2 stream reserving about 264 MiB (6 000 tokens) and a Gemma 3 request of
    about 117 MiB (20 000 tokens) each fit alone but not together: the second is a 503 that
    names the other model's requests, and fits once the stream has ended."""
    assert complete(oai, SMOL) == LONE[SMOL]
    assert loaded(olm) == {SMOL, GEMMA}
    body = {"model": SMOL, "prompt": PROMPT, "max_tokens": 6000, "stream": True}
    conn, resp = srv.open_stream("/v1/completions", body)
    next(events(resp))
    with pytest.raises(openai.APIStatusError) as e:
        complete(oai, GEMMA, n=20000)
    assert e.value.status_code == 503 and "other models' requests" in e.value.body["message"]
    conn.close()
    srv.wait_idle()
    assert complete(oai, GEMMA, n=20000, stop=["\n\n"])  # alone it fits


def test_keep_alive_unloads_and_the_memory_returns(srv, oai, olm):
    """From any two loaded: keep_alive 0 on Ollama's empty generate unloads at once
    (done_reason "unload"), down to SmolLM2 alone; a request's keep_alive of 1s unloads
    Gemma 3 a second after its reply. MLX's active
    memory and the process RSS come back to their level before Gemma 3 was loaded."""
    for name in loaded(olm) - {SMOL}:
        r = olm.generate(model=name, keep_alive=0)
        assert r.done_reason == "unload"
    assert complete(oai, SMOL) == LONE[SMOL]  # loaded again if it was the one made room
    assert loaded(olm) == {SMOL}
    active, rss = active_mib(srv), rss_mib(srv)
    # SmolLM2 alone again: what it held at start and its prefix cache's entries since, and no
    # other model's weights (the smaller, Gemma 3's, are 249 MiB) kept by the unloads above
    prefix = srv.wait_idle()["prefix_cache_bytes"] / 2**20
    assert active < START["active"] + prefix + 64, (active, START, prefix)
    lines = len(srv.log().splitlines())
    r = oai.completions.create(
        model=GEMMA, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"keep_alive": "1s"}
    )
    assert r.model == GEMMA and r.choices[0].text == LONE[GEMMA]
    weights = srv.request("GET", "/health")[1]["loaded"][GEMMA]["weights_bytes"] / 2**20
    assert active_mib(srv) >= active + weights
    srv.log_line(f"unloaded {GEMMA}", skip=lines)  # its engine stopped, its memory freed
    assert GEMMA not in loaded(olm)
    assert abs(active_mib(srv) - active) < 1.0, (active, active_mib(srv))
    assert rss_mib(srv) < rss + 32, (rss, rss_mib(srv))


def test_unknown_and_too_large_models_are_refused_in_each_apis_shape(srv, oai, olm):
    """A keep_alive that is no duration is a 400 naming it; a name the server does not serve
    is a 404 in each API's shape; a model whose files alone outgrow the budget is a 400
    giving both sizes, before its file is read."""
    claude = srv.anthropic_client()
    with pytest.raises(openai.BadRequestError) as e:  # a keep_alive that is no duration
        complete(oai, SMOL, extra_body={"keep_alive": "soon"})
    assert e.value.body["param"] == "keep_alive"
    assert e.value.body["message"].startswith("keep_alive: expected a duration")
    with pytest.raises(openai.NotFoundError) as e:
        complete(oai, "nope")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as a:
        claude.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert a.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(ollama.ResponseError) as o:
        olm.chat(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert o.value.status_code == 404 and o.value.error == "model 'nope' not found"
    with pytest.raises(openai.BadRequestError) as e:
        complete(oai, "huge")
    message = e.value.body["message"]
    assert e.value.body["code"] == "model_too_large"
    assert f"needs {(HUGE + (16 << 20)) // 2**20} MiB" in message and "budget of 694 MiB" in message
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model="huge", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    with pytest.raises(ollama.ResponseError) as o:
        olm.generate(model="huge", prompt="Hi")
    assert o.value.status_code == 400
    assert "huge" not in loaded(olm) and "GGUF" not in srv.log()  # never opened


def test_eight_clients_over_two_models_at_once(srv, oai, olm):
    """Eight clients at once, four on SmolLM2 and four on Gemma 3 (loaded by the first of
    them): each reply is its model's lone reply, nothing is lost, and MLX's memory stays
    within the budget."""
    replies: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            replies[i] = complete(srv.client(), (SMOL, GEMMA)[i % 2])
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert replies == {i: LONE[(SMOL, GEMMA)[i % 2]] for i in range(8)}
    health = srv.wait_idle()
    assert health["memory_bytes"] <= health["memory_budget_bytes"]


def test_claude_code_main_and_small_fast_models_by_alias(srv):
    """Claude Code's two models in one session, named by alias: each message goes to the
    model its alias names (its reply is that model's reply to the same messages by its own
    name), the main model loaded on demand beside the small one."""
    claude = srv.anthropic_client()
    ask = [{"role": "user", "content": "Name a color."}]

    def reply(model: str) -> str:
        r = claude.messages.create(model=model, max_tokens=8, messages=ask)
        return "".join(b.text for b in r.content if b.type == "text")

    main, fast = reply("claude-sonnet-4-5"), reply("claude-haiku-4-5")
    assert main == reply(QWEN) and fast == reply(SMOL) and main != fast
    assert reply("claude-sonnet-4-5") == main
