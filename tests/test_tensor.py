"""Tensor parallelism (mlxlis/distributed/tensor.py) with MLX's ring backend over loopback:
every rank holds a slice of every layer (heads, MLP rows, expert rows, vocabulary) and works on
every token.

Proves, against a lone process loading the same file (its float32 forward is the reference,
itself proved against transformers / llama.cpp in test_llama_parity.py, test_qwen3.py and
test_gguf_models.py), over 2 ranks (64 greedy tokens) on a tiny Llama (4 query heads on 2 KV
heads, untied head), a tiny Qwen3 (q/k norms, 4 query heads on 1 KV head: the KV head
replicated on both ranks; a tied head), a tiny Qwen3-MoE (top-2 of 8 experts, one dense
layer: every expert's rows split, the router replicated) and mlx-lm's 4-bit conversion of a
tiny Llama (groups of 32: quantized layers and embedding sliced as stored); over 3 ranks (8
tokens, make test-all) on the real SmolLM2 GGUF (Q4_1 blocks sliced as stored, tied head; its
9 heads on 3 KV heads split over 3 ranks, not 2); over 4 ranks (16 tokens, make test-all) on
the tiny Llama (each KV head on 2 ranks) and Qwen3-MoE, and the tiny Llama as 2 pipeline
stages of a tensor pair each (2 × 2):
- each step's float32 logits agree with the lone process's within 1e-5 relative to the step's
  largest logit: the o_proj / down_proj / expert sums add N partial products where one process
  adds one, so only the rounding order differs (measured: 4.5e-7 Llama, 3.9e-7 Qwen3-MoE,
  1.1e-6 4-bit on 2 ranks; 3.0e-6 SmolLM2 on 3, 5.8e-5 absolute on its logits up to 38;
  4.7e-7 on 4, 3.6e-7 on 2 × 2), and the greedy tokens are identical;
- each rank holds exactly its share of the weights: (whole − replicated) / N + replicated,
  the replicated part being the norms and routers (and, when K < N, the k/v projections of its
  KV head, 1/K of them); its KV caches hold only its KV heads (1/N of the bytes when K ≥ N,
  1/K when each KV head is replicated on N/K ranks);
- each rank reads only its slices: MLX's peak memory during its load is at most its share
  plus its largest tensor (one transient copy), less than the whole model (SmolLM2 on 3
  ranks: 39.5 MB peak, 32.9 MB held, 98.3 MB whole).
Two different files on two ranks are refused on both before a weight is read, naming the rank;
a killed rank ends every rank with rank 0's one-line error, and a frozen one (make test-all)
with the watchdog's; the one-shot command and the server run unchanged on rank 0 (make
test-all); a model whose heads or rows do not split evenly is refused by name before any
weight is read, and `inspect --tensor N` shows the slices.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import mlxlis
from mlxlis.distributed.tensor import plan_layout
from mlxlis.distributed.tensor_stage import check_shape
from mlxlis.errors import PipelineError, UnsupportedError
from mlxlis.generation.steps import prefill

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, build_tiny, need_pulled
from launch import MLXLIS, alive, freeze, kill_all, ranks, start, stdout_begins
from launch import run as launch
from mlx.utils import tree_flatten

pytestmark = pytest.mark.real

HERE = Path(__file__).parent
ROOT = HERE.parent
ENV = {"PYTHONPATH": str(ROOT)}  # the ranks import this checkout's mlxlis
STEPS = 64
BOUND = 1e-5  # relative to the largest |logit| of the step
QWEN3 = dict(
    kind="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
# top-2 of 8 experts in layers 0 and 2 (layer 1 dense), renormalised top-k, untied head
QWEN3_MOE = dict(
    kind="qwen3_moe",
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)
PROMPT = "Hello, world! 1234 def add(a, b):"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
JSON = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}


@functools.cache
def lone(model: str):
    return mlxlis.load(model, "float32")


@functools.cache
def reference(model: str, prompt: str, steps: int) -> tuple[list[int], np.ndarray, dict, int]:
    """(greedy tokens, per-step float32 logits, weight bytes {"whole", "replicated": of the
    norms and the experts' routers, "kv": of the k/v projections}, KV-cache bytes of the
    prompt) of a lone process."""
    m = lone(model)
    ids = m.tokenizer.encode(prompt)
    cache = m.make_cache()
    out = prefill(m.net, ids, cache)
    kv = sum(a.nbytes for c in cache for a in c.state)
    tokens, logits = [], []
    for i in range(steps + 1):
        logits.append(np.array(out[0]))
        tokens.append(int(mx.argmax(out, axis=-1).item()))
        if i < steps:
            step = mx.array([[tokens[-1]]], dtype=mx.int32)
            out = m.net(step, cache=cache, last_only=True)[:, -1, :].astype(mx.float32)
    arrays = {id(a): (k, a) for k, a in tree_flatten(m.net.parameters())}.values()
    sizes = {
        "whole": sum(a.nbytes for _, a in arrays),
        "replicated": sum(a.nbytes for k, a in arrays if "norm" in k or ".mlp.gate." in k),
        "kv": sum(a.nbytes for k, a in arrays if ".k_proj." in k or ".v_proj." in k),
    }
    return tokens, np.stack(logits), sizes, kv


@functools.cache
def _launch(n: int, jobs_json: str, tmp: Path) -> Path:
    out = tmp / f"tensor-{n}"
    out.mkdir()
    jobs = tmp / f"tensor-jobs-{n}.json"
    jobs.write_text(jobs_json)
    code, _, err = launch(
        n,
        sys.executable,
        str(HERE / "tensor_rank.py"),
        str(jobs),
        str(out),
        env=ENV,
        timeout=150 if n == 2 else 300,  # 4 ranks on 2 busy cores: ~2 s a token
    )
    assert code == 0 and "Traceback" not in err, err[-3000:]
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tensor-models")
    from mlx_lm import convert as mlx_lm_convert

    build_tiny(tmp / "llama", TINY["llama"])
    build_tiny(tmp / "qwen3", QWEN3)
    build_tiny(tmp / "qwen3-moe", QWEN3_MOE)
    # 128 MLP rows: each rank's 64 columns of down_proj are whole groups of 32
    build_tiny(tmp / "llama128", {**TINY["llama"], "intermediate_size": 128})
    q4 = tmp / "llama-q4"
    mlx_lm_convert(
        str(tmp / "llama128"), str(q4), quantize=True, q_group_size=32, q_bits=4, dtype="float32"
    )
    build_tiny(tmp / "llama-seed1", TINY["llama"], seed=1)  # the same headers, other weights
    names = ("llama", "qwen3", "qwen3-moe")
    return {**{name: str(tmp / name) for name in names}, "llama-q4": str(q4)}


def jobs_for(n: int, folders: dict) -> list[dict]:
    if n == 2:
        other = str(Path(folders["llama"]).with_name("llama-seed1"))
        mismatch = {"name": "mismatch", "models": [folders["llama"], other]}
        llama = {"model": folders["llama"], "prompt": PROMPT, "steps": STEPS}
        return (
            [mismatch]
            + [
                {"name": name, "model": path, "prompt": PROMPT, "steps": STEPS}
                for name, path in folders.items()
            ]
            + [  # speculation and constraints, checked against the lone greedy tokens
                {"name": "llama-ngram", **llama, "speculative": "ngram"},
                {"name": "llama-draft", **llama, "speculative": other},
                {"name": "llama-json", **llama, "format": JSON},
            ]
        )
    if n == 4:  # KV heads replicated on 2 ranks each; 16 rows of each expert per rank
        return [
            {"name": name, "model": folders[name], "prompt": PROMPT, "steps": 16}
            for name in ("llama", "qwen3-moe")
        ] + [  # 2 × 2: tensor pairs inside 2 pipeline stages
            {
                "name": "llama-2x2",
                "model": folders["llama"],
                "prompt": PROMPT,
                "steps": 16,
                "tensor": 2,
            }
        ]
    smol = str(need_pulled("smollm2-135m"))
    # 8 steps: each token is 61 collectives over 3 ranks on 2 busy cores (~4.7 s a token here)
    return [{"name": "smol", "model": smol, "prompt": "The capital of France is", "steps": 8}]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, folders):
    tmp = tmp_path_factory.mktemp("tensor")
    return lambda n: (_launch(n, json.dumps(jobs_for(n, folders)), tmp), jobs_for(n, folders))


# 2 ranks, the tiny models (~20 s): make test; 3 ranks, SmolLM2 (~80 s), and 4 ranks, the
# tiny Llama and Qwen3-MoE: make test-all
@pytest.mark.parametrize(
    "n",
    [2, pytest.param(3, marks=pytest.mark.extended), pytest.param(4, marks=pytest.mark.extended)],
)
def test_tensor_ranks_equal_the_lone_process(launched, n):
    """Each step's logits from rank 0 (prefill, then 64 greedy decode steps through the
    generation core led from rank 0; 8 on SmolLM2) within 1e-5 of the lone process's relative
    to the step's largest logit, the same greedy tokens; each rank's weights are
    (whole − norms − routers − k/v projections) / N + norms + routers + its k/v share bytes,
    its k/v projections
    and KV-cache bytes the lone ones' × its KV heads / all KV heads (1/N when they split; 1/K
    when K < N and each is replicated)."""
    out, jobs = launched(n)
    for job in jobs:
        if "models" in job or "speculative" in job or "format" in job:
            continue  # test_mismatched_files_…, test_speculation_and_constraints_…
        tokens, logits, sizes, kv = reference(job["model"], job["prompt"], job["steps"])
        got = np.load(out / f"{job['name']}-logits.npy")
        assert got.shape == logits.shape
        rel = float((np.abs(got - logits).max(axis=-1) / np.abs(logits).max(axis=-1)).max())
        print(f"{job['name']} on {n} ranks: logits within {rel:.2e} of the largest, relative")
        assert rel <= BOUND, f"{job['name']}: {rel}"
        reports = [json.loads((out / f"{job['name']}-rank-{r}.json").read_text()) for r in range(n)]
        assert reports[0]["tokens"] == tokens, job["name"]
        cfg = lone(job["model"]).config
        if "tensor" in job:  # 2 × 2: each pair holds its stage's layers, split between them
            layers = [tuple(rep["layers"]) for rep in reports]
            assert layers[0] == layers[1] and layers[2] == layers[3], layers
            assert layers[0][0] == 0 and layers[0][1] == layers[2][0], layers
            assert layers[2][1] == cfg.num_hidden_layers, layers
            heads = [tuple(rep["q_heads"]) for rep in reports]
            assert heads[0] == heads[2] == (0, 2) and heads[1] == heads[3] == (2, 4), heads
            continue
        k_all = cfg.num_key_value_heads
        for rep in reports:
            k = rep["kv_heads"][1] - rep["kv_heads"][0]
            split = sizes["whole"] - sizes["replicated"] - sizes["kv"]
            held = split // n + sizes["replicated"] + sizes["kv"] * k // k_all
            assert rep["weight_bytes"] == held, rep
            assert rep["kv_bytes"] == kv * k // k_all, rep
            # read slice by slice: the load's peak is the share and one tensor's transient copy
            assert rep["load_peak"] <= held + rep["largest"] < sizes["whole"], rep
        heads = [h for rep in reports for h in range(*rep["q_heads"])]
        assert heads == list(range(cfg.num_attention_heads))
        kv_heads = [tuple(rep["kv_heads"]) for rep in reports]
        if cfg.num_key_value_heads < n:  # replicated: each KV head on n / K ranks
            per = cfg.num_attention_heads // cfg.num_key_value_heads
            assert all(
                k[0] == h // per for k, h in zip(kv_heads, heads[:: len(heads) // n], strict=True)
            )
        else:
            assert sum(k[1] - k[0] for k in kv_heads) == cfg.num_key_value_heads


def test_speculation_and_constraints_under_tensor_ranks_give_the_lone_tokens(launched):
    """Over 2 ranks (the tiny Llama, the 2-rank launch's own jobs), rank 0's core speculating
    4 tokens a verification, each verification a VERIFY step every rank runs on its slices:
    with prompt lookup (n-gram) and with a draft model held whole on rank 0 (the tiny Llama of
    seed 1: another model, whose proposals are mostly rejected, so the other rank drops
    rejected positions from its caches at nearly every verification), the 65 greedy tokens are
    the lone process's plain greedy tokens, some proposals kept and some rejected. Under a JSON
    schema (llguidance's mask on rank 0, as a lone process applies it) the tokens are the lone
    process's constrained tokens."""
    out, jobs = launched(2)
    for job in jobs:
        if "speculative" not in job and "format" not in job:
            continue
        rep = json.loads((out / f"{job['name']}-rank-0.json").read_text())
        if "format" in job:
            m = lone(job["model"])
            ids = m.tokenizer.encode(job["prompt"])
            events = mlxlis.generate(
                m, ids, max_tokens=job["steps"] + 1, response_format=job["format"]
            )
            want = [e.token for e in events if e.token is not None]
            assert rep["tokens"] == want and len(want) > 8, job["name"]
            continue
        tokens = reference(job["model"], job["prompt"], job["steps"])[0]
        assert rep["tokens"] == tokens, job["name"]
        print(f"{job['name']}: {rep['accepted_tokens']} of {rep['draft_tokens']} drafts kept")
        assert 0 < rep["accepted_tokens"] or job["speculative"] != "ngram", rep
        assert rep["accepted_tokens"] < rep["draft_tokens"], rep  # some positions trimmed


def test_mismatched_files_are_refused_on_every_rank(launched):
    """Two tiny Llamas with the same config and headers but other weights (seed 0 and 1), one
    per rank: each rank's load raises the one PipelineError naming rank 1 and its own file
    before a weight is read (the digests compared first), and the same ranks then go on to
    the parity jobs of the same launch (nobody left waiting)."""
    out, jobs = launched(2)
    for r in range(2):
        error = json.loads((out / f"mismatch-rank-{r}.json").read_text())["error"]
        assert error.startswith("PipelineError: "), error
        assert "rank 1 of 2 opened a different model from rank 0" in error, error
        assert jobs[0]["models"][r] in error, error
    assert (out / "llama-logits.npy").is_file()


def test_uneven_split_is_refused_by_name_before_loading(folders):
    """SmolLM2's 9 query heads over 2 ranks, the tiny Llama's 144 MLP rows over 5 (and its 2 KV
    heads over 3), the tiny Qwen3-MoE's 64 rows per expert over 3, refused naming the field;
    --tensor 2 in one process names the flag, and so does a tensor group inside pipeline
    stages other than 2 × 2 (6 ranks in pairs or triples, 3 ranks in a pair)."""
    need_pulled("smollm2-135m")
    smol = lone("smollm2-135m").config
    with pytest.raises(UnsupportedError, match="num_attention_heads"):
        plan_layout(smol, 0, 2, "smol")
    llama = lone(folders["llama"]).config
    with pytest.raises(UnsupportedError, match="intermediate_size"):
        plan_layout(llama.with_(num_attention_heads=5, vocab_size=420), 0, 5, "tiny")
    with pytest.raises(UnsupportedError, match="num_key_value_heads"):
        plan_layout(llama.with_(num_attention_heads=6, vocab_size=420), 0, 3, "tiny")
    moe = lone(folders["qwen3-moe"]).config  # 64 rows per expert over 3 ranks
    with pytest.raises(UnsupportedError, match="moe_intermediate_size"):
        plan_layout(
            moe.with_(num_attention_heads=6, num_key_value_heads=3, vocab_size=420), 0, 3, "moe"
        )
    with pytest.raises(PipelineError, match="--tensor"):
        mlxlis.load(folders["llama"], "float32", tensor=2)
    check_shape(2, 4)  # two stages of a pair: what a ring of neighbours carries
    for tensor, launched_ranks in ((2, 6), (3, 6), (2, 3)):
        with pytest.raises(PipelineError, match="2 stages of 2 ranks"):
            check_shape(tensor, launched_ranks)


def test_killed_rank_ends_every_rank_with_a_clear_error(folders):
    """`mlxlis --tensor 2` under mlx.launch streaming a long reply: SIGKILL on rank 1, and the
    launcher and rank 0 are gone within 10 s, rank 0 having said why in one line. (MLX's ring
    backend fails a pending all_sum's tasks when a peer goes, but the sum never returns: the
    pipeline's watchdog ends rank 0 after MLXLIS_RANK_TIMEOUT, 3 s here.)"""
    args = ["-m", folders["llama"], "--tensor", "2", "--no-chat", "--temp", "0"]
    env = {**ENV, "MLXLIS_RANK_TIMEOUT": "3"}
    p = start(2, MLXLIS, *args, "--max-tokens", "480", "Once", env=env)
    try:
        pids = ranks(p, 2)
        stdout_begins(p)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        p.wait(timeout=10)
        while any(alive(pid) for pid in pids.values()) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert not [r for r, pid in pids.items() if alive(pid)], "ranks still running"
        err = p.stderr.read().decode()
    finally:
        kill_all(p)
    lines = [ln for ln in err.splitlines() if ln.startswith("mlxlis: error: rank 0 of 2")]
    assert lines, err[-2000:]
    assert any(
        why in lines[0]
        for why in (
            "lost the connection to another rank",
            "stopped by the launcher",
            "no answer from the other ranks for 3 s",
        )
    )


@pytest.mark.extended  # `make test-all` (~15 s): a killed rank is proved in make test
def test_frozen_rank_ends_every_rank_within_the_watchdogs_time(folders):
    """`mlxlis --tensor 2` under mlx.launch streaming a long reply: SIGSTOP on rank 1 (its
    sockets stay open, so no collective fails: the all_sum just never completes). Rank 0's
    watchdog ends it with its one line after MLXLIS_RANK_TIMEOUT=2 s (within 1.5-6 s); rank 1,
    continued, is gone within 5 s (the launcher's SIGTERM waited for it), then the launcher."""
    args = ["-m", folders["llama"], "--tensor", "2", "--no-chat", "--temp", "0"]
    p = start(2, MLXLIS, *args, "--max-tokens", "3000", "Once", env={**ENV, **FROZEN})
    try:
        pids = ranks(p, 2)
        stdout_begins(p)
        took = freeze(pids)
        assert not alive(pids[0]), "rank 0 still running"
        os.kill(pids[1], signal.SIGCONT)  # the launcher's SIGTERM waits for it
        continued = time.monotonic()
        while alive(pids[1]) and time.monotonic() - continued < 5:
            time.sleep(0.05)
        assert not alive(pids[1]), "rank 1 still running once continued"
        p.wait(timeout=10)
        err = p.stderr.read().decode()
    finally:
        kill_all(p)
    assert 1.5 < took < 6, took
    lines = [ln for ln in err.splitlines() if ln.startswith("mlxlis: error: rank 0 of 2")]
    assert lines == [FROZEN_WHY], err[-2000:]


FROZEN = {"MLXLIS_RANK_TIMEOUT": "2"}
FROZEN_WHY = (
    "mlxlis: error: rank 0 of 2: no answer from the other ranks for 2 s (a rank stopped or its "
    "link went down; MLXLIS_RANK_TIMEOUT sets the limit); ending the job"
)


def test_inspect_tensor_reports_each_ranks_slice(capsys):
    """`inspect smollm2-135m --tensor 3 --json` from the header: three ranks whose query heads
    cover 0-8 in order, one KV head each, bytes that add up to the file's with the norms
    counted on every rank, and the bytes each sends per token; --tensor 2 is refused naming
    num_attention_heads (9 heads)."""
    from mlxlis.commands.cli import main

    need_pulled("smollm2-135m")
    assert main(["inspect", "smollm2-135m", "--tensor", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [p["rank"] for p in r["parts"]] == [0, 1, 2]
    assert "query heads 0-2, KV heads 0-0" in r["parts"][0]["layout"]
    assert "query heads 6-8, KV heads 2-2" in r["parts"][2]["layout"]
    cfg = lone("smollm2-135m").config
    assert r["bytes_per_token"] == 4 * (
        (2 * cfg.num_hidden_layers + 1) * 2 * 2 * cfg.hidden_size // 3 + 2 * cfg.vocab_size // 3
    )
    assert sum(p["bytes"] for p in r["parts"]) >= r["weight_bytes"]
    assert main(["inspect", "smollm2-135m", "--tensor", "2"]) == 2
    assert "num_attention_heads" in capsys.readouterr().err


@pytest.mark.extended  # `make test-all` (~15 s each): the ranks' steps are proved in make test
@pytest.mark.parametrize("n", [2, 4])
def test_cli_under_the_launcher_prints_the_lone_output_once(folders, n):
    """`mlx.launch -n N mlxlis -m M --tensor 2 --no-chat --temp 0 PROMPT` writes exactly what
    the lone command writes, once (the other ranks print nothing): the one-shot command runs
    unchanged on rank 0, over one tensor pair (N = 2) and over two pipeline stages of a pair
    each (N = 4)."""
    import subprocess

    args = ["-m", folders["llama"], "--no-chat", "--temp", "0", "--max-tokens", "24", "Hello"]
    env = {**os.environ, **ENV, "OPENBLAS_NUM_THREADS": "1"}
    alone = subprocess.run([MLXLIS, *args], capture_output=True, text=True, timeout=120, env=env)
    assert alone.returncode == 0, alone.stderr
    code, out, err = launch(n, MLXLIS, *args, "--tensor", "2", env=ENV)
    assert code == 0, err
    assert out == alone.stdout and out.strip()


@pytest.mark.extended  # `make test-all` (~40 s: a launch of its own)
def test_images_under_tensor_ranks_give_the_lone_tokens(tmp_path):
    """A tiny random multimodal Gemma 3 (tests/seeing.py: its text part's 2 query heads on 1
    KV head, replicated; a tied head) over 2 ranks, a chat turn holding a 40 × 56 image: rank 0
    runs the vision tower and sends the image's features with the prompt's step, every rank
    places them in its embeddings. As a folder, and as a text GGUF with llama.cpp's mmproj
    beside it (written as test_mmproj.py writes them); rank 0 alone loads the tower. The
    prompt's logits within 1e-5 of the lone process's (`Model.logits` with the image, itself
    proved against transformers in test_images.py and test_mmproj.py) relative to the
    largest, and the 17 greedy tokens equal the lone process's."""
    from PIL import Image
    from seeing import build_gemma3
    from test_gguf_tiny import write_gemma_gguf
    from test_mmproj import write_gemma3
    from transformers import Gemma3ForCausalLM

    folder = tmp_path / "gemma3"
    build_gemma3(folder)
    # as a Gemma 3 GGUF holds it (test_mmproj.py): every layer sliding, scale 1/√head_dim
    hf = tmp_path / "gemma3-hf"
    ref = build_gemma3(
        hf, exact16=True, layer_types=["sliding_attention"] * 3, query_pre_attn_scalar=24
    )
    text = Gemma3ForCausalLM(ref.config.text_config).eval()
    text.model.load_state_dict(ref.model.language_model.state_dict())
    text.lm_head.weight = text.model.embed_tokens.weight
    (tmp_path / "gguf").mkdir()
    gguf_file = tmp_path / "gguf" / "tiny-F32.gguf"
    write_gemma_gguf(gguf_file, text, hf, "gemma3")
    write_gemma3(tmp_path / "gguf" / "mmproj-tiny-F16.gguf", ref)
    image = tmp_path / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(image)
    ask = {"prompt": "What is it?", "steps": 16, "image": str(image)}
    jobs = [
        {"name": "gemma3", "model": str(folder), **ask},
        {"name": "gemma3-gguf", "model": str(gguf_file), "template": "gemma", **ask},
    ]
    out = _launch.__wrapped__(2, json.dumps(jobs), tmp_path)
    for job in jobs:
        m = mlxlis.load(job["model"], "float32", chat_template=job.get("template"))
        content = [{"type": "image", "path": str(image)}, {"type": "text", "text": ask["prompt"]}]
        prompt = m.encode_chat([{"role": "user", "content": content}])
        assert prompt.images
        events = mlxlis.generate(m, prompt, max_tokens=ask["steps"] + 1, stop_ids=set())
        want = [e.token for e in events if e.token is not None]
        rep = json.loads((out / f"{job['name']}-rank-0.json").read_text())
        assert rep["tokens"] == want, job["name"]
        other = json.loads((out / f"{job['name']}-rank-1.json").read_text())
        assert rep["vision"] and not other["vision"], job["name"]  # the tower on rank 0 only
        first = np.array(m.logits(prompt.ids, images=prompt.images)[-1])
        got = np.load(out / f"{job['name']}-logits.npy")[0]
        rel = float(np.abs(got - first).max() / np.abs(first).max())
        print(f"{job['name']} with an image on 2 ranks: prompt logits within {rel:.2e}")
        assert rel <= BOUND, (job["name"], rel)


@pytest.mark.extended  # `make test-all` (~30 s): the ranks' verifications are proved in make test
def test_cli_speculating_under_the_launcher_prints_the_lone_greedy_output(folders):
    """`mlx.launch -n 2 mlxlis -m M --tensor 2 --no-chat --temp 0` with `--speculative ngram`
    and with `--draft-model OTHER` (loaded whole on rank 0 only, by the command's own loader)
    writes what the lone command writes without speculating, once; over 2 × 2 (4 ranks) it is
    refused naming speculative decoding before a token is written, every rank ending."""
    import subprocess

    args = ["-m", folders["llama"], "--no-chat", "--temp", "0", "--max-tokens", "32", "Hello"]
    env = {**os.environ, **ENV, "OPENBLAS_NUM_THREADS": "1"}
    alone = subprocess.run([MLXLIS, *args], capture_output=True, text=True, timeout=120, env=env)
    assert alone.returncode == 0, alone.stderr
    other = str(Path(folders["llama"]).with_name("llama-seed1"))
    for flags in (["--speculative", "ngram"], ["--draft-model", other, "--draft-tokens", "3"]):
        code, out, err = launch(2, MLXLIS, *args, "--tensor", "2", *flags, env=ENV)
        assert code == 0, err
        assert out == alone.stdout and out.strip(), flags
    # 2 × 2: the last stage sends one position's logits, so no verification: refused by name
    code, out, err = launch(4, MLXLIS, *args, "--tensor", "2", "--speculative", "ngram", env=ENV)
    assert not out.strip() and "speculative decoding of a pipelined model" in err, err[-2000:]


@pytest.mark.extended  # `make test-all` (~30 s)
def test_server_under_the_launcher_answers_as_a_lone_engine(folders, tmp_path):
    """`mlxlis serve --tensor 2` under mlx.launch (rank 0 serves, both ranks run every step of
    its engine): concurrent greedy completions with the official `openai` client, decoded in
    one batch, give the text of the same requests run one by one on a lone in-process Engine,
    each token's logprob within 1e-4 of the lone run's (the tensor sums' rounding only)."""
    import concurrent.futures

    from serve_process import ServeProcess
    from test_pipeline_serve import lone as lone_engine

    model = lone(folders["llama"])
    texts = ["Hello, world!", "def add(a, b):", "The quick brown fox jumps over"]
    batch = [model.tokenizer.encode(t) for t in texts]
    server = ServeProcess(
        tmp_path,
        "-m",
        folders["llama"],
        "--tensor",
        "2",
        "--max-batch",
        "4",
        ranks=2,
        env={**ENV, "MLXLIS_RANK_TIMEOUT": "120"},
    )
    try:
        client = server.client()

        def complete(ids):
            return client.completions.create(
                model=server.model,
                prompt=ids,
                max_tokens=8,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )

        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            served = list(pool.map(complete, batch))
        for ids, got in zip(batch, served, strict=True):
            text, logprobs = lone_engine(model, ids)
            choice = got.choices[0]
            assert choice.text == text, (ids, choice.text, text)
            diff = max(
                abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, logprobs, strict=True)
            )
            assert diff <= 1e-4, diff
    finally:
        kill_all(server.proc)
