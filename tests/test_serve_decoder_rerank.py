"""A causal LM served as a reranker (`mlxlis serve -m rr=FOLDER --rerank rr`) through a real
server: /v1/rerank's scores equal the model's own in-process `rerank` (which
tests/test_embed_decoders.py proves equal to transformers run by Qwen3-Reranker's recipe)."""

from __future__ import annotations

import mlxlis

import httpx
import pytest
from decoder_folders import reranker_folder
from serve_process import ServeProcess


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("rr") / "rr"
    reranker_folder(path)
    return path


def test_rerank_flag_serves_a_causal_lm_as_a_reranker(folder, tmp_path):
    query, docs = "what is a local server", ["apple silicon server", "no", "a long text"]
    scores = mlxlis.load(folder, task="rerank").rerank(query, docs)
    server = ServeProcess(tmp_path, "-m", f"rr={folder}", "--rerank", "rr")
    try:
        base = f"http://127.0.0.1:{server.port}"
        r = httpx.post(f"{base}/v1/rerank", json={"model": "rr", "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        for x in r.json()["results"]:
            assert abs(x["relevance_score"] - scores[x["index"]]) < 1e-6
        assert sorted(x["index"] for x in r.json()["results"]) == [0, 1, 2]
    finally:
        assert server.stop() == 0, server.log()
