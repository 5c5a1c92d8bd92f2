"""Embeddings and reranking through a real `mlxlis serve` beside a chat model, driven by the
official openai and ollama clients and (reranking, which neither has) httpx.

The reference for each vector and score is the same model run in this process
(`model.embed`, `model.rerank`), which tests/test_embed_bert.py proves equal to
sentence-transformers' `encode` and CrossEncoder's `predict`: what is proved here is the
adapter — each API's inputs, options (`dimensions`, `encoding_format`, `truncate`, `top_n`,
`return_documents`) and shapes — and the refusals, each in its API's own error shape.
"""

from __future__ import annotations

import base64

import mlxlis

import httpx
import numpy as np
import ollama
import openai
import pytest
from conftest import need_pulled
from encoders import cross_encoder_folder
from serve_process import ServeProcess

pytestmark = pytest.mark.real

MINILM, SMOL = "all-minilm-l6-v2", "smollm2-135m"
TEXTS = ["local embedding models", "a search engine for my notes", "Paris is in France"]
LONG = "word " * 400  # past MiniLM's 256 tokens
MAX_INPUTS = 2048  # serve/embeddings.py's stated bound


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rr") / "rr"
    cross_encoder_folder(folder, "bert")
    return folder


@pytest.fixture(scope="module")
def srv(tmp_path_factory, reranker):
    need_pulled(MINILM)
    need_pulled(SMOL)
    tmp = tmp_path_factory.mktemp("serve")
    server = ServeProcess(tmp, "-m", f"minilm={MINILM}", "-m", SMOL, "-m", f"rr={reranker}")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def local(reranker):
    return mlxlis.load(need_pulled(MINILM)), mlxlis.load(reranker)


def test_openai_embeddings_float_base64_and_dimensions(srv, local):
    """openai.embeddings.create: each vector equals the model's own, asked as floats and in
    the client's default (it asks for base64 and decodes it itself); `dimensions` 128 gives
    the first 128 renormalised; usage counts the tokens fed; a base64 answer read raw is
    little-endian float32."""
    model, _ = local
    client = srv.client()
    want = np.array(model.embed(TEXTS))
    for fmt in ({"encoding_format": "float"}, {}):
        r = client.embeddings.create(model="minilm", input=TEXTS, **fmt)
        got = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    short = client.embeddings.create(model="minilm", input=TEXTS[0], dimensions=128)
    v = np.array(short.data[0].embedding)
    np.testing.assert_allclose(v, np.array(model.embed(TEXTS[:1], dimensions=128))[0], atol=1e-6)
    assert r.usage.prompt_tokens == sum(
        len(model.embedder.rows([t], "", False)[0][0]) for t in TEXTS
    )
    raw = httpx.post(
        f"{srv.base_url}/embeddings",
        json={"model": "minilm", "input": TEXTS[1], "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, want[1], atol=1e-6, rtol=0)


def test_ollama_embed_truncates_and_the_older_route_answers(srv, local):
    """ollama.embed: the vectors, a long input truncated (Ollama's default) to what the model
    gives the truncated text; `truncate: false` on it is a 400 naming input[1];
    /api/embeddings (ollama.embeddings) gives the one prompt's vector."""
    model, _ = local
    olm = ollama.Client(host=f"http://127.0.0.1:{srv.port}")
    r = olm.embed(model="minilm", input=[TEXTS[0], LONG])
    np.testing.assert_allclose(
        np.array(r.embeddings), np.array(model.embed([TEXTS[0], LONG])), atol=1e-6
    )
    with pytest.raises(ollama.ResponseError) as e:
        olm.embed(model="minilm", input=[TEXTS[0], LONG], truncate=False)
    assert e.value.status_code == 400 and "input[1]" in e.value.error
    old = olm.embeddings(model="minilm", prompt=TEXTS[2])
    np.testing.assert_allclose(
        np.array(old.embedding), np.array(model.embed(TEXTS[2:]))[0], atol=1e-6
    )


def test_rerank_sorted_with_top_n_on_every_route(srv, local):
    """/v1/rerank (Jina / Cohere shape), /rerank and /v1/reranking: results sorted by score,
    each score the cross-encoder's own, `top_n` cutting the list, `return_documents` echoing
    strings and {text} documents alike."""
    _, rr = local
    query = "search the local server"
    docs = ["the query is short", {"text": "a local server for search"}, "x", "apple silicon"]
    texts = [d if isinstance(d, str) else d["text"] for d in docs]
    scores = rr.rerank(query, texts)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        body = {"model": "rr", "query": query, "documents": docs, "top_n": 3}
        r = httpx.post(f"http://127.0.0.1:{srv.port}{path}", json=body | {"return_documents": True})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:3]
        for x in results:
            assert abs(x["relevance_score"] - scores[x["index"]]) < 1e-6
            assert x["document"]["text"] == texts[x["index"]]


def test_each_api_refuses_the_wrong_kind_and_bad_inputs_by_field(srv):
    """A chat model on the embedding routes, an embedding model on the chat and rerank
    routes, an input past the context without truncation, more than the stated bound of
    inputs, an empty input, dimensions past the model's: each a 400 naming the field in its
    API's shape; 1 000 inputs in one request are answered."""
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=SMOL, input="hi")
    assert e.value.body["param"] == "model" and "chat model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "model" and "embedding model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input=["ok", LONG])
    assert e.value.body["param"] == "input" and "input[1]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="minilm", input=["a"] * (MAX_INPUTS + 1))
    assert e.value.body["param"] == "input"
    for bad, param in (({"input": ""}, "input"), ({"input": "a", "dimensions": 999}, "dimensions")):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="minilm", **bad)
        assert e.value.body["param"] == param, e.value.body
    r = httpx.post(
        f"http://127.0.0.1:{srv.port}/v1/rerank",
        json={"model": "minilm", "query": "q", "documents": ["d"]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    olm = ollama.Client(host=f"http://127.0.0.1:{srv.port}")
    with pytest.raises(ollama.ResponseError) as e2:
        olm.embed(model=SMOL, input="hi")
    assert e2.value.status_code == 400 and "chat model" in e2.value.error
    many = client.embeddings.create(model="minilm", input=[f"note {i}" for i in range(1000)])
    assert len(many.data) == 1000 and sorted(d.index for d in many.data) == list(range(1000))
