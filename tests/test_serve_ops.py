"""What an operator watches on `mlxlis serve`: /metrics, CORS and request ids, on a real server
process (the tiny random Llama) driven by the official `openai` and `ollama` clients.

The server is the one every API's tests share (`tiny_server`, serving TINY_ORIGINS).
/metrics is read with prometheus_client's own parser (`text_string_to_metric_families`), so
what it proves is what Prometheus reads: the requests counted by API, model and status equal
the requests sent and the statuses the clients got; the prompt, cached and generated token
totals equal the sums of the usage fields the clients got back (OpenAI's `usage`, Ollama's
`prompt_eval_count` / `eval_count`); each histogram counts one observation per request that
generated (two tokens for the per-token one). Each figure is a difference between two
scrapes taken once the server is idle, so the other tests' requests do not count.
"""

from __future__ import annotations

import http.client
import re

import mlxlis  # noqa: F401  (before anything imports mlx.core: it chooses the BLAS)

import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import TINY_ORIGINS

MODEL = "llama_long"
ORIGIN, OTHER = TINY_ORIGINS  # allowed
HELLO = [{"role": "user", "content": "Hello, world!"}]
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def raw(server, method: str, path: str, headers: dict[str, str] | None = None):
    """(status, headers lower-cased, body) of one plain request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def scrape(server) -> Samples:
    """Every sample of /metrics, by (name, labels)."""
    status, headers, body = raw(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), body
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def request_deltas(before: Samples, after: Samples) -> dict[tuple[str, str, str], float]:
    """The changed request counts, by (api, model, status)."""
    out = {}
    for (name, labels), value in after.items():
        if name == "mlxlis_requests_total" and value != before.get((name, labels), 0.0):
            d = dict(labels)
            out[(d["api"], d["model"], d["status"])] = value - before.get((name, labels), 0.0)
    return out


def test_metrics_count_a_mixed_load_as_the_clients_saw_it(server):
    """OpenAI (whole, streamed, completions, a one-token reply, a 404 and a 400), then Ollama
    (whole, streamed, a 404), then Anthropic's Messages and OpenAI's Responses: the request
    counts by API/model/status are exactly those requests (the scrape before them included),
    token totals equal the clients' usage sums (cached tokens too, where the API reports
    them), the histograms count one per request that generated (two tokens for the per-token
    one, the buckets cumulative up to +Inf), and the hit ratio is cached / prompt tokens."""
    client = server.client()
    server.wait_idle()  # the other tests' requests ended (their /health calls counted)
    before = scrape(server)
    usages = []
    for _ in range(2):  # the second prompt is held by the prefix cache
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
        usages.append(r.usage)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream me"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usages.append(chunks[-1].usage)
    for n in (4, 1):  # one token: a first token and no time per token after it
        usages.append(client.completions.create(model=MODEL, prompt="Once", max_tokens=n).usage)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-1)
    middle = scrape(server)
    assert request_deltas(before, middle) == {
        ("server", "", "200"): 1,  # the first scrape, counted as it answered
        ("openai", MODEL, "200"): 5,
        ("openai", "", "404"): 1,  # refused before a served model was named
        ("openai", MODEL, "400"): 1,  # the sampling values are checked on its model
    }
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens or 0 for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert cached > 0, usages  # the repeated prompt's
    assert usages[-1].completion_tokens == 1
    assert delta(before, middle, "mlxlis_prompt_tokens_total", model=MODEL) == prompt
    assert delta(before, middle, "mlxlis_prompt_cached_tokens_total", model=MODEL) == cached
    assert delta(before, middle, "mlxlis_generated_tokens_total", model=MODEL) == generated
    ttft = "mlxlis_time_to_first_token_seconds_count"
    tpot = "mlxlis_request_time_per_output_token_seconds_count"
    assert delta(before, middle, ttft, model=MODEL) == len(usages)
    assert delta(before, middle, tpot, model=MODEL) == sum(u.completion_tokens >= 2 for u in usages)
    ratio = middle[("mlxlis_prefix_cache_hit_ratio", frozenset({("model", MODEL)}))]
    total = middle[("mlxlis_prompt_tokens_total", frozenset({("model", MODEL)}))]
    held = middle[("mlxlis_prompt_cached_tokens_total", frozenset({("model", MODEL)}))]
    assert ratio == pytest.approx(held / total, rel=1e-12)

    ol = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)
    opts = {"temperature": 0, "num_predict": 7}
    whole = ol.chat(model=MODEL, messages=HELLO, options=opts)
    last = list(ol.generate(model=MODEL, prompt="Tell me", options=opts, stream=True))[-1]
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="no-such-model", messages=HELLO)
    assert e.value.status_code == 404
    after = scrape(server)
    assert request_deltas(middle, after) == {
        ("server", "", "200"): 1,
        ("ollama", MODEL, "200"): 2,
        ("ollama", "", "404"): 1,
    }
    replies = [whole, last]
    assert delta(middle, after, "mlxlis_prompt_tokens_total", model=MODEL) == sum(
        r.prompt_eval_count for r in replies
    )
    assert delta(middle, after, "mlxlis_generated_tokens_total", model=MODEL) == sum(
        r.eval_count for r in replies
    )
    assert delta(middle, after, ttft, model=MODEL) == 2
    buckets = [
        (float(dict(k[1])["le"]), v)
        for k, v in after.items()
        if k[0] == "mlxlis_time_to_first_token_seconds_bucket" and ("model", MODEL) in k[1]
    ]
    assert max(buckets)[1] == after[(ttft, frozenset({("model", MODEL)}))]  # +Inf: all
    assert [v for _, v in sorted(buckets)] == sorted(v for _, v in buckets)  # cumulative

    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5}
    status, message = server.request("POST", "/v1/messages", body)  # no client: a quick import
    assert status == 200, message
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5)
    end = scrape(server)
    assert request_deltas(after, end) == {
        ("server", "", "200"): 1,
        ("anthropic", MODEL, "200"): 1,
        ("responses", MODEL, "200"): 1,
    }
    a, r = message["usage"], response.usage
    cached = a["cache_read_input_tokens"] + r.input_tokens_details.cached_tokens
    assert delta(after, end, "mlxlis_prompt_tokens_total", model=MODEL) == (
        a["input_tokens"] + a["cache_read_input_tokens"] + r.input_tokens  # Anthropic's: uncached
    )
    assert delta(after, end, "mlxlis_prompt_cached_tokens_total", model=MODEL) == cached
    assert delta(after, end, "mlxlis_generated_tokens_total", model=MODEL) == (
        a["output_tokens"] + r.output_tokens
    )


def test_metrics_show_each_loaded_model_and_the_memory_budget(server):
    """The loaded model's gauges: nothing running or waiting once idle, its memory within the
    budget and at most what the loaded models hold together; one model loaded."""
    server.wait_idle()
    m = scrape(server)
    one = frozenset({("model", MODEL)})
    assert m[("mlxlis_sequences_running", one)] == 0
    assert m[("mlxlis_requests_waiting", one)] == 0
    assert m[("mlxlis_models_loaded", frozenset())] == 1
    budget = m[("mlxlis_memory_budget_bytes", frozenset())]
    held = m[("mlxlis_memory_held_bytes", frozenset())]
    assert 0 < m[("mlxlis_model_memory_bytes", one)] == held <= budget
    assert m[("mlxlis_prefix_cache_bytes", one)] >= 0


def preflight(server, origin: str) -> tuple[int, dict[str, str]]:
    status, headers, _ = raw(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    return status, headers


def test_cors_preflight_allowed_for_a_listed_origin_only(server):
    """--allowed-origins: a listed origin's preflight is allowed (its origin echoed, the
    headers it asked for allowed) and its answers carry the allow header and expose
    x-request-id; another origin's preflight has no allow header."""
    for origin in (ORIGIN, OTHER):
        status, headers = preflight(server, origin)
        assert status == 200 and headers["access-control-allow-origin"] == origin
        assert "authorization" in headers["access-control-allow-headers"].lower()
        assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = raw(server, "GET", "/v1/models", {"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in headers["access-control-expose-headers"].lower()
    status, headers = preflight(server, "http://evil.example")
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = raw(server, "GET", "/v1/models", {"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in headers


def bare_app():
    """The app as `mlxlis serve` builds it, with no model (CORS and ids come before routes)."""
    from mlxlis.serve.app import create_app
    from mlxlis.serve.pool import Pool
    from mlxlis.serve.service import State

    state = State(Pool({}, None, None, 1 << 30, 0, 0))
    return state, create_app(state)


def test_no_cors_by_default():
    """Without --allowed-origins no answer has a CORS header, a preflight included."""
    from starlette.testclient import TestClient

    client = TestClient(bare_app()[1])
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    answers = [client.options("/v1/chat/completions", headers=ask), client.get("/health")]
    for r in answers:
        assert not [k for k in r.headers if k.lower().startswith("access-control-")], r.headers
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


def test_a_server_error_keeps_its_request_id_and_is_counted():
    """A route that fails (answered by Starlette's outermost handler, outside the id
    middleware) still answers with the request's id, and counts as a 500."""
    from starlette.testclient import TestClient

    state, app = bare_app()

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    client = TestClient(app, raise_server_exceptions=False)
    r = client.get("/boom", headers={"x-request-id": "bug-7"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "bug-7"
    assert "RuntimeError: a bug" in r.json()["error"]["message"]
    counted = {
        (s.labels["api"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(state.metrics.text().decode())
        for s in family.samples
        if s.name == "mlxlis_requests_total"
    }
    assert counted == {("server", "500"): 1}


def test_request_ids_echoed_generated_or_replaced_and_logged(server):
    """x-request-id: a client's safe id is echoed and starts the request's log lines; none
    sent, one is made; an id too long or with control characters or spaces is never echoed
    (a new one instead); distinct requests get distinct ids; refusals carry one too."""
    client = server.client()
    got = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=3,
        extra_headers={"x-request-id": "trace-42.A_b"},
    )
    assert got.headers["x-request-id"] == "trace-42.A_b"
    line = server.log_line(r"\[trace-42\.A_b\] chatcmpl-\w+ \w+ prompt=")
    assert f"[trace-42.A_b] {got.parse().id} " in line
    made = {raw(server, "GET", "/health")[1]["x-request-id"] for _ in range(2)}
    assert len(made) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", x) for x in made)
    for hostile in ("x" * 129, "a\tb", "two words", "é"):
        status, headers, _ = raw(server, "GET", "/health", {"x-request-id": hostile})
        assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
    edge = "y" * 128
    assert raw(server, "GET", "/health", {"x-request-id": edge})[1]["x-request-id"] == edge
    status, headers, _ = raw(server, "GET", "/v1/models/nope", {"x-request-id": "missing-1"})
    assert status == 404 and headers["x-request-id"] == "missing-1"


def test_allowed_origins_are_checked_as_browsers_send_them():
    """--allowed-origins: origins split on commas across repeats, duplicates dropped, `*`
    standing for all; a path, a trailing slash, a bare host or an empty item is refused by the
    flag's name (it could never match a browser's Origin)."""
    from mlxlis.commands.serve_command import allowed_origins
    from mlxlis.errors import MlxlisError

    assert allowed_origins([]) == ()
    got = allowed_origins([f"{ORIGIN}, {OTHER}", ORIGIN])
    assert got == (ORIGIN, OTHER)
    assert allowed_origins([ORIGIN, "*"]) == ("*",)
    for bad in ("http://a.example/", "http://a.example/app", "a.example", f"{ORIGIN},"):
        with pytest.raises(MlxlisError) as e:
            allowed_origins([bad])
        assert e.value.field == "--allowed-origins" and repr(bad.split(",")[-1]) in str(e.value)
