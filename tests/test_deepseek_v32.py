"""DeepSeek V3.2 (`deepseek_v32`: DeepSeek V3 with the lightning indexer's top-k attention)
against transformers and itself.

Reference parity: a tiny random `deepseek_v32` checkpoint written by transformers'
save_pretrained — DeepSeek V3's test shapes (3 heads, latent attention with q_lora_rank, YaRN
with mscale ≠ mscale_all_dim, a dense layer then grouped-routing MoE layers with a random
correction bias) and an indexer of 8 heads of 48 dims (positive head weights: no ties at the
cut) keeping 16 keys per query — against its float32 forward over 72 tokens, so that most
queries keep fewer keys than they follow; the selection bites (keeping every key moves the
logits). The cut's ties go to the earlier keys (checked against numpy's stable sort).
Self-consistency: chunked prefill ≡ decode ≡ full forward (the indexer's keys cached beside
the latents); batched decode ≡ each alone; greedy n-gram speculation ≡ plain greedy and in
the serving engine; a rejection at each position rewinds both caches exactly; a prefix reused
from memory and from the disk cache continues exactly. MLX-quantized: mlx-lm's 4-bit conversion
against transformers on the weights dequantized from that very folder. `convert` round-trips.
"""

from __future__ import annotations

import json
import shutil

import mlxlis
from mlxlis.cache import JointCache
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.steps import StepKind, forward, prefill
from mlxlis.models.deepseek_v32 import top_keys

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    check_speculation_and_engine,
    dequantized_folder,
    tiny_models,
    trajectory,
)
from test_deepseek_v3 import BASE, with_bias

SPEC = {
    **BASE,
    "kind": "deepseek_v32",
    "index_n_heads": 8,
    "index_head_dim": 48,
    "index_topk": 16,
}
SPECS = {"v32": SPEC}
BOUND = 1e-4  # float32 against transformers (the bound)


def untied(model) -> None:
    """with_bias, and the indexer's head weights made positive: a key whose every head's
    relu is 0 scores exactly 0, and zeros tying at the cut are picked arbitrarily by
    transformers' torch.topk; positive weights put such keys last (none at the cut here)."""
    with_bias(model)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.indexer.weights_proj.weight
            w.copy_(w.abs())


def build(folder, spec):
    return build_tiny(folder, spec, adjust=untied)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


@pytest.fixture(scope="module")
def model(ds):
    return mlxlis.load(ds("v32")[0], "float32")


def test_logits_match_transformers_fp32(ds, model, tmp_path):
    """Reference parity over 72 tokens within 1e-4; the selection bites: the same weights
    keeping 72 keys per query move the logits."""
    folder, ref = ds("v32")
    c = model.config
    assert c.family == "deepseek_v32" and c.family_config.index.topk == 16
    ids = trajectory(72, vocab=c.vocab_size)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
    ours = np.array(model.logits(ids))
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    every = tmp_path / "every"
    shutil.copytree(folder, every)
    cfg = json.loads((every / "config.json").read_text())
    (every / "config.json").write_text(json.dumps({**cfg, "index_topk": 72}))
    other = np.array(mlxlis.load(every, "float32").logits(ids))
    assert np.abs(other - ours).max() > 1e-2


def test_ties_at_the_cut_go_to_the_earlier_keys():
    """top_keys keeps, per row, the k best keys, ties at the k-th score to the earlier
    positions: numpy's stable sort of −score names the same keys (rows full of ties)."""
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, size=(2, 5, 40)).astype(np.float32)  # many ties
    scores[0, 0, 30:] = -np.inf  # keys out of reach
    got = np.array(top_keys(mx.array(scores), 9))
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :9]
    want = np.zeros_like(got)
    np.put_along_axis(want, order, True, axis=-1)
    assert np.array_equal(got, want)
    assert np.array(top_keys(mx.array(scores[..., :9]), 9)).all()


def test_indexed_cache_chunks_decode_and_batches(model):
    """Each layer's cache: the latents beside the indexer's keys; self-consistency: a chunked
    prefill (9, 11) then token-by-token decode equals the full forward over 48 tokens (past
    16: the selection bites in decode too); two sequences decoded together equal each
    alone."""
    ids = trajectory(48, vocab=model.config.vocab_size)
    caches = model.make_cache()
    model.net(mx.array([ids[:20]]), caches)
    assert all(isinstance(c, JointCache) for c in caches)
    latents, keys = caches[0].parts
    assert latents.keys[..., :20, :].shape == (1, 1, 20, 64)
    assert keys.keys[..., :20, :].shape == (1, 1, 20, 48)
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 35, 1e-4)


def test_speculation_and_engine_batches_give_the_lone_greedy_tokens(model):
    """Greedy n-gram speculation gives the plain greedy tokens; 4 requests in the serving
    engine (two speculating, two plain) each get their lone tokens."""
    check_speculation_and_engine(model)


def test_a_rejection_at_each_position_rewinds_exactly(model):
    """A verification of 1 + 5 tokens trimmed back to its first 1 + j: the next step's logits
    equal those after a verification of those 1 + j tokens only (bound 1e-5)."""
    vocab = model.config.vocab_size
    prompt, step = trajectory(40, seed=7, vocab=vocab), trajectory(6, seed=8, vocab=vocab)
    k = len(step) - 1
    for j in range(k + 1):
        caches, ref = model.make_cache(), model.make_cache()
        prefill(model.net, prompt, caches)
        prefill(model.net, prompt, ref)
        forward(model.net, [caches], mx.array(step, mx.int32), StepKind.VERIFY)
        assert all(c.trim(k - j) == k - j for c in caches)
        forward(model.net, [ref], mx.array(step[: j + 1], mx.int32), StepKind.VERIFY)
        n = len(prompt) + j + 1
        assert all(a.offset == b.offset == n for a, b in zip(caches, ref, strict=True))
        after = mx.array([step[0]], mx.int32)
        got = forward(model.net, [caches], after, StepKind.DECODE)
        want = forward(model.net, [ref], after, StepKind.DECODE)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5, j


def test_a_prefix_reused_from_memory_and_from_disk_continues_exactly(model, tmp_path):
    """Turn 1 (60 tokens) kept by a prefix cache with a disk tier; turn 2 shares its first
    50: from memory and, after a restart, from the file, the rest's logits are bit for bit
    equal, and equal to a cold prefill up to the chunking's rounding (bound 1e-4)."""
    vocab = model.config.vocab_size
    one = trajectory(60, seed=1, vocab=vocab)
    two = one[:50] + trajectory(30, seed=2, vocab=vocab)
    warns: list[str] = []

    def tier():
        disk = DiskCache(tmp_path, 1 << 30, "fp", model.make_cache, warns.append)
        return PrefixCache(1 << 30, disk=disk)

    first = tier()
    caches = model.make_cache()
    mx.eval(model.net(mx.array([one]), cache=caches))
    first.put(one, caches)
    outs = []
    for cache in (first, tier()):
        kept, reused = cache.take(two, None)
        assert reused == 50
        outs.append(np.array(model.net(mx.array([two[50:]]), cache=kept)[0, -1]))
    assert "read from disk" in cache.note and warns == []
    assert np.array_equal(outs[0], outs[1])
    cold = np.array(model.net(mx.array([two]), cache=model.make_cache())[0, -1])
    assert np.abs(outs[0] - cold).max() < 1e-4


def test_full_rank_query_is_refused(ds, tmp_path):
    """q_lora_rank null (transformers drops that formulation: the indexer reads q_resid) is
    refused naming config.json and the field."""
    from mlxlis.errors import MlxlisError

    from conftest import check_config_refused

    check_config_refused(ds("v32")[0], tmp_path, {"q_lora_rank": None}, MlxlisError, "q_lora_rank")


def test_convert_round_trips_and_inspect_says_it(model, ds, tmp_path):
    """`convert`'s folder reloads to the same config (the indexer's sizes included) and
    bit-identical logits; `inspect` says the sparse attention and the latent cache."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report

    out = convert(ds("v32")[0], tmp_path / "out", dtype="float32")
    again = mlxlis.load(out, "float32")
    a, s = again.config, model.config
    af, sf = a.family_config, s.family_config
    assert (a.moe, a.rope, af.mla, af.routing, af.index) == (
        s.moe,
        s.rope,
        sf.mla,
        sf.routing,
        sf.index,
    )
    ids = trajectory(48, vocab=s.vocab_size)
    assert np.array_equal(np.array(again.logits(ids)), np.array(model.logits(ids)))
    text = format_report(model_report(model))
    assert "its 16 best keys by a lightning indexer of 8 heads" in text
    assert "192 bytes per token and layer" in text


def test_mlx_quantized_folder_matches_its_dequantized_weights(ds, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; kv_b_proj split into embed_q / unembed_out,
    the indexer's projections quantized too) loads as it is, and gives the logits of
    transformers on the weights dequantized from its files, kv_b_proj joined again."""
    from mlxlis.models.mla import join_kv_b

    from mlx_lm import convert as mlx_lm_convert
    from test_deepseek_v3 import mlx_lm_folder

    folder, ref = ds("v32")
    out = tmp_path / "q4"
    src = mlx_lm_folder(folder, tmp_path / "classic")
    mlx_lm_convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    dense = dequantized_folder(out)
    for i in range(3):
        p = f"model.layers.{i}."
        eq, uo = (dense.pop(p + f"self_attn.{k}.weight") for k in ("embed_q", "unembed_out"))
        dense[p + "self_attn.kv_b_proj.weight"] = np.array(join_kv_b(mx.array(eq), mx.array(uo)))
        if i:  # transformers 5 keeps the experts fused: gate rows, then up rows
            gate, up = (dense.pop(p + f"mlp.switch_mlp.{k}_proj.weight") for k in ("gate", "up"))
            dense[p + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            dense[p + "mlp.experts.down_proj"] = dense.pop(p + "mlp.switch_mlp.down_proj.weight")
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in dense.items()})
    ids = trajectory(48, vocab=model.config.vocab_size)
    with torch.no_grad():
        theirs = twin(torch.tensor([ids])).logits[0].float().numpy()
    delta = np.abs(np.array(model.logits(ids)) - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
