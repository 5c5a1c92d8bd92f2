"""Nemotron-H (Mamba-2, attention, relu² MLP and expert blocks per a layer pattern) against
transformers, llama.cpp's converter, mlx-lm and itself.

Reference parity: tiny random `nemotron_h` checkpoints written by transformers' save_pretrained
— Mamba-2 blocks with 2 groups of B/C (8 heads), attention without positions, expert blocks (4
relu² experts top-2 by sigmoid scores with a correction bias, renormalised and scaled, beside
a shared relu² MLP) for pattern ME*ME; and MLP blocks for M-*M- — against its float32 forward
over 72 tokens, far past the Mamba chunk of 16 (A_log and dt_bias set so the state remembers
across chunks). GGUF: the folders converted by llama.cpp's own convert_hf_to_gguf.py
(NemotronHModel; tests/llama_cpp_convert.py) give the folders' logits. MLX-quantized: mlx-lm's
4-bit conversion against transformers on the weights dequantized from that very folder.
`convert` writes what mlx-lm's nemotron_h reads. Self-consistency (Mamba states in
RecurrentCaches, attention in KV caches, the MLP and expert blocks' StatelessCaches counting
positions): chunked prefill ≡ decode ≡ full forward; batched ≡ alone in the serving engine;
greedy n-gram speculation ≡ plain greedy; a rejection at each position rewinds every cache to
exactly what the kept tokens build; a prefix reused from memory and from the disk cache
continues exactly.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlxlis
from mlxlis.cache import RecurrentCache

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    check_config_refused,
    check_prefix_reuse,
    check_rewinds,
    check_speculation_and_engine,
    dequantized_folder,
    tiny_models,
    trajectory,
)
from llama_cpp_convert import convert as llama_cpp_convert
from mlx.utils import tree_flatten

COMMON = dict(
    kind="nemotron_h",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    max_position_embeddings=512,
)
SPECS = {
    "nemotron_h": dict(
        hybrid_override_pattern="ME*ME",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=1.5,
        n_group=1,
        topk_group=1,
        **COMMON,
    ),
    "nemotron_h_dense": dict(hybrid_override_pattern="M-*M-", use_conv_bias=False, **COMMON),
}
BOUND = 2e-5  # float32 against transformers; measured 1.9e-6 (relative 7.6e-7)


def remembering(model) -> None:
    """Slow decays (|A| in 0.02..0.2, dt ≈ 0.3): the state carries across chunks."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                mixer = layer.mixer
                h = mixer.A_log.shape[0]
                mixer.A_log.copy_(torch.log(0.02 + 0.18 * torch.rand(h, generator=g)))
                mixer.dt_bias.copy_(-1.0 + 0.1 * torch.randn(h, generator=g))
            if layer.block_type == "moe":  # a correction bias that sways the choice
                bias = layer.mixer.gate.e_score_correction_bias
                bias.copy_(0.3 * torch.randn(bias.shape, generator=g))


def build(folder, spec):
    return build_tiny(folder, spec, adjust=remembering)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


@pytest.fixture(scope="module")
def model(nemotron):
    return mlxlis.load(nemotron("nemotron_h")[0], "float32")


@pytest.fixture(scope="module")
def gguf(nemotron, tmp_path_factory):
    """get(name) -> (the folder with the hub's pattern, its GGUF by llama.cpp's converter at
    f32), each converted once."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            tmp = tmp_path_factory.mktemp(f"{name}_gguf")
            folder = hub_copy(nemotron(name)[0], tmp / "hub")
            made[name] = folder, llama_cpp_convert(folder, tmp / f"{name}.gguf")
        return made[name]

    return get


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(nemotron, name):
    """Reference parity over 72 tokens (4.5 Mamba chunks) within 2e-5: the Mamba-2 mixer
    (conv with and without bias, grouped B/C, dt bias and softplus, D skip, the group-gated
    norm), attention without positions, relu² MLP blocks, expert blocks (grouped sigmoid
    routing with its correction bias, scaled weights, the shared MLP), the pattern's layout;
    and the Mamba layers matter (their D zeroed moves the logits)."""
    folder, ref = nemotron(name)
    m = mlxlis.load(folder, "float32")
    c = m.config
    assert c.family == "nemotron_h"
    pattern = SPECS[name]["hybrid_override_pattern"]
    assert [c.is_linear(i) for i in range(c.num_hidden_layers)] == [t == "M" for t in pattern]
    assert (c.moe is not None) == (name == "nemotron_h")
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(m.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 0.5
    mixer = next(layer.mixer for layer in m.net.model.layers if "A_log" in layer.mixer)
    saved = mixer.D
    mixer.D = mx.zeros_like(saved)
    assert np.abs(np.array(m.logits(ids)) - ours).max() > 1e-2
    mixer.D = saved


def test_chunked_prefill_decode_and_batches_equal_the_full_forward(model):
    """Self-consistency: token-by-token decode and prefills in chunks of 1, 5, 16, 17 and 40
    (below, at and past the scan's chunk of 16) with a cache equal the full forward; two
    sequences at different offsets decoded together equal each alone."""
    ids = trajectory(80, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    for chunk in (1, 5, 16, 17, 40):
        cache = model.make_cache()
        outs = [
            np.array(model.net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 1e-4, chunk
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 41, 1e-4)
    kinds = {type(c).__name__ for c in model.make_cache()}
    assert kinds == {"RecurrentCache", "KVCache", "StatelessCache"}


def test_speculation_and_engine_batches_give_the_lone_greedy_tokens(model):
    """Greedy n-gram speculation gives the plain greedy tokens (proposals verified, some
    rejected: the Mamba states rewound); 4 requests of different lengths in the serving engine
    (two speculating, their verification batched; two plain, in the batched decode step) each
    get their lone tokens."""
    check_speculation_and_engine(model)


def test_a_rejection_at_each_position_rewinds_the_mamba_state_exactly(model):
    """A verification of 1 + 5 tokens trimmed back to its first 1 + j: every conv state, SSM
    state, KV cache and position count equals that of a verification of those 1 + j tokens
    only, and so do the next step's logits (bound 1e-5: fewer rows take other matmul kernels)."""

    def shapes(c) -> None:
        assert c.conv_state.shape[1] == 3 and c.recurrent.shape == (1, 8, 16, 16)

    check_rewinds(model, shapes)


def test_a_prefix_reused_from_memory_and_from_disk_continues_exactly(model, tmp_path):
    """Turn 1 (60 tokens, a snapshot at 50) kept by a prefix cache with a disk tier; turn 2
    shares its first 50: the cache returns there (the Mamba states from their snapshot), from
    memory and, after a restart, from the file — the logits of the rest bit for bit equal,
    and equal to a cold prefill up to the chunking's rounding (bound 1e-4)."""
    check_prefix_reuse(model, tmp_path)


STACKS = (
    ("switch_mlp.fc1.weight", "experts.up_proj"),
    ("switch_mlp.fc2.weight", "experts.down_proj"),
)


def hub_copy(folder, dest, **extra):
    """A copy stating the hub's hybrid_override_pattern (llama.cpp's converter reads MLP blocks
    only from it) instead of layers_block_type, and `extra` keys."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    letter = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    cfg["hybrid_override_pattern"] = "".join(letter[t] for t in cfg.pop("layers_block_type"))
    (dest / "config.json").write_text(json.dumps({**cfg, **extra}))
    return dest


def test_gguf_from_llama_cpp_converter_equals_the_folder(gguf):
    """llama.cpp's convert_hf_to_gguf.py (arch nemotron_h_moe: A stored as −exp(A_log) (H, 1),
    D as (H, 1), the conv kernel squeezed, the gated norm's weight by group, Q/K as they are,
    the experts stacked, the block kinds as per-layer head_count_kv and feed_forward_length,
    the eps as layer_norm_epsilon) at f32: the folder's structure, weights (A_log through exp
    and log: 1e-6) and logits (bound 1e-5). Its dense arch (nemotron_h) is not tested: with
    transformers 5 installed the converter reads num_experts_per_tok from the config class's
    defaults and writes nemotron_h_moe with no MLP widths, which the loader refuses by name."""
    folder, path = gguf("nemotron_h")
    m, src = mlxlis.load(path, "float32"), mlxlis.load(folder, "float32")
    c, s = m.config, src.config
    assert c.family == "nemotron_h" and c.layer_types == s.layer_types
    assert c.moe == s.moe and c.num_key_value_heads == 2 and c.attention == s.attention
    assert c.family_config.routing == s.family_config.routing
    # no chunk size in the file (the default, 128); eps read as float32
    assert replace(c.family_config.mamba, chunk=16, eps=1e-5) == s.family_config.mamba
    ours, theirs = dict(tree_flatten(m.net.parameters())), dict(tree_flatten(src.net.parameters()))
    assert set(ours) == set(theirs)
    assert all(np.abs(np.array(ours[k]) - np.array(theirs[k])).max() < 1e-6 for k in ours)
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(m.logits(ids)) - np.array(src.logits(ids))).max() < 1e-5


def test_mlx_quantized_folder_matches_its_dequantized_weights(nemotron, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; its conv kernel saved (C, K, 1), its experts
    stacked as switch_mlp.fc1 / fc2) loads as it is, and gives the logits of transformers on
    the weights dequantized from its files (float32; bound 2e-5)."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = nemotron("nemotron_h")
    out = tmp_path / "q4"
    mlx_lm_convert(str(folder), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    m = mlxlis.load(out, "float32")
    assert m.format == "safetensors (MLX quantized)"
    dense = {}
    for name, w in dequantized_folder(out).items():
        if name.endswith("conv1d.weight"):
            w = np.ascontiguousarray(w.transpose(0, 2, 1))  # back to torch's (C, 1, K)
        for mine, theirs in STACKS:  # transformers 5's stacked experts
            name = name.replace(mine, theirs)
        dense[name.replace("backbone.", "model.")] = torch.from_numpy(w)
    twin = ref.__class__(ref.config).eval()
    missing = twin.load_state_dict(dense, strict=False).missing_keys
    assert missing == [], missing
    ids = trajectory(48, vocab=m.config.vocab_size)
    delta = np.abs(np.array(m.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads_and_inspect_says_it(nemotron, model, gguf, tmp_path):
    """`convert`'s folders of both models (the experts stacked) and of the expert model's GGUF
    file: mlx-lm's nemotron_h gives our logits on them (bound 2e-5), each reloads to the same
    config and bit-identical logits; `inspect` names the Mamba-2 layers and the pattern, and
    the footprint counts their states (conv inputs and S, float32, with snapshots)."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report
    from mlxlis.models.footprint import footprint

    from mlx_lm import load as mlx_lm_load

    for name in SPECS:
        folder, _ = nemotron(name)
        ours_model = mlxlis.load(folder, "float32")
        ids = trajectory(48, vocab=ours_model.config.vocab_size)
        ours = np.array(ours_model.logits(ids))
        out = convert(folder, tmp_path / name, dtype="float32")
        theirs_model, _ = mlx_lm_load(str(out))
        assert np.abs(ours - np.array(theirs_model(mx.array([ids]))[0])).max() < BOUND, name
        again = mlxlis.load(out, "float32")
        assert np.array_equal(np.array(again.logits(ids)), ours)
        assert again.config == ours_model.config.with_(source=again.config.source)
    back = convert(gguf("nemotron_h")[1], tmp_path / "from_gguf", dtype="float32")
    moe_ids = trajectory(40, vocab=model.config.vocab_size)
    got = np.array(mlxlis.load(back, "float32").logits(moe_ids))
    assert np.abs(got - np.array(model.logits(moe_ids))).max() < 1e-5
    text = format_report(model_report(model))
    assert "Mamba-2 state space layers in 2 of 5" in text and "ME*ME" in text
    state = 4 * (3 * (128 + 2 * 2 * 16) + 128 * 16)  # (K − 1)·conv_dim + inner·N, float32
    fp = footprint(model)
    assert fp.fixed == 2 * state * (1 + RecurrentCache.SNAPSHOTS) and fp.per_token > 0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layers_block_type": ["mamba", "conv", "moe"]}, "layers_block_type"),
        ({"hybrid_override_pattern": "MX*ME"}, "hybrid_override_pattern"),
        ({"n_groups": 3}, "n_groups"),
        ({"conv_kernel": 1}, "conv_kernel"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
        ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
        ({"n_group": 3}, "n_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"n_group": "2"}, "n_group"),
        ({"use_conv_bias": "false"}, "use_conv_bias"),
        ({"moe_latent_size": -4}, "moe_latent_size"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(nemotron, tmp_path, change, field):
    """An unknown layer kind in the list or the pattern, groups that do not divide the heads,
    a kernel without a state, a bad chunk or dt limit, another MLP activation, expert groups
    that do not divide the experts or are no number, more experts per token than experts, a
    bias flag spelt as a string, a negative latent width: an MlxlisError naming config.json
    and the field."""
    from mlxlis.errors import MlxlisError

    check_config_refused(nemotron("nemotron_h")[0], tmp_path, change, MlxlisError, field)


@pytest.mark.extended  # `make test-all`: the same forward as the tiny specs, at larger shapes
def test_larger_shapes_match_transformers_fp32(tmp_path):
    """Reference parity at larger shapes: 16 Mamba heads of 16 dims in 4 groups, a state of 32,
    a chunk of 32 over 300 tokens (9.4 chunks), 8 experts top-2 in 2 groups (1 used), pattern
    ME*MEM-E (bound 5e-5)."""
    spec = {
        **SPECS["nemotron_h"],
        "hidden_size": 128,
        "mamba_num_heads": 16,
        "n_groups": 4,
        "ssm_state_size": 32,
        "chunk_size": 32,
        "n_routed_experts": 8,
        "n_group": 2,
        "topk_group": 1,
        "hybrid_override_pattern": "ME*MEM-E",
    }
    ref = build(tmp_path, spec)
    m = mlxlis.load(tmp_path, "float32")
    ids = trajectory(300, vocab=m.config.vocab_size)
    delta = np.abs(np.array(m.logits(ids)) - reference_logits(ref, ids)).max()
    assert delta < 5e-5, f"max |Δ| = {delta}"
