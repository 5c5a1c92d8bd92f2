"""Qwen4-Exp against transformers and itself.

Reference parity: tiny random `qwen4_exp_text` checkpoints written by transformers'
save_pretrained (the n-gram tables in split_ngram_parts shards, the hash buffers beside them)
against its float32 forward over 72 tokens, EOS tokens inside (the n-gram context ends at
each), past the QSA budget (18 and 36 blocks, 2 and 3 chosen per query): "exp" (3 streams, PLE
on two DeltaNet layers, a SiLU output gate, untied) and "sig" (2 streams, 4-grams, a sigmoid
output gate, layer_types saying "full_attention" as the real checkpoint does, tied). No second
engine runs the type (mlx-lm and llama.cpp have none). Self-consistency: chunked prefill ≡
one-step decode ≡ full forward; batched decode ≡ each alone; a verification trimmed back and
a file's copy of the caches decode on exactly; `convert` round trips and transformers reads
what it writes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlxlis
from mlxlis.cache import JointCache, RecurrentCache
from mlxlis.errors import ConfigError

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_batched_decode,
    check_config_refused,
    tiny_models,
    trajectory,
)
from safetensors.numpy import load_file, save_file
from test_qwen3_5 import realistic

EOS = 2
COMMON = dict(
    kind="qwen4_exp_text",
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=512,
    hc_lowrank=16,
    ngram_vocab_size_base=101,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=4,
    indexer_kv_heads=1,
)
SPECS = {
    "exp": dict(
        hc_count=3,
        ple_layer_ids=[1, 3],
        ple_embed_dim=32,
        heads_per_ngram=2,
        indexer_n_heads=4,
        indexer_head_dim=12,
        indexer_budget=8,
        indexer_compress_ratio=4,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        **COMMON,
    ),
    "sig": dict(
        hc_count=2,
        ple_layer_ids=[1, 3],
        ngram_size=4,
        heads_per_ngram=1,
        ple_embed_dim=24,
        output_gate_type="sigmoid",
        layer_types=["linear_attention", "full_attention"] * 2,
        indexer_n_heads=5,
        indexer_head_dim=8,
        indexer_budget=6,
        indexer_compress_ratio=2,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25),
        **COMMON,
    ),
}


def ple_weights(model) -> None:
    """realistic(), and PLE's convolution non-zero (transformers initialises it to 0, which
    would leave the dilated convolution unexercised)."""
    realistic(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, lambda f, s: build_tiny(f, s, adjust=ple_weights))


def ids_with_eos(n: int = 72) -> list[int]:
    """A trajectory with EOS at a few places, twice in a row once (contexts cut short)."""
    ids = trajectory(n, vocab=400)
    for i in (5, 17, 18, 40, n - 3):
        if i < n:
            ids[i] = EOS
    return ids


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(qwen4, name):
    """Reference parity over 72 tokens within 1e-4 (measured 3e-7 exp, 8e-7 sig, on logits up
    to 1.0 and 1.3): the streams' mixes and injections, the n-gram hashes across EOS, PLE's
    gate and dilated convolution, the QSA selection past its budget, the DeltaNet's SiLU /
    sigmoid gate."""
    folder, ref = qwen4(name)
    model = mlxlis.load(folder, "float32")
    assert model.config.family == "qwen4_exp"
    ids = ids_with_eos()
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 0.5


def test_the_indexer_restricts_attention(qwen4):
    """The QSA mask past the budget: each query sees at most budget + ratio − 1 keys, its own
    unfinished block whole, and (a query with more finished blocks than it may choose) fewer
    keys than its causal ones — what makes the parity above a test of the selection."""
    model = mlxlis.load(qwen4("exp")[0], "float32")
    attn = model.net.model.layers[3].self_attn
    x = mx.random.normal((1, 72, 64), key=mx.random.key(0))
    chosen = np.array(attn.indexer(x, None))[0, 0]  # (T, S)
    assert not np.triu(chosen, 1).any()  # causal
    counts = chosen.sum(-1)
    assert counts.max() <= 8 + 4 - 1 and counts[-1] < 72
    assert all(chosen[p, (p + 1) // 4 * 4 : p + 1].all() for p in range(72))  # unfinished
    assert chosen[:11].sum() == sum(range(1, 12))  # two finished blocks or fewer: all


def test_chunked_prefill_step_decode_and_batches_equal_the_full_forward(qwen4):
    """Self-consistency over 72 tokens (bound 1e-4): chunks of 5 and 30 (PLE's context and
    convolution state, the indexer's keys carried across), one-step decode from token 20; two
    sequences decoding together equal each alone (the PLE states stacked, the attention per
    row)."""
    model = mlxlis.load(qwen4("exp")[0], "float32")
    ids = ids_with_eos()
    full = np.array(model.logits(ids))
    for chunk in (5, 30):
        cache = model.make_cache()
        outs = [
            np.array(model.net(mx.array([ids[s : s + chunk]]), cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 1e-4, chunk
    cache = model.make_cache()
    model.net(mx.array([ids[:20]]), cache)
    steps = [np.array(model.net(mx.array([[t]]), cache)[0, -1]) for t in ids[20:]]
    assert np.abs(np.stack(steps) - full[20:]).max() < 1e-4
    check_batched_decode(model, ids, 41, 1e-4)


def test_a_trimmed_verification_and_a_saved_cache_decode_on_exactly(qwen4):
    """The joint caches: a 4-token verification (expect_rewind) trimmed back by 3 continues
    as if only its first token had been fed (PLE's and the DeltaNet's states after each
    token, the KV and indexer keys trimmed together); caches exported and restored into fresh
    ones continue the same. Self-consistency, bound 1e-4."""
    model = mlxlis.load(qwen4("exp")[0], "float32")
    ids = ids_with_eos()
    full = np.array(model.logits(ids[:40]))
    cache = model.make_cache()
    assert any(isinstance(c, JointCache) for c in cache)
    assert any(isinstance(c, RecurrentCache) for c in cache)
    model.net(mx.array([ids[:30]]), cache)
    for c in cache:
        c.expect_rewind(3)
    model.net(mx.array([ids[30:34]]), cache)
    assert all(c.rewind_point(31) == 31 for c in cache)
    assert all(c.trim(3) == 3 for c in cache)
    fresh = model.make_cache()
    for c, f in zip(cache, fresh, strict=True):
        f.restore(*c.export())
    for caches in (cache, fresh):
        steps = [np.array(model.net(mx.array([[t]]), caches)[0, -1]) for t in ids[31:40]]
        assert np.abs(np.stack(steps) - full[31:40]).max() < 1e-4


def test_generate_runs_it(qwen4):
    """The generation core runs it (greedy, the events' tokens those of the argmax of the
    full forward along the generated trajectory: self-consistency)."""
    model = mlxlis.load(qwen4("sig")[0], "float32")
    prompt = ids_with_eos(20)
    events = mlxlis.generate(model, prompt, max_tokens=6, temperature=0.0)
    out = [ev.token for ev in events if ev.token is not None]
    assert len(out) == 6
    logits = np.array(model.logits(prompt + out[:-1]))
    assert out == [int(x) for x in logits[len(prompt) - 1 :].argmax(-1)]


def wrapped(folder: Path, dest: Path) -> Path:
    """The checkpoint as a Qwen4ExpForConditionalGeneration folder: text_config, the text
    tensors under `model.language_model.`, a vision tower beside them."""
    shutil.copytree(folder, dest)
    w = load_file(str(dest / "model.safetensors"))
    out = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in w.items()
    }
    out["model.visual.patch_embed.proj.weight"] = np.zeros((8, 4), np.float32)
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((dest / "config.json").read_text())
    cfg = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "qwen4_exp_vision"},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_wrapper_reads_the_language_model_and_says_what_it_skipped(qwen4, tmp_path):
    """The wrapper folder gives the text folder's very logits; its vision tower is skipped
    and said (`Model.skipped`)."""
    folder, _ = qwen4("exp")
    model = mlxlis.load(wrapped(folder, tmp_path / "w"), "float32")
    ids = ids_with_eos(24)
    assert np.array_equal(
        np.array(model.logits(ids)), np.array(mlxlis.load(folder, "float32").logits(ids))
    )
    assert any(s.startswith("model.visual.") for s in model.skipped)


def test_convert_round_trip_and_transformers_reads_it(qwen4, tmp_path):
    """`convert` writes qwen4_exp_text (the n-gram tables whole): it reloads bit for bit to the
    same config, and transformers loads it to logits within 1e-4 of ours."""
    from mlxlis.commands.convert import convert

    import transformers

    folder, _ = qwen4("sig")
    out = convert(folder, tmp_path / "out", dtype="float32")
    src, again = mlxlis.load(folder, "float32"), mlxlis.load(out, "float32")
    ids = ids_with_eos(40)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    assert again.config == src.config.with_(
        source=again.config.source,
        special=replace(src.config.special, eos=again.config.special.eos),
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert np.abs(np.array(again.logits(ids)) - reference_logits(ref, ids)).max() < 1e-4


BAD = [
    ({"indexer_n_heads": None}, ConfigError, "indexer_n_heads"),
    ({"ple_layer_ids": [4]}, ConfigError, "ple_layer_ids"),
    ({"output_gate_type": "gelu"}, ConfigError, "output_gate_type"),
    ({"indexer_budget": 10}, ConfigError, "indexer_budget"),
    ({"hc_count": 1}, ConfigError, "hc_count"),
    ({"ple_embed_dim": 30}, ConfigError, "ple_embed_dim"),
    ({"ple_embed_dim": 0}, ConfigError, "ple_embed_dim"),
    ({"ple_conv_kernel_size": 1}, ConfigError, "ple_conv_kernel_size"),
    ({"ngram_size": 1}, ConfigError, "ngram_size"),
    ({"eos_token_id": 400}, ConfigError, "eos_token_id"),
]


@pytest.mark.parametrize("change,error,field", BAD)
def test_bad_configs_are_named(qwen4, tmp_path, change, error, field):
    """A config Qwen4-Exp cannot run is refused with an MlxlisError naming the field."""
    check_config_refused(qwen4("exp")[0], tmp_path, change, error, field)


def test_inspect_shows_the_streams_ple_and_qsa(qwen4):
    """`inspect`'s report: the hyper-connections, the PLE layers and the QSA budget as the
    config states them; the KV memory counts the attention layer's keys and the indexer's
    per position (the joint caches' parts), the DeltaNet and PLE states as fixed."""
    from mlxlis.commands.report import format_report, model_report

    model = mlxlis.load(qwen4("exp")[0], "float32")
    r = model_report(model)
    assert r["config"]["hyper_connections"] == {
        "count": 3,
        "rank": 16,
        "ple_layers": [0, 2],
        "ngram_size": 3,
        "qsa": {"budget": 8, "block": 4, "heads": 4},
    }
    # one attention layer: K and V (2 kv heads × 16) and the indexer's key (12) and its unused
    # value (1), float32
    assert r["memory"]["kv_bytes_per_token"] == (2 * 2 * 16 + 12 + 1) * 4
    assert r["memory"]["kv_fixed_bytes"] > 0
    assert "3 hyper-connection streams" in format_report(r)


def test_joint_caches_say_their_kv_format():
    """A joint cache reports its KV layer's format (what the prefix and disk caches file
    entries under, store.format_of), the indexer's dense keys notwithstanding."""
    from mlxlis.cache import JointCache, KVCache, KVFormat
    from mlxlis.cache.store import format_of

    fmt = KVFormat(8, 32)
    assert format_of([RecurrentCache(), JointCache(KVCache(fmt), KVCache())]) == fmt
    assert format_of([RecurrentCache(), JointCache(KVCache(), KVCache())]) is None
