"""Quantized KV caches (mlxlis/cache/store.py; the quantized products in models/attention.py).

What is proved here:
- attention on quantized keys and values equals a numpy float64 reference computed from their
  dequantized values (GQA groups, a causal chunk after cached keys, Gemma 2's softcap, 8 and 4
  bits): exact up to float32 rounding;
- reference parity for the scheme: the whole model's logits with 8- and 4-bit KV equal
  mlx-lm's QuantizedKVCache on the same weights and tokens (a chunk, then token by token);
- every cache kind keeps quantized positions exactly as they were quantized — full attention,
  sliding-window rings past their window, the hybrid's attention layers, Gemma 4's KV-shared
  layers: a chunked prefill and decode on quantized caches gives the logits of dense caches
  fed each chunk's quantize-dequantize round trip (`RoundTrip`, written here);
- the serving paths on quantized caches: batched decoding gives each request its lone greedy
  tokens; a prompt that extends a finished one reuses its quantized cache and gives the cold
  run's tokens; speculative verification (trims, ring spills) gives the plain greedy tokens;
- the full-precision tail: the newest block's positions are read exactly (equal to a reference
  written from the rule alone, through chunks crossing a block's end, decoding and a trim),
  batched as alone;
- refusals name the field: bits or group sizes MLX does not quantize with, a group size that
  does not divide the head dimension.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlxlis
from mlxlis.cache import KVBatch, KVCache, KVFormat, QArray, RotatingKVCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.cache.store import Store
from mlxlis.errors import MlxlisError
from mlxlis.generation.core import Core, Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.generate import run
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.steps import steps_for
from mlxlis.models import attention
from mlxlis.models.attention import attend
from mlxlis.runtime import backend
from mlxlis.runtime.device import device_name
from mlxlis.settings import settings

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, loaded_models, trajectory
from test_gemma4 import SPECS as GEMMA4
from test_gemma4 import build as build_gemma4
from test_gemma_parity import SPECS as GEMMA
from test_qwen3_5 import SPECS as QWEN35
from test_qwen3_5 import build as build_qwen35

HD = 64  # head_dim: the groups (32, 64) must divide it
SPECS = {
    "llama": {**TINY["llama"], "head_dim": HD},
    "gemma3": {"kind": "gemma3", "pad_token_id": 0, **GEMMA["gemma3"], "head_dim": HD},
    "qwen3_5": {**QWEN35["qwen3_5"], "head_dim": HD},
    "gemma4": {"kind": "gemma4_text", **GEMMA4["e2b"], "head_dim": HD, "global_head_dim": HD},
}
BUILD = {"qwen3_5_text": build_qwen35, "gemma4_text": build_gemma4}
FORMATS = [KVFormat(8, 64, tail=False), KVFormat(4, 32, tail=False)]  # the scheme alone
PROMPT, NEW = 80, 40  # past Gemma's window (8) and the DeltaNet's chunk (64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return loaded_models(tmp_path_factory, SPECS, BUILD)


def rand(rng, *shape: int) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def reference(q, k, v, scale, cap, start) -> np.ndarray:
    """float64 attention of q (B, H, T, D) over k, v (B, KV, S, D); query i sits at key
    position start + i and sees keys up to it."""
    q, k, v = (np.array(a, np.float64) for a in (q, k, v))
    b, h, t, d = q.shape
    group = h // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if cap is not None:
        s = np.tanh(s / cap) * cap
    seen = np.arange(k.shape[2])[None, :] <= (start + np.arange(t))[:, None]
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("cap", [None, 50.0])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("t", [5, 1])
@pytest.mark.parametrize("packed", [True, False])
def test_quantized_attention_equals_the_dequantized_reference(
    fmt, cap, fast, t, packed, monkeypatch
):
    """A chunk of 5 queries, or one, after 27 (31) cached keys (4 query heads on 2 KV heads):
    the output of `attend` on QArray keys/values equals float64 attention over their
    dequantized values, with both of mlxlis's softmax ways and both ways of multiplying (the
    packed products, which a GPU takes for chunks too, and the CPU's dequantized chunk).
    Measured ≤ 6e-7; bound 2e-6."""
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 1, 4, t, HD), rand(rng, 1, 2, 32, HD), rand(rng, 1, 2, 32, HD)
    qk, qv = QArray.of(k, fmt), QArray.of(v, fmt)
    if packed:  # the device check that sends a CPU's chunks to the dequantized product
        monkeypatch.setattr(attention, "on_cpu", lambda device=None: False)
    elif t == 1 or device_name() != "cpu":
        pytest.skip("a single query, or a GPU, always multiplies the packed form")
    if not fast:
        backend.select("cpu", replace(settings(), fast_math=False))
    elif not backend.current().fast_math:
        pytest.skip("mlxlis's fast softmax is off on this machine")
    got = np.array(attend(q, qk, qv, HD**-0.5, "causal", cap))
    want = reference(q, qk.dequantize(), qv.dequantize(), HD**-0.5, cap, 32 - t)
    assert np.abs(got - want).max() < 2e-6
    # the quantization is not a no-op: dense keys give other scores
    dense = reference(q, k, v, HD**-0.5, cap, 32 - t)
    assert np.abs(dense - want).max() > 1e-3


@pytest.mark.parametrize(
    "fmt", [KVFormat(8, 64, False), KVFormat(4, 64, False), KVFormat(4, 32, False)], ids=str
)
def test_logits_match_mlx_lm_quantized_kv_cache(models, fmt, tmp_path):
    """mlx-lm's QuantizedKVCache (its quantized attention) on the same weights: a 40-token
    chunk, then 32 tokens one by one, the same logits. Measured ≤ 1.5e-6; bound 1e-5."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.models.cache import QuantizedKVCache

    model = models("llama")
    folder = model.path
    copy = tmp_path / "classic"  # mlx-lm reads only classic config keys
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (copy / "config.json").write_text(json.dumps(cfg))
    theirs, _ = mlx_lm_load(str(copy))
    their_caches = [
        QuantizedKVCache(group_size=fmt.group_size, bits=fmt.bits) for _ in theirs.layers
    ]
    model.set_kv_format(fmt)
    try:
        caches = model.make_cache()
    finally:
        model.set_kv_format(None)
    ids = trajectory(72, vocab=400)
    chunks = [ids[:40], *([t] for t in ids[40:])]
    worst = 0.0
    for chunk in chunks:
        ours = model.net(mx.array([chunk]), cache=caches)
        ref = theirs(mx.array([chunk]), cache=their_caches)
        worst = max(worst, float(mx.abs(ours - ref).max()))
    assert worst < 1e-5


class RoundTrip(Store):
    """The reference: dense storage of each chunk's quantize-dequantize round trip (what the
    quantized cache's bits stand for), attended by the dense path."""

    def __init__(self, fmt: KVFormat):
        self.fmt_ = fmt

    def take(self, x):
        return QArray.of(x, self.fmt_).dequantize() if not isinstance(x, QArray) else x


def deq(x):
    return x.dequantize() if isinstance(x, QArray) else x


def same(a, b) -> bool:
    return a is None and b is None or bool(mx.array_equal(deq(a), deq(b)))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_caches_move_quantized_positions_exactly(fmt):
    """A KV cache and a ring of window 8, quantized, beside the same two with RoundTrip
    storage, through the same operations: chunks that wrap the ring, single steps, a batched
    step of both rings stacked (KVBatch) and its dissolving, a snapshot, a verification's
    spill and a trim into it, a return to the snapshot. After each, the keys and values they
    hand to attention and hold are the reference's bit for bit (quantization is per position:
    nothing is ever requantized)."""
    rng = np.random.default_rng(1)

    def pair(make):
        a, b = make(fmt), make(None)
        b.store = RoundTrip(fmt)
        return a, b

    full, ring, ring2 = (
        pair(KVCache),
        pair(lambda f: RotatingKVCache(8, f)),
        pair(lambda f: RotatingKVCache(8, f)),
    )

    def update(caches, n):
        k, v = rand(rng, 1, 2, n, HD), rand(rng, 1, 2, n, HD)
        got = caches[0].update_and_fetch(k, v)
        want = caches[1].update_and_fetch(k, v)
        assert all(same(g, w) for g, w in zip(got, want, strict=True))

    def check(caches):
        a, b = caches
        assert a.offset == b.offset and same(a.keys, b.keys) and same(a.values, b.values)

    for n in (5, 13, 1, 1, 20, 1):
        for c in (full, ring, ring2):
            update(c, n)
            check(c)
    for _ in (0, 1):  # the two rings stacked for two batched steps
        k, v = rand(rng, 2, 2, 1, HD), rand(rng, 2, 2, 1, HD)
        got = KVBatch.step_of([ring[0], ring2[0]], k, v)
        want = KVBatch.step_of([ring[1], ring2[1]], k, v)
        assert all(same(g, w) for g, w in zip(got, want, strict=True))
    for c in (ring, ring2):
        check(c)  # reading takes the rows back
    for c in (full, ring):
        for x in c:
            x.snapshot()
            x.expect_rewind(4)
        update(c, 6)  # a verification of 6 pushes 6 positions out of the ring: 4 kept
        for x in c:
            assert x.trim(3) == 3
        check(c)
        update(c, 1)
        for x in c:
            assert x.rewind_point(x.offset - 4) == x.offset - 4  # the snapshot's position
            assert x.trim(4) == 4
        check(c)
        update(c, 3)
        check(c)


def feed(model, caches, ids) -> list[mx.array]:
    """Logits of a prefill in chunks of 32, 32, 16, then 12 tokens one by one."""
    out, at = [], 0
    for n in (32, 32, 16, *[1] * 12):
        out.append(model.net(mx.array([ids[at : at + n]]), cache=caches))
        at += n
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_model_logits_equal_the_round_trip_reference(models, name, fmt):
    """Chunked prefill past the DeltaNet's chunk, then decoding: the logits on quantized caches
    equal those on dense caches fed every chunk's round trip (full attention; the hybrid's
    attention layers beside its recurrent ones). Measured ≤ 4e-6; bound 2e-5. The
    quantization is not a no-op: dense caches give logits 1e-3 or more away.
    Gemma 3 and 4 are left to the cache-level test above: their tiny random models (normed
    keys, a near one-hot softmax) turn float32 rounding into logit differences of 1e-3 and
    more once their keys are quantized, so a model-level bound would prove nothing there."""
    model = models(name)
    ids = trajectory(92, vocab=model.config.vocab_size)
    model.set_kv_format(fmt)
    try:
        quantized, ref = model.make_cache(), model.make_cache()
    finally:
        model.set_kv_format(None)
    for c in ref:
        if hasattr(c, "store"):
            c.store = RoundTrip(fmt)
    got, want = feed(model, quantized, ids), feed(model, ref, ids)
    dense = feed(model, model.make_cache(), ids)
    worst = max(float(mx.abs(a - b).max()) for a, b in zip(got, want, strict=True))
    assert worst < 2e-5
    assert max(float(mx.abs(a - b).max()) for a, b in zip(got, dense, strict=True)) > 1e-3
    assert any(isinstance(c.keys, QArray) for c in quantized if hasattr(c, "keys"))


class TailReference(KVCache):
    """The tail's reference, from its rule alone: dense, exact keys and values, attention
    reading the positions before `start` as their quantize-dequantize round trip and the rest
    exact; `start` moves to each filled block's end, and back to the offset on a trim below
    it."""

    def __init__(self, fmt: KVFormat):
        super().__init__(None)
        self.fmt, self.start = fmt, 0

    def update_and_fetch(self, k, v):
        k, v = super().update_and_fetch(k, v)
        self.start = max(self.start, self.offset // self.step * self.step)
        if not self.start:
            return k, v
        n = self.start
        return tuple(
            mx.concatenate([QArray.of(x[:, :, :n], self.fmt).dequantize(), x[:, :, n:]], axis=2)
            for x in (k, v)
        )

    def trim(self, n: int) -> int:
        n = super().trim(n)
        self.start = min(self.start, self.offset)
        return n


@pytest.mark.parametrize("fmt", [KVFormat(8, 64), KVFormat(4, 32)], ids=str)
def test_the_newest_block_stays_in_full_precision(models, fmt):
    """A prefill crossing the first block's end mid-chunk (200, then 100 tokens), decoding,
    a trim back below the tail's start (to 250) and decoding past the block's end again: the
    logits on tailed caches equal TailReference's (float rounding: measured <1e-6, bound
    2e-5) — dense ones while the first block fills — and differ from untailed caches'."""
    model = models("llama")
    ids = trajectory(310, vocab=model.config.vocab_size)

    def feed(caches) -> list[mx.array]:
        out = [model.net(mx.array([ids[:200]]), cache=caches)[0, -1]]
        out.append(model.net(mx.array([ids[200:300]]), cache=caches)[0, -1])
        out += [model.net(mx.array([[t]]), cache=caches)[0, -1] for t in ids[300:310]]
        for c in caches:
            c.trim(60)
        out += [model.net(mx.array([[t]]), cache=caches)[0, -1] for t in ids[250:262]]
        return out

    tailed = feed(model.make_cache(fmt))
    want = feed([TailReference(fmt) for _ in model.make_cache()])
    plain = feed(model.make_cache(KVFormat(fmt.bits, fmt.group_size, tail=False)))
    dense = feed(model.make_cache(None))
    assert max(float(mx.abs(a - b).max()) for a, b in zip(tailed, want, strict=True)) < 2e-5
    assert float(mx.abs(tailed[0] - dense[0]).max()) < 2e-5  # all 200 in the tail
    assert float(mx.abs(plain[0] - dense[0]).max()) > 1e-3
    assert float(mx.abs(tailed[-1] - plain[-1]).max()) > 1e-4
    assert float(mx.abs(tailed[-1] - dense[-1]).max()) > 1e-4  # the first block quantized


def test_tails_batched_across_a_block_end(models):
    """8-bit KV with its tail, three requests decoding together across the first block's end
    (prompts of 240, 247 and 251 tokens, 40 new each): each gets its lone greedy tokens."""
    model = models("llama")
    vocab = model.config.vocab_size
    model.set_kv_format(KVFormat(8, 64))
    try:
        prompts = [trajectory(n, seed=n, vocab=vocab) for n in (240, 247, 251)]
        alone = [lone(model, p) for p in prompts]
        engine = Engine(model, max_active=3)
        try:
            streams = [engine.submit(Request(p, SamplingParams(max_tokens=NEW))) for p in prompts]
            assert [[e.token for e in s if e.token is not None] for s in streams] == alone
        finally:
            engine.shutdown()
    finally:
        model.set_kv_format(None)


def lone(model, prompt, spec=None) -> list[int]:
    core = Core(model, steps_for(model, PrefixCache(0)))
    req = Request(list(prompt), SamplingParams(max_tokens=NEW), frozenset(), speculation=spec)
    return [e.token for e in run(core, core.start(req)) if e.token is not None]


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_batched_reused_and_speculative_decoding_on_quantized_caches(models, name):
    """With 8-bit KV: three requests decoding together in the engine each get their lone
    greedy tokens (the stacked quantized batch); a prompt extending a finished one reuses its
    cache (cached_tokens > 0) and gets the cold run's tokens; prompt lookup's verifications
    (trims, a ring's spill) give the plain greedy tokens."""
    model = models(name)
    vocab = model.config.vocab_size
    model.set_kv_format(KVFormat(8, 64))
    try:
        prompts = [trajectory(PROMPT - 7 * i, seed=i, vocab=vocab) for i in range(3)]
        alone = [lone(model, p) for p in prompts]
        engine = Engine(model, max_active=3)
        try:
            streams = [engine.submit(Request(p, SamplingParams(max_tokens=NEW))) for p in prompts]
            got = [[e.token for e in s if e.token is not None] for s in streams]
            assert got == alone
            longer = prompts[0] + alone[0] + trajectory(9, seed=9, vocab=vocab)
            events = list(engine.submit(Request(longer, SamplingParams(max_tokens=NEW))))
            assert events[-1].usage.cached_tokens > PROMPT
            assert [e.token for e in events if e.token is not None] == lone(model, longer)
        finally:
            engine.shutdown()
        loop = (trajectory(20, seed=3, vocab=vocab) * 5)[:PROMPT]
        assert lone(model, loop, Speculation("ngram", tokens=4)) == lone(model, loop)
    finally:
        model.set_kv_format(None)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_requests_of_several_kv_formats_decode_together(models, name):
    """A dense model's engine given requests that each ask for their own KV format (the
    server's kv_bits extension), two of them speculating: decoding (and verifying) together,
    each gets the greedy tokens it gets alone on a model set to that format; a prompt
    extending the 8-bit one reuses its cache in 8-bit and nothing in dense."""
    model = models(name)
    vocab = model.config.vocab_size
    loop = (trajectory(20, seed=3, vocab=vocab) * 5)[:PROMPT]
    eight, four = KVFormat(8, 64), KVFormat(4, 32)
    cases = [  # (prompt, its kv_format, speculation)
        (trajectory(PROMPT, seed=0, vocab=vocab), "model", None),
        (trajectory(PROMPT - 7, seed=1, vocab=vocab), eight, None),
        (trajectory(PROMPT - 14, seed=2, vocab=vocab), four, None),
        (loop, eight, Speculation("ngram", tokens=4)),
        (loop, None, Speculation("ngram", tokens=4)),
    ]
    alone = []
    for prompt, fmt, spec in cases:
        model.set_kv_format(None if fmt == "model" else fmt)
        alone.append(lone(model, prompt, spec))
    model.set_kv_format(None)
    engine = Engine(model, max_active=len(cases))
    try:
        streams = [
            engine.submit(Request(p, SamplingParams(max_tokens=NEW), speculation=spec, kv_format=f))
            for p, f, spec in cases
        ]
        assert [[e.token for e in s if e.token is not None] for s in streams] == alone
        longer = cases[1][0] + alone[1] + trajectory(9, seed=9, vocab=vocab)
        for fmt, reused in ((None, False), (eight, True)):
            events = list(
                engine.submit(Request(longer, SamplingParams(max_tokens=8), kv_format=fmt))
            )
            assert (events[-1].usage.cached_tokens > PROMPT) is reused
    finally:
        engine.shutdown()


def test_refusals_name_the_field(models):
    """Bits and group sizes MLX does not quantize with, and a group that does not divide the
    head dimension (64, in groups of 128), are MlxlisErrors naming the field (and the model)."""
    for kw, field in (({"bits": 3}, "kv_bits"), ({"group_size": 48}, "kv_group_size")):
        with pytest.raises(MlxlisError) as e:
            KVFormat(**kw)
        assert e.value.field == field
    folder = models("llama").path
    with pytest.raises(MlxlisError) as e:
        mlxlis.load(folder, "float32", kv_bits=8, kv_group_size=128)
    assert e.value.field == "kv_group_size" and str(folder) in str(e.value)
    assert "head_dim 64" in str(e.value)
