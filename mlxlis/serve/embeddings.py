"""Embeddings and reranking over HTTP: OpenAI's `/v1/embeddings`, Ollama's `/api/embed` and
older `/api/embeddings`, and `/v1/rerank` in the Jina / Cohere shape (llama.cpp's `/rerank`
and `/v1/reranking` the same route).

A thin adapter like the chat APIs: each body becomes one call of the model's `embed` or
`rerank` (models/model.py), run on the MLX thread between the engines' steps.
The model is named as for chat (serve/pool.py: loaded on demand, beside chat models); a chat
model named here, or an embedding model named by a chat route, is a 400 saying which kind it
is. An input over the model's context is truncated where the API says so (Ollama's
`truncate`, true by default), else a 400 naming the input's index. At most MAX_INPUTS inputs
a request.
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from mlxlis.errors import MlxlisError
from mlxlis.runtime import mlx_thread
from mlxlis.serve.openai_format import APIError, bad
from mlxlis.serve.pool import Served
from mlxlis.serve.schemas import _Body
from mlxlis.serve.service import Service, read_body

import numpy as np
from fastapi import APIRouter, Request

MAX_INPUTS = 2048  # inputs (texts, documents) a request; more is a 400 naming the field
# inputs a job on the MLX thread: the chat engines step between a large request's jobs
CHUNK = 32
T = TypeVar("T")


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings body."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # an end-user id, for the caller's own abuse tracking: unused
    keep_alive: float | str | None = None


class OllamaEmbedRequest(_Body):
    """Ollama's /api/embed body (`options` are sampling values: none applies)."""

    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(_Body):
    """Ollama's older /api/embeddings body: one prompt."""

    model: str
    prompt: str
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class Document(_Body):
    text: str


class RerankRequest(_Body):
    """Jina's and Cohere's /v1/rerank body (llama.cpp's /rerank)."""

    model: str | None = None
    query: str
    documents: list[str | Document]
    top_n: int | None = None
    return_documents: bool = False


async def on_mlx_thread(job: Callable[[], T]) -> T:
    """`job` run on the MLX thread, between the engines' steps (the route holds its model)."""
    return await asyncio.wrap_future(mlx_thread.shared().submit(job))


def inputs_of(value: str | list[str] | list[int] | list[list[int]], name: str) -> list:
    """A request's inputs as a list of texts or of token-id lists (one id list: one input)."""
    if isinstance(value, str):
        out: list = [value]
    elif value and all(isinstance(v, int) for v in value):
        out = [list(value)]
    else:
        out = list(value)
    if not out:
        raise bad(f"{name}: at least one input is required", name)
    if len(out) > MAX_INPUTS:
        raise bad(f"{name}: at most {MAX_INPUTS} inputs a request, not {len(out)}", name)
    for i, x in enumerate(out):
        if len(x) == 0:
            raise bad(f"{name}[{i}]: empty", name)
    return out


def refused(e: MlxlisError, name: str) -> APIError:
    """A model's refusal as a 400 naming the request's field (`input[3]`, `dimensions`)."""
    field = (e.field or name).replace("input", name, 1)
    said = e.message if e.message.startswith(field.split("[")[0]) else f"{field}: {e.message}"
    return bad(said, field.split("[")[0])


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()
    state = svc.state

    async def embed(
        served: Served, texts: list, truncate: bool, dimensions: int | None, name: str
    ) -> tuple[np.ndarray, int]:
        """(n, d) vectors and the tokens fed. The inputs are tokenized first (off the event
        loop: a refusal names the input's own index), then run in jobs of CHUNK inputs of
        similar lengths, so that a request of thousands never holds the MLX thread."""
        model = served.model
        try:
            rows = await asyncio.to_thread(token_rows, model, texts, truncate)
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
            out: list[np.ndarray | None] = [None] * len(rows)
            for start in range(0, len(order), CHUNK):
                part = order[start : start + CHUNK]
                ids = [rows[i] for i in part]
                v = await on_mlx_thread(
                    lambda ids=ids: np.array(model.embed(ids, dimensions=dimensions))
                )
                for k, i in enumerate(part):
                    out[i] = v[k]
        except MlxlisError as e:
            raise refused(e, name) from None
        return np.stack(out), sum(len(r) for r in rows)

    @r.post("/v1/embeddings", dependencies=auth)
    async def openai_embeddings(request: Request) -> dict[str, Any]:
        req = await read_body(request, EmbeddingRequest, state.max_body)
        texts = inputs_of(req.input, "input")
        served = await svc.model(req.model, req.keep_alive, task="embed")
        with served.held():
            vectors, tokens = await embed(served, texts, False, req.dimensions, "input")
        data = []
        for i, v in enumerate(vectors):
            if (
                req.encoding_format == "base64"
            ):  # little-endian float32, as OpenAI's client reads it
                value: Any = base64.b64encode(v.astype("<f4").tobytes()).decode()
            else:
                value = v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": served.name, "usage": usage}

    @r.post("/api/embed", dependencies=auth)
    async def ollama_embed(request: Request) -> dict[str, Any]:
        t0 = time.perf_counter_ns()
        req = await read_body(request, OllamaEmbedRequest, state.max_body)
        texts = inputs_of(req.input, "input")
        served = await svc.model(req.model, req.keep_alive, task="embed")
        t1 = time.perf_counter_ns()
        with served.held():
            vectors, tokens = await embed(served, texts, req.truncate, req.dimensions, "input")
        return {
            "model": req.model,
            "embeddings": vectors.tolist(),
            "total_duration": time.perf_counter_ns() - t0,
            "load_duration": t1 - t0,
            "prompt_eval_count": tokens,
        }

    @r.post("/api/embeddings", dependencies=auth)
    async def ollama_embeddings(request: Request) -> dict[str, Any]:
        req = await read_body(request, OllamaEmbeddingsRequest, state.max_body)
        served = await svc.model(req.model, req.keep_alive, task="embed")
        with served.held():
            vectors, _ = await embed(served, inputs_of(req.prompt, "prompt"), True, None, "prompt")
        return {"embedding": vectors[0].tolist()}

    async def rerank(request: Request) -> dict[str, Any]:
        req = await read_body(request, RerankRequest, state.max_body)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        inputs_of(docs, "documents")
        if req.top_n is not None and req.top_n < 1:
            raise bad(f"top_n: must be 1 or more, not {req.top_n}", "top_n")
        served = await svc.model(req.model, task="rerank")
        with served.held():
            model = served.model
            scores: list[float] = []
            for start in range(0, len(docs), CHUNK):  # jobs of CHUNK documents, as embed's
                part = docs[start : start + CHUNK]
                try:
                    scores += await on_mlx_thread(
                        lambda part=part: list(model.rerank(req.query, part))
                    )
                except MlxlisError as e:
                    raise refused(shifted(e, start), "documents") from None
            tokens = count_pairs(model, req.query, docs)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or len(docs)]
        results = []
        for i in order:
            row: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if req.return_documents:
                row["document"] = {"text": docs[i]}
            results.append(row)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"model": served.name, "object": "list", "results": results, "usage": usage}

    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        r.add_api_route(path, rerank, methods=["POST"], dependencies=auth)
    return r


def token_rows(model: Any, texts: list, truncate: bool) -> list[list[int]]:
    """Each input's token ids as the model's `embed` feeds them: its default prompt before a
    text, special tokens added, cut where `truncate` (else a refusal naming `input[i]`)."""
    embedder = model.embedder
    name = embedder.default_prompt
    prefix = embedder.prompts.get(name, "") if name is not None else ""
    return [ids for ids, _ in embedder.rows(texts, prefix, truncate)]


def shifted(e: MlxlisError, start: int) -> MlxlisError:
    """A refusal naming `documents[k]` of a job that began at `start`: the request's index."""
    m = re.fullmatch(r"documents\[(\d+)\]", e.field or "")
    if m is not None:
        e.field = f"documents[{start + int(m.group(1))}]"
    return e


def count_pairs(model: Any, query: str, documents: list[str]) -> int:
    """The tokens of each (query, document) pair as the cross-encoder reads it."""
    return sum(len(model.embedder.tokenizer.encode(query, d)[0]) for d in documents)
