"""DeepSeek V4 (`deepseek_v4`: compressed sparse / heavily compressed / sliding attention,
manifold-constrained hyper-connections, hash-routed experts) against transformers and itself.

Reference parity: a tiny random `deepseek_v4` checkpoint written by transformers 5.25's
save_pretrained (DeepSeek's own tensor names) where every mechanism bites within 72 tokens:
4 layers — sliding, CSA, HCA, CSA — with a sliding window of 12, CSA entries every 4
positions of which the indexer keeps 5 (from position 23 on a query has more to choose
from), HCA entries every 16 positions (4 closed within the prompt), 3 hyper-connection
streams with 5 Sinkhorn iterations, two hash-routed layers (a random token → experts table)
then two score-routed ones (a random correction bias), YaRN on the compressed layers' RoPE.
The indexer's head weights are made positive (as DeepSeek V3.2's test does): a zero score
then only comes from an entry every head's relu zeroes, and torch.topk picks among such ties
at the cut arbitrarily. Self-consistency: chunked prefill ≡ decode ≡ full forward; batched
decode ≡ each alone; a rejection at each position rewinds exactly; a prefix reused from
memory and from the disk cache continues exactly; greedy n-gram speculation ≡ plain greedy;
the hub's root tensor names load the same weights.
mlx-lm 0.32 has no deepseek_v4 (its deepseek_v41 is another model type): no mlx-lm folder.
"""

from __future__ import annotations

import json
import shutil

import mlxlis
from mlxlis.cache import JointCache, RotatingKVCache
from mlxlis.cache.compressed import EntryCache
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.errors import UnsupportedError
from mlxlis.generation.steps import StepKind, forward, prefill

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    check_config_refused,
    check_speculation_and_engine,
    tiny_models,
    trajectory,
)

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
SPEC = {
    "kind": "deepseek_v4",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "partial_rotary_factor": 0.25,
    "sliding_window": 12,
    "compress_rates": {CSA: 4, HCA: 16},
    "layer_types": ["sliding_attention", CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "hc_mult": 3,
    "hc_sinkhorn_iters": 5,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 5,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
SPECS = {"v4": SPEC}
BOUND = 1e-4  # float32 against transformers (the bound)


@torch.no_grad()
def routed(model) -> None:
    """A random token → 2 distinct experts table in the hash layers (transformers inits it to
    zeros, every token to expert 0 twice), a random correction bias in the others, positive
    indexer head weights (the module doc)."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            rows = [torch.randperm(6, generator=g)[:2] for _ in range(gate.tid2eid.shape[0])]
            gate.tid2eid.copy_(torch.stack(rows))
        else:
            gate.e_score_correction_bias.copy_(0.1 * torch.randn(6, generator=g))
        compressor = layer.self_attn.compressor
        if compressor is not None and hasattr(compressor, "indexer"):
            w = compressor.indexer.scorer.weights_proj.weight
            w.copy_(w.abs())


def build(folder, spec):
    return build_tiny(folder, spec, adjust=routed)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


@pytest.fixture(scope="module")
def model(ds):
    return mlxlis.load(ds("v4")[0], "float32")


def test_logits_match_transformers_fp32(ds, model, tmp_path):
    """Reference parity over 72 tokens within 1e-4; the indexer's selection bites: the same
    weights keeping 72 entries per query move the logits."""
    folder, ref = ds("v4")
    c = model.config
    assert c.family == "deepseek_v4" and c.family_config.hashed == (True, True, False, False)
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


def test_the_hubs_root_names_load_the_same(ds, model, tmp_path):
    """DeepSeek's own files name the tensors at the root (embed, layers.*, norm, hc_head_*,
    head: transformers' conversion mapping reads them so); the same tensors under those names
    give the same logits bit for bit."""
    hub = tmp_path / "hub"
    shutil.copytree(ds("v4")[0], hub)
    tensors = mx.load(str(hub / "model.safetensors"))

    def root(name: str) -> str:
        name = name.replace("model.embed_tokens.", "embed.").replace(
            "model.hc_head.hc_", "hc_head_"
        )
        return name.removeprefix("model.")

    mx.save_safetensors(str(hub / "model.safetensors"), {root(k): v for k, v in tensors.items()})
    assert "layers.2.ffn.gate.bias" in mx.load(str(hub / "model.safetensors"))
    ids = trajectory(40, vocab=model.config.vocab_size)
    again = mlxlis.load(hub, "float32")
    assert np.array_equal(np.array(again.logits(ids)), np.array(model.logits(ids)))


def test_cache_chunks_decode_and_batches(model):
    """Each layer's cache: the window's keys (a ring of 12), and per compressor its raw
    projections and entries; self-consistency: a chunked prefill (9, 11) then token-by-token
    decode equals the full forward over 72 tokens (entries closing mid-chunk and during
    decode); two sequences decoded together equal each alone."""
    ids = trajectory(72, vocab=model.config.vocab_size)
    caches = model.make_cache()
    model.net(mx.array([ids[:20]]), caches)
    assert [len(c.parts) for c in caches] == [1, 5, 3, 5]
    ring = caches[0].parts[0]
    assert isinstance(ring, RotatingKVCache) and ring.keys.shape[2] == 12  # the window only
    entries = caches[1].parts[2]
    assert isinstance(entries, EntryCache) and entries.windows.offset == 5
    assert caches[2].parts[2].windows.offset == 1  # one HCA window of 16 closed
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, BOUND)
    check_batched_decode(model, ids, 50, BOUND)


@pytest.mark.extended
def test_a_rejection_at_each_position_rewinds_exactly(model):
    """A verification of 1 + 5 tokens (crossing a CSA window's close) trimmed back to its
    first 1 + j: the next step's logits equal those after a verification of those 1 + j
    tokens only (bound 1e-5)."""
    vocab = model.config.vocab_size
    prompt, step = trajectory(46, seed=7, vocab=vocab), trajectory(6, seed=8, vocab=vocab)
    k = len(step) - 1
    for j in range(k + 1):
        caches, ref = model.make_cache(), model.make_cache()
        prefill(model.net, prompt, caches)
        prefill(model.net, prompt, ref)
        forward(model.net, [caches], mx.array(step, mx.int32), StepKind.VERIFY)
        assert all(c.trim(k - j) == k - j for c in caches)
        forward(model.net, [ref], mx.array(step[: j + 1], mx.int32), StepKind.VERIFY)
        after = mx.array([step[0]], mx.int32)
        got = forward(model.net, [caches], after, StepKind.DECODE)
        want = forward(model.net, [ref], after, StepKind.DECODE)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5, j


def test_a_prefix_reused_from_memory_and_from_disk_continues_exactly(model, tmp_path):
    """Turn 1 (58 tokens: the window's ring full, an open window in each compressor) kept by
    a prefix cache with a disk tier; turn 2 continues it: from memory and, after a restart,
    from the file, the rest's logits are bit for bit equal, and equal to a cold prefill
    (bound 1e-4)."""
    vocab = model.config.vocab_size
    one = trajectory(58, seed=1, vocab=vocab)
    two = one + trajectory(30, seed=2, vocab=vocab)
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
        assert reused == 58
        outs.append(np.array(model.net(mx.array([two[58:]]), cache=kept)[0, -1]))
    assert "read from disk" in cache.note and warns == []
    assert np.array_equal(outs[0], outs[1])
    cold = np.array(model.net(mx.array([two]), cache=model.make_cache())[0, -1])
    assert np.abs(outs[0] - cold).max() < 1e-4


@pytest.mark.extended
def test_speculation_and_engine_batches_give_the_lone_greedy_tokens(model):
    """Greedy n-gram speculation (its rejected drafts trimmed from every cache part) gives
    the plain greedy tokens; 4 requests in the serving engine (two speculating, two plain)
    each get their lone tokens."""
    check_speculation_and_engine(model)


def test_what_is_not_implemented_is_refused(ds, model, tmp_path):
    """Another router scoring is refused naming config.json and scoring_func; a quantized KV
    cache is refused naming kv_bits."""
    check_config_refused(
        ds("v4")[0], tmp_path, {"scoring_func": "softmax"}, UnsupportedError, "scoring_func"
    )
    from mlxlis.cache import KVFormat

    with pytest.raises(UnsupportedError) as e:
        model.net.make_cache(KVFormat(bits=8))
    assert e.value.field == "kv_bits"
    assert all(isinstance(c, JointCache) for c in model.make_cache())
