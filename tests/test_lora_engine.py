"""Requests on different LoRA adapters batched through the generation core (Engine): several
adapters selectable on one base (Model.select_adapter), each request naming its own or none.

The reference for each request is the same request run alone on a model that has its
adapter applied (`mlxlis.load(base, adapters=[folder])`, the path tests/test_lora.py proves
equal to PEFT's logits): eight requests over three adapters and none, decoding in one batch,
give each its lone run's greedy tokens and logprobs. A prefix cached under one adapter is never
taken under another (nor under the base), in memory and on disk, and is taken under its own.
"""

from __future__ import annotations

import json
import shutil

import mlxlis
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.store import KVFormat
from mlxlis.errors import MlxlisError
from mlxlis.generation.core import Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.generate import run_request
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation
from mlxlis.loading.adapters import read_adapter
from mlxlis.serve.pool import attach

import numpy as np
import pytest
from conftest import tiny_models, trajectory
from test_lora import ATTENTION, BASES, MLP, build, make_adapter

# name -> (rank, alpha, rsLoRA, targets)
ADAPTERS = {
    "a": (4, 8, False, ATTENTION + MLP),
    "b": (8, 4, True, ["q_proj", "v_proj"]),
    "c": (2, 16, False, MLP),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama base with the three adapters selectable, and each adapter's folder."""
    spec = {**BASES["llama"], "head_dim": 32}  # heads of 32: 8-bit KV groups of 32 divide them
    bases = tiny_models(tmp_path_factory, {"llama": spec}, build)
    folder, ref = bases("llama")
    root = tmp_path_factory.mktemp("adapters")
    for name, (rank, alpha, rs, targets) in ADAPTERS.items():
        make_adapter(ref, root / name, rank, alpha, rs, targets)
    # adapter a at half its scale, as PEFT states it: the same tensors, lora_alpha halved
    shutil.copytree(root / "a", root / "a-half")
    config = json.loads((root / "a-half" / "adapter_config.json").read_text())
    config["lora_alpha"] /= 2
    (root / "a-half" / "adapter_config.json").write_text(json.dumps(config))
    model = mlxlis.load(folder, "float32")
    for name in ADAPTERS:
        assert attach(model, {name: read_adapter(root / name)}) == {}  # as the server does
    return model, folder, root


def run(engine: Engine, req: Request) -> list:
    return [e for e in engine.submit(req) if e.token is not None or e.finish_reason]


def lone(folder, root, adapter: str | None, prompt: list[int], n: int) -> list:
    model = mlxlis.load(folder, "float32", adapters=[root / adapter] if adapter else [])
    req = Request(prompt, SamplingParams(max_tokens=n), top_logprobs=1)
    return [e for e in run_request(model, req) if e.token is not None]


def test_eight_requests_over_three_adapters_equal_each_alone(setup):
    """Eight greedy requests (adapters a, b, c and none, each twice, one of a's at half its
    scale; prompts of 5 to 26 tokens) in one engine: each request's tokens equal its lone
    run's with its adapter applied (a at half scale: PEFT's config with lora_alpha halved),
    its logprobs within 1e-5; the adapters change the tokens (not the base's for every row)."""
    model, folder, root = setup
    vocab = model.config.vocab_size
    # (adapter, scale, the folder its lone run applies)
    which = [("a", 1.0, "a"), ("b", 1.0, "b"), ("c", 1.0, "c"), (None, 1.0, None)]
    which += [("c", 1.0, "c"), (None, 1.0, None), ("b", 1.0, "b"), ("a", 0.5, "a-half")]
    prompts = [trajectory(5 + 3 * i, seed=60 + i, vocab=vocab) for i in range(8)]
    engine = Engine(model, max_active=8, prefix_cache_bytes=0)
    try:
        streams = [
            engine.submit(
                Request(
                    p, SamplingParams(max_tokens=10), top_logprobs=1, adapter=w, adapter_scale=k
                )
            )
            for p, (w, k, _) in zip(prompts, which, strict=True)
        ]
        got = [[e for e in s if e.token is not None] for s in streams]
    finally:
        engine.shutdown()
    for i, (p, (_, _, w)) in enumerate(zip(prompts, which, strict=True)):
        want = lone(folder, root, w, p, 10)
        assert [e.token for e in got[i]] == [e.token for e in want], (i, w)
        diff = np.abs(np.array([e.logprob for e in got[i]]) - [e.logprob for e in want])
        assert diff.max() < 1e-5, (i, w)
    base = [[e.token for e in lone(folder, root, None, p, 10)] for p in prompts[:3]]
    assert all([e.token for e in got[i]] != base[i] for i in range(3))


def test_a_prefix_is_never_taken_under_another_adapter(setup, tmp_path):
    """A prompt extending one that ran under adapter a: under b and under the base nothing is
    reused (cached_tokens 0) and the tokens are b's and the base's own; under a the prefix is
    reused and the tokens still equal a fresh run's. The disk tier keeps the same rule after a
    restart (a new engine on the same folder)."""
    model, folder, root = setup
    vocab = model.config.vocab_size
    first = trajectory(24, seed=7, vocab=vocab)
    second = first + trajectory(6, seed=8, vocab=vocab)
    params = SamplingParams(max_tokens=6)
    warns: list[str] = []

    def engine_on(disk):
        tier = DiskCache(disk, 1 << 30, model.cache_key(), model.make_cache, warns.append)
        return Engine(model, prefix_cache_bytes=1 << 30, disk=tier)

    for restart in (False, True):
        disk = tmp_path / f"prefix-{restart}"
        engine = engine_on(disk)
        try:
            run(engine, Request(first, params, adapter="a"))
            if restart:  # a new engine: only the disk tier holds the entry
                engine.shutdown()
                engine = engine_on(disk)
            for w in ("b", None, "a"):
                events = run(engine, Request(second, params, adapter=w))
                cached = events[-1].usage.cached_tokens
                assert (cached > 0) == (w == "a"), (restart, w, cached)
                want = [e.token for e in lone(folder, root, w, second, 6)]
                assert [e.token for e in events if e.token is not None] == want, (restart, w)
        finally:
            engine.shutdown()
        assert warns == []


def test_an_unknown_adapter_or_a_bad_scale_is_refused_by_name(setup):
    """A request naming an adapter the model lacks, or a negative or NaN scale, is refused
    at submit with an MlxlisError naming the `adapter` field; nothing runs."""
    model, _, _ = setup
    engine = Engine(model, prefix_cache_bytes=0)
    try:
        for adapter, scale in (("nope", 1.0), ("a", -1.0), ("a", float("nan"))):
            with pytest.raises(MlxlisError) as e:
                engine.submit(Request([1, 2, 3], adapter=adapter, adapter_scale=scale))
            assert e.value.field == "adapter"
        assert engine.counts == (0, 0)
    finally:
        engine.shutdown()


def test_speculation_and_quantized_kv_keep_each_adapter(setup):
    """Requests on adapters a and b and on none, speculating (n-gram drafts, verified in one
    batch) with 8-bit KV caches, in one engine: each gives the greedy tokens of its lone plain
    run (no speculation) with its adapter applied and the same KV format; drafts were made
    and some accepted (the verification ran under each row's adapter)."""
    model, folder, root = setup
    vocab = model.config.vocab_size
    kv = KVFormat(8, 32)
    loop = trajectory(6, seed=5, vocab=vocab) * 5  # repetitive: the n-gram drafter proposes
    engine = Engine(model, max_active=4, prefix_cache_bytes=0)
    which = ["a", "b", None]
    try:
        streams = [
            engine.submit(
                Request(
                    loop + [i + 3],
                    SamplingParams(max_tokens=16),
                    speculation=Speculation("ngram", tokens=4),
                    kv_format=kv,
                    adapter=w,
                )
            )
            for i, w in enumerate(which)
        ]
        got = [list(s) for s in streams]
    finally:
        engine.shutdown()
    for i, w in enumerate(which):
        applied = mlxlis.load(folder, "float32", adapters=[root / w] if w else [])
        req = Request(loop + [i + 3], SamplingParams(max_tokens=16), kv_format=kv)
        want = [e.token for e in run_request(applied, req) if e.token is not None]
        assert [e.token for e in got[i] if e.token is not None] == want, w
    assert all(evs[-1].usage.accepted_tokens > 0 for evs in got)
