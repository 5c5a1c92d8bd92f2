"""Speculative decoding (mlxlis/generation/speculative.py, the core's `_verify`).

What is proved here:
- greedy identity: with prompt lookup and with a draft model, the tokens are those of plain
  greedy decoding, on a tiny model of every cache kind (full attention, sliding-window rings
  past their window, recurrent Gated DeltaNet layers past their chunk size, Gemma 4's KV-shared
  layers), with proposals kept and rejected along the way (self-consistency against the plain
  path, which the parity tests tie to transformers);
- rewind: after a verification rejected at each position 0..k, every cache (KV, ring,
  recurrent) holds bit for bit what feeding only the kept tokens builds;
- distribution: the verdict (ratio test, residual, bonus) gives tokens distributed as the
  target's filtered distribution (temperature 1, top-p 0.9), whatever the draft proposes
  (numpy float64 reference, binomial bounds as test_sampling.py);
- batching: requests that speculate (lookup, a draft model) and plain ones decode together in
  the serving engine, each with its lone greedy tokens;
- refusals: a draft model of another vocabulary, a bad draft length, an unknown kind.
"""

from __future__ import annotations

import re

import mlxlis
from mlxlis.cache import KVCache, RecurrentCache, RotatingKVCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core, Request
from mlxlis.generation.engine import Engine
from mlxlis.generation.generate import run
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import (
    Drafter,
    Judge,
    Proposal,
    Speculation,
    SpeculativeError,
    check_vocabulary,
)
from mlxlis.generation.steps import StepKind, forward, prefill, steps_for

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, build_tiny, loaded_models, trajectory
from test_gemma4 import SPECS as GEMMA4
from test_gemma4 import build as build_gemma4
from test_gemma_parity import SPECS as GEMMA
from test_qwen3 import SPECS as QWEN3
from test_qwen3_5 import SPECS as QWEN35
from test_qwen3_5 import build as build_qwen35
from test_sampling import binomial_bound, softmax64

SPECS = {
    "llama": TINY["llama"],
    "qwen2": TINY["qwen2"],
    "gemma2": {"kind": "gemma2", "pad_token_id": 0, **GEMMA["gemma2"]},  # softcaps, window 8
    "gemma3": {"kind": "gemma3", "pad_token_id": 0, **GEMMA["gemma3"]},  # window 8
    "qwen3_5": QWEN35["qwen3_5"],  # L L L F, chunk 64
    "qwen3_moe": QWEN3["qwen3_moe"],  # q/k norms, routed experts on the verified tokens
    "qwen3_5_moe": QWEN35["qwen3_5_moe"],
    "gemma4": {"kind": "gemma4_text", **GEMMA4["e2b"]},  # rings + KV-shared layers
    "draft": TINY["llama3_tied"],  # another network of the same vocabulary
}
BUILD = {"qwen3_5_text": build_qwen35, "gemma4_text": build_gemma4}  # by kind
PROMPT = 80  # tokens: past Gemma's window (8) and the DeltaNet's chunk (64)
NEW = 120


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return loaded_models(tmp_path_factory, SPECS, BUILD)


def tokens_of(model, prompt, spec=None, **params):
    """The generated ids of `prompt` through the core alone, and the sequence (its counts)."""
    core = Core(model, steps_for(model, PrefixCache(0)))
    req = Request(
        list(prompt), SamplingParams(max_tokens=NEW, **params), frozenset(), speculation=spec
    )
    seq = core.start(req)
    out = [e.token for e in run(core, seq) if e.token is not None]
    return out, seq


def looping_prompt(vocab: int) -> list[int]:
    """A prompt that repeats itself (prompt lookup finds continuations in it)."""
    part = trajectory(20, seed=3, vocab=vocab)
    return (part * 5)[:PROMPT]


# one model of each cache kind in `make test`; the other families in `make test-all`
CACHE_KINDS = ("llama", "gemma3", "qwen3_5", "gemma4")
FAMILIES = [
    n if n in CACHE_KINDS else pytest.param(n, marks=pytest.mark.extended)
    for n in SPECS
    if n != "draft"
]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_speculation_gives_the_plain_greedy_tokens(models, name):
    """Prompt lookup and a draft model (another tiny Llama of the same vocabulary), 4
    proposals a step: the plain greedy tokens. How many proposals are kept is the model's
    business here (a tiny model that loops keeps every lookup); the drafter below with
    proposals wrong at known positions pins the kept count on every cache kind."""
    model, draft = models(name), models("draft")
    prompt = looping_prompt(model.config.vocab_size)
    plain, _ = tokens_of(model, prompt)
    assert len(plain) == NEW
    for spec in (Speculation("ngram", tokens=4), Speculation("draft", draft, tokens=4)):
        got, seq = tokens_of(model, prompt, spec)
        assert got == plain, spec.kind
        assert seq.usage.draft_tokens > 0, (spec.kind, seq.usage)


class Corrupted(Drafter):
    """A drafter that knows the plain greedy sequence `truth` and proposes it with one token
    wrong, at position (its call count mod k + 1) of each proposal: a verification must keep
    exactly the proposals before that one (all of them when it falls past the end)."""

    wants_hidden = False

    def __init__(self, truth: list[int], vocab: int):
        self.truth, self.vocab = truth, vocab
        self.calls: list[tuple[int, int]] = []  # (sequence length, proposals it should keep)

    def propose(self, history, k):
        n = len(history)
        assert list(history) == self.truth[:n]  # the sequence so far is the plain one
        tokens = list(self.truth[n : n + k])
        wrong = len(self.calls) % (k + 1)
        if wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % self.vocab
        self.calls.append((n, min(wrong, len(tokens))))
        return Proposal(tokens)


@pytest.mark.parametrize(
    "name", [*CACHE_KINDS, pytest.param("qwen3_5_moe", marks=pytest.mark.extended)]
)
def test_each_verification_keeps_exactly_the_agreeing_proposals(models, name):
    """With proposals wrong at a known position, each verification keeps exactly those before
    it (the next step starts 1 + kept tokens later: the pending token, the kept proposals;
    the target's own token replaces the wrong one) and the output is the plain greedy one."""
    model = models(name)
    vocab = model.config.vocab_size
    prompt = trajectory(PROMPT, seed=9, vocab=vocab)
    plain, _ = tokens_of(model, prompt)
    drafter = Corrupted(prompt + plain, vocab)
    got, seq = tokens_of(model, prompt, Speculation("custom", tokens=4, make=lambda _: drafter))
    assert got == plain
    calls = drafter.calls
    assert len(calls) > 10 and {c[1] for c in calls[:-1]} == {0, 1, 2, 3, 4}
    for (n, keep), (n_next, _) in zip(calls, calls[1:], strict=False):
        assert n_next - n == 1 + keep, (n, keep, n_next)
    assert seq.usage.accepted_tokens >= sum(keep for _, keep in calls[:-1])


def test_a_draft_of_the_target_itself_is_always_kept(models):
    """The target drafting for itself: every proposal kept (each verification gives k + 1
    tokens: the bonus token included), the plain greedy tokens."""
    model = models("qwen3_5")
    prompt = trajectory(PROMPT, seed=5, vocab=model.config.vocab_size)
    plain, _ = tokens_of(model, prompt)
    got, seq = tokens_of(model, prompt, Speculation("draft", model, tokens=3))
    assert got == plain
    assert seq.usage.accepted_tokens == seq.usage.draft_tokens > NEW // 2


def cache_arrays(c) -> list[np.ndarray]:
    """What a cache holds that later steps read: KV positions, a ring's newest window − 1
    positions (oldest first), a recurrent layer's convolution and state."""
    if isinstance(c, RecurrentCache):
        return [np.array(c.conv_state), np.array(c.recurrent)]
    if isinstance(c, RotatingKVCache):
        k, v = c._ordered()
        n = c.window - 1
        assert k.shape[2] >= n  # a ring always holds what its next query needs
        return [np.array(k[..., -n:, :]), np.array(v[..., -n:, :])]
    assert isinstance(c, KVCache)
    return [np.array(c.keys[..., : c.offset, :]), np.array(c.values[..., : c.offset, :])]


def same(x: np.ndarray, y: np.ndarray, exact: bool) -> bool:
    return bool(np.array_equal(x, y) if exact else np.abs(x - y).max() <= 1e-5)


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_5"])
def test_a_rejection_at_each_position_rewinds_every_cache_exactly(models, name):
    """A verification of 1 + k tokens trimmed back to its first 1 + j (a rejection at
    position j): every cache equals, bit for bit, the cache of a verification of those 1 + j
    tokens only, and so do the next step's logits — where the two forwards run the same
    kernels. Measured exceptions, bounded at 1e-5: for j = 0 the reference is one row, a
    matrix-vector product (another kernel): caches within 2.2e-6, logits 2e-6; for j = 1, 2
    its 2 or 3 rows take another of OpenBLAS's sgemm kernels than the 6 rows' (on the Linux
    wheel; the bundled BLAS is exact there): within 9.6e-7; after a
    ring's rewind its slots are in another order, the next query's sum reordered: logits
    within 2e-6."""
    model = models(name)
    vocab = model.config.vocab_size
    prompt = trajectory(PROMPT, seed=7, vocab=vocab)
    step = trajectory(6, seed=8, vocab=vocab)  # the pending token, then k = 5 proposals
    k = len(step) - 1
    kinds = set()
    for j in range(k + 1):
        caches = model.make_cache()
        prefill(model.net, prompt, caches)
        forward(model.net, [caches], mx.array(step, mx.int32), StepKind.VERIFY)
        assert all(c.trim(k - j) == k - j for c in caches)
        ref = model.make_cache()
        prefill(model.net, prompt, ref)
        forward(model.net, [ref], mx.array(step[: j + 1], mx.int32), StepKind.VERIFY)
        exact = j > 2  # see above: fewer rows, other kernels
        for a, b in zip(caches, ref, strict=True):
            kinds.add(type(a).__name__)
            assert a.offset == b.offset == PROMPT + j + 1
            for x, y in zip(cache_arrays(a), cache_arrays(b), strict=True):
                assert same(x, y, exact), (j, type(a).__name__)
        after = mx.array([step[0]], mx.int32)
        got = forward(model.net, [caches], after, StepKind.DECODE)
        want = forward(model.net, [ref], after, StepKind.DECODE)
        assert same(np.array(got), np.array(want), exact and name != "gemma3"), j
    want_kinds = {"llama": {"KVCache"}, "gemma3": {"KVCache", "RotatingKVCache"}}
    assert kinds == want_kinds.get(name, {"KVCache", "RecurrentCache"})


# --------------------------------------------------------------- the verdict's distribution

VOCAB = 8
TARGET = np.array([2.0, 1.2, 0.9, 0.5, 0.0, -0.3, -1.0, -2.0])  # the target's logits
DRAFT = np.array([-1.0, 0.5, 2.0, 0.0, 1.0, 0.2, 0.0, -2.0])  # a draft that disagrees
N = 4000


def filtered_target() -> np.ndarray:
    """softmax(logits / 1) restricted to the top-p 0.9 set, renormalised (numpy float64)."""
    p = softmax64(TARGET)
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(VOCAB, bool)
    keep[order[before < 0.9]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_kept_or_replaced_tokens_follow_the_target_distribution(drafter):
    """N verdicts on one position, each on a fresh proposal: a draft model's sample from q,
    or a lookup's fixed token (q a point mass); the token that results (the proposal when kept,
    else the residual's draw) has the target's top-p distribution within Z binomial standard
    errors — and the draft's own distribution is far outside them (the test would notice a
    verdict that keeps proposals without the ratio test)."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    judge = Judge(params)
    row = mx.array(TARGET[None].astype(np.float32))
    q64 = softmax64(DRAFT)
    q = mx.array(q64.astype(np.float32))
    rng = np.random.default_rng(2)
    out = []
    for _ in range(N):
        if drafter == "model":
            d = int(rng.choice(VOCAB, p=q64))
            got = judge.check(row, d, q)
        else:
            d = 2
            got = judge.check(row, d, None)
        out.append(d if got is None else got)
    f = np.bincount(out, minlength=VOCAB) / N
    p = filtered_target()
    assert np.all(np.abs(f - p) <= binomial_bound(p, N)), (f, p)
    wrong = q64 if drafter == "model" else np.eye(VOCAB)[2]
    assert np.any(np.abs(wrong - p) > binomial_bound(p, N) + binomial_bound(wrong, N))


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3"])
def test_batched_speculation_gives_each_request_its_lone_tokens(models, name):
    """8 requests in the serving engine: two with prompt lookup, two with a draft model, four
    plain, decoding together (the speculating ones verified in one batched forward, their rows
    padded to the longest; the plain ones in the batched decode step); each gets the tokens it
    gets alone without speculation. A hybrid (recurrent + attention) and a sliding-window
    model."""
    model, draft = models(name), models("draft")
    vocab = model.config.vocab_size
    prompts = [looping_prompt(vocab)[: 30 + 5 * i] for i in range(8)]
    specs = [
        Speculation("ngram", tokens=3),
        Speculation("draft", draft, tokens=2),
        None,
        None,
        Speculation("ngram", tokens=5),
        Speculation("draft", draft, tokens=4),
        None,
        None,
    ]
    params = SamplingParams(max_tokens=24)
    engine = Engine(model, max_active=8, prefix_cache_bytes=0)
    try:
        streams = [
            engine.submit(Request(p, params, speculation=s))
            for p, s in zip(prompts, specs, strict=True)
        ]
        events = [list(st) for st in streams]
    finally:
        engine.shutdown()
    want = [
        [e.token for e in mlxlis.generate(model, p, params, stop_ids=set()) if e.token is not None]
        for p in prompts
    ]
    assert [[e.token for e in evs if e.token is not None] for evs in events] == want
    for evs, spec in zip(events, specs, strict=True):  # the speculating ones did speculate
        assert (evs[-1].usage.draft_tokens > 0) == (spec is not None)


def test_refusals_name_the_field(models, tmp_path):
    """A bad draft length or kind, a missing draft model, and a draft of another vocabulary
    are refused before anything runs, naming the field."""
    for kw, field in (
        (dict(kind="ngram", tokens=0), "draft_tokens"),
        (dict(kind="ngram", tokens=17), "draft_tokens"),
        (dict(kind="mtp2"), "speculative"),
        (dict(kind="draft"), "draft_model"),
    ):
        with pytest.raises(SpeculativeError) as e:
            Speculation(**kw)
        assert e.value.field == field
    other = tmp_path / "other"
    build_tiny(other, TINY["llama"], tokenizer_kw={"extra_special": ("<|tool|>",)})
    with pytest.raises(SpeculativeError, match="not one vocabulary") as e:
        check_vocabulary(models("llama"), mlxlis.load(other, "float32"))
    assert e.value.field == "draft_model"


# ------------------------------------------------------------------------------ surfaces

COPYING = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


def test_the_one_shot_command_speculates_with_the_same_text(tiny):
    """`mlxlis --speculative ngram --draft-tokens 2 -v` prints what the plain command prints,
    and its --verbose line says how many drafted tokens were kept; flags that do not go
    together are refused (exit 2) naming the flag."""
    import subprocess
    import sys

    folder = tiny("llama_long")[0]
    base = [sys.executable, "-m", "mlxlis", "-m", str(folder), "--no-chat", "--max-tokens", "40"]

    def mlxlis_run(*extra: str):
        return subprocess.run([*base, *extra, COPYING], capture_output=True, text=True, timeout=300)

    plain = mlxlis_run()
    spec = mlxlis_run("--speculative", "ngram", "--draft-tokens", "2", "-v")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert re.search(r"speculative: ngram: \d+/\d+ drafted tokens kept .*, k 2,", spec.stderr)
    bad = mlxlis_run("--speculative", "draft")
    assert bad.returncode == 2 and "--speculative draft: needs --draft-model" in bad.stderr


def test_the_server_speculates_with_the_same_tokens(tiny, tiny_server, tmp_path):
    """A real `mlxlis serve --speculative ngram --draft-tokens 3`, through the official openai
    client: a greedy completion equal to the plain server's (the session's tiny server, the
    same model), and a per-request log line with the drafted tokens kept."""
    from serve_process import ServeProcess

    srv = ServeProcess(
        tmp_path,
        "-m",
        str(tiny("llama_long")[0]),
        "--speculative",
        "ngram",
        "--draft-tokens",
        "3",
        "--verbose",
    )
    try:
        kw = dict(prompt=COPYING, max_tokens=40, temperature=0)
        got = srv.client().completions.create(model=srv.model, **kw)
        want = tiny_server.client().completions.create(model=tiny_server.model, **kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens == 40
        srv.log_line(rf"{got.id} speculative ngram: \d+/\d+ drafted tokens kept")
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_served_draft_model_counts_in_its_targets_memory(tiny, tmp_path):
    """`mlxlis serve --speculative draft --draft-model`: the draft model is held with its
    target, so what the target holds (/api/ps' size: what the pool counts against the budget)
    is the target's weights, the draft's and the prefix cache's bound (self-consistency of the
    accounting, the weights as /health reports them)."""
    from serve_process import ServeProcess

    folder = str(tiny("llama_long")[0])
    srv = ServeProcess(
        tmp_path, "-m", folder, "--speculative", "draft", "--draft-model", folder,
        "--prefix-cache-mb", "1",
    )  # fmt: skip
    try:
        size = srv.request("GET", "/api/ps")[1]["models"][0]["size"]
        weights = srv.request("GET", "/health")[1]["weights_bytes"]
        assert size == 2 * weights + (1 << 20)
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_constrained_draft_proposes_under_the_grammar(models):
    """A regex-constrained reply with the target drafting for itself: the plain constrained
    greedy tokens, and every proposal kept — the draft proposes under a copy of the request's
    mask (advanced by its drafted tokens only), so it never proposes what the grammar forbids,
    while the request's own mask follows the kept tokens (unmasked, the tiny model's free
    choice is rarely a digit and most proposals would be rejected)."""
    from mlxlis.generation.generate import constraint_for

    model = models("llama")
    stops = frozenset(model.stop_ids())
    fmt = {"type": "regex", "regex": "[0-9]{200}"}  # longer than the reply: no stop to pass
    prompt = trajectory(12, seed=13, vocab=model.config.vocab_size)

    def constrained(spec):
        core = Core(model, steps_for(model, PrefixCache(0)))
        mask = constraint_for(model, fmt, stops)
        req = Request(
            prompt, SamplingParams(max_tokens=40), stops, processors=(mask,), speculation=spec
        )
        seq = core.start(req)
        return "".join(e.text for e in run(core, seq)), seq.usage

    plain, _ = constrained(None)
    got, usage = constrained(Speculation("draft", model, tokens=4))
    assert got == plain and len(plain) >= 24 and plain.isdigit()
    assert usage.draft_tokens > 0 and usage.accepted_tokens == usage.draft_tokens, usage


def test_ids_past_the_drafts_vocabulary_are_read_as_another(models):
    """A target's ids the draft has no embedding for (a multimodal Gemma 3's image
    placeholders, past a smaller draft's rows) are read as id 0: the draft proposes as for
    that prompt, where an unguarded lookup reads past its table. Self-consistency."""
    from mlxlis.generation.sampling import SamplingParams
    from mlxlis.generation.speculative import ModelDrafter

    draft = models("llama")
    rows = draft.config.vocab_size
    params = SamplingParams(temperature=0)
    prompt = [5, 6, rows + 100, rows + 7, 9]
    got = ModelDrafter(draft, params).propose(prompt, 3).tokens
    want = ModelDrafter(draft, params).propose([5, 6, 0, 0, 9], 3).tokens
    assert got == want
