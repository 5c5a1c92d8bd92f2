"""Shared fixtures: tiny random checkpoints written by transformers itself.

Each checkpoint is built with a transformers model class, its weights randomised with a spread
large enough that a wrong norm, bias or RoPE moves the logits well past the tolerances, then
written with `save_pretrained` (transformers 5 writes `rope_parameters`, not `rope_theta`) plus
a small byte-level BPE tokenizer trained here with `tokenizers`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Parity bounds are measured against float32 references on the CPU; tests that need a GPU
# (test_device.py) ask for it themselves.
os.environ.setdefault("MLXLIS_DEVICE", "cpu")

import mlxlis  # noqa: E402,F401  (preloads the BLAS before anything imports mlx.core)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, world! 1234567890\n"
    "def add(a, b):\n    return a + b\n"
    "Émile a vu un cœur brûlé. 日本語のテキスト。 Привет, мир! 🙂🚀 naïve café\n"
) * 20

TINY = {
    # GQA, untied head, transformers-5 rope_parameters with a non-default θ
    "llama": dict(
        kind="llama",
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=100000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
    # a long context: replies that run long enough to be stopped (the chat process tests)
    "llama_long": dict(
        kind="llama",
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=1 << 17,
    ),
    # tied head + Llama 3 RoPE scaling
    "llama3_tied": dict(
        kind="llama",
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k/v bias, tied
    "qwen2": dict(
        kind="qwen2",
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
}


def train_tokenizer(
    folder: Path,
    vocab_size: int = 400,
    *,
    extra_special: tuple[str, ...] = (),
    corpus: tuple[str, ...] = (CORPUS,),
) -> int:
    """A byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json); returns its size.
    `extra_special` are added special tokens after the three ChatML ones (ids 3, 4, ...);
    `corpus` the texts it is trained on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    fast.save_pretrained(folder)
    return len(fast)


def randomize(model, seed: int = 0) -> None:
    """Spread the weights: matrices N(0, 0.08), norms 1 + N(0, 0.1), biases N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)


# transformers model types whose text-only config has another name
TEXT_KINDS = {"gemma3": "gemma3_text"}


def build_tiny(
    folder: Path,
    spec: dict,
    seed: int = 0,
    tokenizer_kw: dict | None = None,
    adjust=None,
    pad_vocab: int = 0,
    **config_kw,
):
    """Write a tiny random checkpoint of `spec` ("kind": a transformers model type, the rest
    config keys) to `folder`; returns the transformers model (fp32, eval). `tokenizer_kw` go
    to train_tokenizer; `adjust(model)` changes weights after randomize (before saving);
    `pad_vocab`: rows of embedding and head past the tokenizer's ids (Qwen2.5 has 271)."""
    import torch
    import transformers

    spec = dict(spec)
    kind = spec.pop("kind")
    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder, **(tokenizer_kw or {}))
    cfg = transformers.AutoConfig.for_model(
        TEXT_KINDS.get(kind, kind),
        vocab_size=vocab + pad_vocab,
        bos_token_id=0,
        eos_token_id=2,
        **config_kw,
        **spec,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed)
    if adjust is not None:
        adjust(model)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)
    return model


def tiny_models(tmp_path_factory, specs: dict[str, dict], build=build_tiny):
    """get(name) -> (folder, transformers model) of specs[name], built once."""
    built: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            built[name] = (folder, build(folder, specs[name]))
        return built[name]

    return get


def loaded_models(tmp_path_factory, specs: dict[str, dict], builders: dict | None = None):
    """load(name) -> the float32 Model of specs[name] (written by builders[its kind], else
    build_tiny), each written and loaded once."""
    import mlxlis

    builders = builders or {}
    get = tiny_models(
        tmp_path_factory,
        specs,
        build=lambda folder, spec: builders.get(spec.get("kind"), build_tiny)(folder, spec),
    )
    loaded: dict[str, object] = {}

    def load(name: str):
        if name not in loaded:
            loaded[name] = mlxlis.load(get(name)[0], "float32")
        return loaded[name]

    return load


@pytest.fixture(autouse=True)
def settings_follow_the_environment(monkeypatch) -> Iterator[None]:
    """mlxlis reads its variables once (mlxlis.settings) and chooses its backend once: a test's
    monkeypatch.setenv/delenv makes both be read again at their next use, as does its end
    (when monkeypatch has put the environment back)."""
    from mlxlis.runtime import backend
    from mlxlis.settings import reload

    def again() -> None:
        reload()
        backend.reset()

    for name in ("setenv", "delenv"):
        change = getattr(monkeypatch, name)

        def changed(*args, _change=change, **kwargs) -> None:
            _change(*args, **kwargs)
            again()

        setattr(monkeypatch, name, changed)
    yield
    again()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> (folder, transformers model) of TINY[name]; built once per session."""
    return tiny_models(tmp_path_factory, TINY)


@pytest.fixture(scope="session")
def tiny_server(tiny, tmp_path_factory):
    """`mlxlis serve` on the tiny "llama_long" (serve_process.tiny_server): one process for
    every API's tests."""
    from serve_process import tiny_server as start

    srv = start(tiny("llama_long")[0], tmp_path_factory.mktemp("serve"))
    yield srv
    assert srv.stop() == 0, srv.log()


# Prefix for a child Python that a test interrupts with SIGINT: a shell that starts a job in
# the background makes it ignore SIGINT, and Python then installs no KeyboardInterrupt handler.
CTRL_C_CHILD = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


def check_config_refused(folder, tmp_path, change: dict, error: type, field: str) -> None:
    """A copy of the checkpoint `folder` with `change` merged into config.json is refused
    with `error`, an MlxlisError naming config.json and `field`."""
    import json
    import shutil

    import mlxlis
    from mlxlis.errors import MlxlisError

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(error) as e:
        mlxlis.load(bad, "float32")
    assert isinstance(e.value, MlxlisError)
    assert e.value.field == field and "config.json" in str(e.value), str(e.value)


def check_cached_decode(model, ids: list[int], full, bound: float) -> None:
    """Self-consistency: a prefill in two chunks (9, then 11 tokens), then token-by-token
    decode with the caches, gives the full forward's logits `full` for the decoded tokens."""
    import mlx.core as mx
    import numpy as np

    cache = model.make_cache()
    model.net(mx.array([ids[:9]]), cache)
    model.net(mx.array([ids[9:20]]), cache)
    steps = [np.array(model.net(mx.array([[t]]), cache)[0, -1]) for t in ids[20:]]
    assert np.abs(np.stack(steps) - full[20:]).max() < bound


def check_batched_decode(model, ids: list[int], at: int, bound: float) -> None:
    """Self-consistency: two sequences at different offsets (ids[:at] and ids[3:13]) each
    decoding one more token together (decode_batch) give the logits of each alone."""
    import mlx.core as mx
    import numpy as np

    a, b = model.make_cache(), model.make_cache()
    model.net(mx.array([ids[:at]]), a)
    model.net(mx.array([ids[3:13]]), b)
    both = np.array(model.net.decode_batch(mx.array([ids[at], ids[13]]), [a, b]))
    assert np.abs(both[0] - np.array(model.logits(ids[: at + 1]))[-1]).max() < bound
    assert np.abs(both[1] - np.array(model.logits(ids[3:14]))[-1]).max() < bound


def check_speculation_and_engine(model) -> None:
    """Self-consistency of speculation and batching: greedy n-gram speculation (proposals
    verified, some rejected, the caches trimmed) gives the plain greedy tokens; 4 requests of
    different lengths in the serving engine (two speculating, their verification batched; two
    plain, in the batched decode step) each get their lone tokens."""
    from mlxlis.generation.core import Request
    from mlxlis.generation.engine import Engine
    from mlxlis.generation.sampling import SamplingParams
    from mlxlis.generation.speculative import Speculation

    vocab = model.config.vocab_size
    prompt = (trajectory(12, seed=3, vocab=vocab) * 4)[:40]
    plain, _ = greedy_tokens(model, prompt, 24)
    got, seq = greedy_tokens(model, prompt, 24, Speculation("ngram", tokens=4))
    assert got == plain and len(plain) == 24 and seq.usage.draft_tokens > 0
    prompts = [prompt[: 24 + 5 * i] for i in range(4)]
    specs = [Speculation("ngram", tokens=3), None, Speculation("ngram", tokens=4), None]
    params = SamplingParams(max_tokens=16)
    engine = Engine(model, max_active=4, prefix_cache_bytes=0)
    try:
        streams = [
            engine.submit(Request(p, params, speculation=s))
            for p, s in zip(prompts, specs, strict=True)
        ]
        events = [[e.token for e in st if e.token is not None] for st in streams]
    finally:
        engine.shutdown()
    assert events == [greedy_tokens(model, p, 16)[0] for p in prompts]


def check_rewinds(model, state_check=None) -> None:
    """Self-consistency of a recurrent family's rewind: a verification of 1 + 5 tokens after a
    70-token prompt, trimmed back to its first 1 + j, leaves every cache as a verification of
    those 1 + j tokens only (offsets equal; conv and recurrent states within 1e-5;
    `state_check(cache)` asserts the family's state shapes), and so the next step's logits
    (bound 1e-5: fewer rows take other matmul kernels)."""
    from mlxlis.cache import RecurrentCache
    from mlxlis.generation.steps import StepKind, forward, prefill

    import mlx.core as mx
    import numpy as np

    vocab = model.config.vocab_size
    prompt = trajectory(70, seed=7, vocab=vocab)
    step = trajectory(6, seed=8, vocab=vocab)
    k = len(step) - 1
    for j in range(k + 1):
        caches, ref = model.make_cache(), model.make_cache()
        prefill(model.net, prompt, caches)
        prefill(model.net, prompt, ref)
        forward(model.net, [caches], mx.array(step, mx.int32), StepKind.VERIFY)
        assert all(c.trim(k - j) == k - j for c in caches)
        forward(model.net, [ref], mx.array(step[: j + 1], mx.int32), StepKind.VERIFY)
        for a, b in zip(caches, ref, strict=True):
            assert a.offset == b.offset == len(prompt) + j + 1
            if isinstance(a, RecurrentCache):
                if state_check is not None:
                    state_check(a)
                pairs = [(a.conv_state, b.conv_state)]
                if a.recurrent is not None:
                    pairs.append((a.recurrent, b.recurrent))
                for x, y in pairs:
                    assert np.abs(np.array(x) - np.array(y)).max() < 1e-5, j
        after = mx.array([step[0]], mx.int32)
        got = forward(model.net, [caches], after, StepKind.DECODE)
        want = forward(model.net, [ref], after, StepKind.DECODE)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5, j


def check_prefix_reuse(model, tmp_path) -> None:
    """Turn 1 (60 tokens, a snapshot at 50) kept by a prefix cache with a disk tier; turn 2
    shares its first 50: the cache returns there (recurrent states from their snapshot), from
    memory and, after a restart, from the file — the logits of the rest bit for bit equal,
    and equal to a cold prefill up to the chunking's rounding (bound 1e-4)."""
    from mlxlis.cache.disk import DiskCache
    from mlxlis.cache.prefix import PrefixCache
    from mlxlis.cache.rewind import snapshot

    import mlx.core as mx
    import numpy as np

    vocab = model.config.vocab_size
    one = trajectory(60, seed=1, vocab=vocab)
    two = one[:50] + trajectory(30, seed=2, vocab=vocab)
    warns: list[str] = []

    def tier():
        disk = DiskCache(tmp_path, 1 << 30, "fp", model.make_cache, warns.append)
        return PrefixCache(1 << 30, disk=disk)

    first = tier()
    caches = model.make_cache()
    model.net(mx.array([one[:50]]), cache=caches)
    snapshot(caches)
    mx.eval(model.net(mx.array([one[50:]]), cache=caches))
    first.put(one, caches)
    outs = []
    for cache in (first, tier()):  # the second: a restart, nothing in memory
        kept, reused = cache.take(two, None)
        assert reused == 50
        outs.append(np.array(model.net(mx.array([two[50:]]), cache=kept)[0, -1]))
    assert "read from disk" in cache.note and warns == []
    assert np.array_equal(outs[0], outs[1])
    cold = np.array(model.net(mx.array([two]), cache=model.make_cache())[0, -1])
    assert np.abs(outs[0] - cold).max() < 1e-4


def greedy_tokens(model, prompt: list[int], n: int, spec=None):
    """(the greedy tokens of `prompt` through a core of its own, speculating with `spec` or
    plainly, its sequence): what speculation's greedy identity compares."""
    from mlxlis.cache.prefix import PrefixCache
    from mlxlis.generation.core import Core, Request
    from mlxlis.generation.generate import run
    from mlxlis.generation.sampling import SamplingParams
    from mlxlis.generation.steps import steps_for

    core = Core(model, steps_for(model, PrefixCache(0)))
    seq = core.start(Request(prompt, SamplingParams(max_tokens=n), frozenset(), speculation=spec))
    return [e.token for e in run(core, seq) if e.token is not None], seq


def dequantized_folder(folder: Path) -> dict[str, np.ndarray]:
    """An MLX-quantized folder's tensors (model.safetensors) in float32, each quantized weight
    dequantized as its config.json's quantization says (a module's own group size and bits
    where the block names it: mlx-lm's 8-bit routers): the weights a reference runs on."""
    import json

    import mlx.core as mx

    tensors = mx.load(str(folder / "model.safetensors"))
    q = json.loads((folder / "config.json").read_text())["quantization"]
    dense = {}
    for name, w in tensors.items():
        stem = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if name.endswith(".weight") and f"{stem}.scales" in tensors:
            own = q.get(stem) if isinstance(q.get(stem), dict) else q  # a per-module override
            w = mx.dequantize(
                w,
                tensors[f"{stem}.scales"],
                tensors[f"{stem}.biases"],
                own["group_size"],
                own["bits"],
            )
        dense[name] = np.array(w.astype(mx.float32))
    return dense


def trajectory(n: int = 72, seed: int = 1, vocab: int = 400) -> list[int]:
    """A fixed pseudo-random token trajectory (the same ids fed to both implementations)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- real catalog models, each reference built once per session -----------------------------
# Several test modules compare against the same references; building each once keeps the suite
# fast without dropping a comparison.

_SHARED = Path(tempfile.mkdtemp(prefix="mlxlis-test-shared-"))
atexit.register(shutil.rmtree, _SHARED, ignore_errors=True)


def need_pulled(name: str) -> Path:
    from mlxlis.loading import catalog

    if not catalog.is_pulled(name):
        pytest.skip(f"{name} not pulled (make models)")
    return catalog.model_path(name)


REAL_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
NEEDS_HF_REFERENCES = ("test_gguf_models.py", "test_tokenizer.py")
_references: subprocess.Popen | None = None
REFERENCE_TIMEOUT_S = 1800.0


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only for tests that will run
def pytest_collection_modifyitems(session, config, items) -> None:
    """Start building transformers' references in the background (tests/hf_references.py)
    when tests that compare against them were selected; the session runs on beside it."""
    global _references
    from mlxlis.loading import catalog

    if not any(Path(str(item.fspath)).name in NEEDS_HF_REFERENCES for item in items):
        return
    names = [n for n in REAL_MODELS if catalog.is_pulled(n)]
    if names:
        script = Path(__file__).with_name("hf_references.py")
        log = open(_SHARED / "hf-references.log", "wb")  # noqa: SIM115 — the child's stderr
        _references = subprocess.Popen(
            [sys.executable, str(script), str(_SHARED), *names],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def pytest_unconfigure(config) -> None:
    if _references is not None and _references.poll() is None:
        _references.kill()
        _references.wait()


def _wait_for(path: Path, name: str) -> Path:
    """A reference file of the background builder, built here if no builder runs."""
    import hf_references

    if _references is None:
        hf_references.build(_SHARED, name)
    failed = _SHARED / f"failed-{name}.json"
    deadline = time.monotonic() + REFERENCE_TIMEOUT_S
    while not path.exists() and not failed.exists():
        if _references.poll() is not None:
            break
        if time.monotonic() > deadline:  # a hang guard, not a speed check
            _references.kill()
            log = (_SHARED / "hf-references.log").read_text(errors="replace")[-2000:]
            pytest.fail(f"the reference builder hung on {name}:\n{log}")
        time.sleep(0.2)
    if failed.exists():
        pytest.fail(f"transformers' reference for {name} failed: {failed.read_text()}")
    if not path.exists():
        log = (_SHARED / "hf-references.log").read_text(errors="replace")[-2000:]
        pytest.fail(f"the reference builder ended without {path.name}:\n{log}")
    return path


def hf_gguf_tokenizer_dir(name: str) -> Path:
    """transformers' own GGUF-built tokenizer for a catalog model, saved with save_pretrained
    (its GGUF conversion takes 4-19 s; loading the saved folder, well under a second)."""
    import hf_references

    need_pulled(name)
    return _wait_for(hf_references.tokenizer_dir(_SHARED, name), name)


def hf_logits(name: str) -> tuple[list[int], np.ndarray]:
    """(ids, transformers' float32 logits) for hf_references.PROMPT, ids from mlxlis' GGUF
    tokenizer."""
    import hf_references

    need_pulled(name)
    with np.load(_wait_for(hf_references.logits_file(_SHARED, name), name)) as z:
        return z["ids"].tolist(), z["logits"]


@functools.cache
def gguf_py_reader(name: str):
    """gguf-py's GGUFReader on a catalog model (an independent reader: 3-12 s on these files)."""
    from gguf import GGUFReader

    return GGUFReader(need_pulled(name))


@functools.cache
def real_quantized(name: str):
    """mlxlis.load(name, float32, quantized blocks kept): the form the parity tests check."""
    need_pulled(name)
    return mlxlis.load(name, "float32", dequantize=False)


@contextlib.contextmanager
def memory_bound(limit: int, what: str = "") -> Iterator[None]:
    """Assert the Python (and numpy) memory allocated inside the block peaks below `limit`
    bytes: a work bound that, unlike a wall-clock limit, does not depend on the machine or on
    what else runs on it. A parser that expanded a bomb or read a huge file would cross it."""
    import tracemalloc

    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if not was_tracing:
            tracemalloc.stop()
    assert peak < limit, f"{what}: peak {peak / 2**20:.1f} MiB over {limit / 2**20:.1f} MiB"


def llama_cpp_reference(relpath: str) -> Path:
    """A file of llama.cpp's `models/` folder (official chat templates, tokenizer test
    vocabularies), fetched by scripts/fetch_references.py (`make test` runs it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from fetch_references import reference_dir

    path = reference_dir() / relpath
    if not path.is_file():
        pytest.skip(f"{relpath}: llama.cpp references not fetched (scripts/fetch_references.py)")
    return path


def add_bpe_tokenizer(w, folder: Path, cfg) -> None:
    """The tiny folder's byte-level BPE vocabulary as GGUF `tokenizer.ggml.*` metadata, on a
    gguf-py GGUFWriter `w` (what llama.cpp's converter writes for a gpt2-style vocabulary)."""
    import json

    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in vocab] + [t for t in specials if t not in tok["model"]["vocab"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


def add_gguf_sizes(w, cfg) -> None:
    """The size keys every llama.cpp converter writes, from a transformers config."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
