"""Granite 4.0 (Mamba-2 + attention hybrids with experts) against transformers, llama.cpp's
converter, mlx-lm and itself.

Reference parity: tiny random `granitemoehybrid` checkpoints written by transformers'
save_pretrained — Mamba-2 layers with 2 groups of B/C (8 heads), NoPE attention, 4 experts
top-2 beside the shared MLP, Granite's four scales, a tied head; and a dense one with RoPE, one
group and an untied head — against its float32 forward over 72 tokens, far past the Mamba chunk
of 16 (A_log and dt_bias set so the state remembers across chunks). GGUF: the folder converted
by llama.cpp's own convert_hf_to_gguf.py (GraniteHybridModel; tests/llama_cpp_convert.py)
gives the folder's logits. MLX-quantized: mlx-lm's 4-bit conversion against transformers on
the weights dequantized from that very folder. `convert` writes what mlx-lm's granitemoehybrid
reads. Self-consistency (the Mamba state: a RecurrentCache of the conv inputs and S): chunked
prefill ≡ decode ≡ full forward; batched ≡ alone in the serving engine; greedy n-gram
speculation ≡ plain greedy; a rejection at each position rewinds the state to exactly what
the kept tokens build; a prefix reused from memory and from the disk cache continues exactly.
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
    kind="granitemoehybrid",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=2.5,
    max_position_embeddings=512,
)
SPECS = {
    "granite4": dict(
        num_hidden_layers=5,
        layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
        intermediate_size=48,
        shared_intermediate_size=40,
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_groups=2,
        position_embedding_type="nope",
        tie_word_embeddings=True,
        **COMMON,
    ),
    "granite4_dense": dict(
        num_hidden_layers=3,
        layer_types=["attention", "mamba", "mamba"],
        intermediate_size=40,  # mlx-lm's dense MLP takes this width
        shared_intermediate_size=40,
        num_local_experts=0,
        mamba_n_groups=1,
        mamba_conv_bias=False,
        position_embedding_type="rope",
        tie_word_embeddings=False,
        **COMMON,
    ),
}
BOUND = 2e-5  # float32 against transformers; measured 7.7e-7 (relative 6.9e-7)


def remembering(model) -> None:
    """Slow decays (|A| in 0.02..0.2, dt ≈ 0.3): the state carries across chunks."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mamba is not None:
                h = layer.mamba.A_log.shape[0]
                layer.mamba.A_log.copy_(torch.log(0.02 + 0.18 * torch.rand(h, generator=g)))
                layer.mamba.dt_bias.copy_(-1.0 + 0.1 * torch.randn(h, generator=g))


def build(folder, spec):
    return build_tiny(folder, spec, adjust=remembering)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


@pytest.fixture(scope="module")
def model(granite):
    return mlxlis.load(granite("granite4")[0], "float32")


@pytest.fixture(scope="module")
def gguf(granite, tmp_path_factory):
    """The MoE folder (hub layer names) converted once by llama.cpp's converter, at f32."""
    tmp = tmp_path_factory.mktemp("granite4_gguf")
    folder = hub_copy(granite("granite4")[0], tmp / "hub")
    return folder, llama_cpp_convert(folder, tmp / "granite4.gguf")


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(granite, name):
    """Reference parity over 72 tokens (4.5 Mamba chunks) within 2e-5: the Mamba-2 mixer
    (conv, grouped B/C, dt bias and softplus, D skip, the group-gated norm), NoPE or RoPE
    attention scaled by attention_multiplier, experts beside the shared MLP or that MLP alone,
    the embedding / residual / logit scales, tied and untied heads; and the Mamba layers matter
    (their D zeroed moves the logits)."""
    folder, ref = granite(name)
    m = mlxlis.load(folder, "float32")
    c = m.config
    assert c.family == "granitemoehybrid"
    assert [c.is_linear(i) for i in range(c.num_hidden_layers)] == [
        t == "mamba" for t in SPECS[name]["layer_types"]
    ]
    assert (c.moe is not None) == (name == "granite4")
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(m.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 0.5
    mixer = next(layer.mamba for layer in m.net.model.layers if "mamba" in layer)
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
    assert kinds == {"RecurrentCache", "KVCache"}


def test_speculation_and_engine_batches_give_the_lone_greedy_tokens(model):
    """Greedy n-gram speculation gives the plain greedy tokens (proposals verified, some
    rejected: the Mamba states rewound); 4 requests of different lengths in the serving engine
    (two speculating, their verification batched; two plain, in the batched decode step) each
    get their lone tokens."""
    check_speculation_and_engine(model)


def test_a_rejection_at_each_position_rewinds_the_mamba_state_exactly(model):
    """A verification of 1 + 5 tokens trimmed back to its first 1 + j: every conv state, SSM
    state and KV cache equals that of a verification of those 1 + j tokens only, and so do the
    next step's logits (bound 1e-5: fewer rows take other matmul kernels)."""

    def shapes(c) -> None:
        assert c.conv_state.shape[1] == 3 and c.recurrent.shape == (1, 8, 16, 16)

    check_rewinds(model, shapes)


def test_a_prefix_reused_from_memory_and_from_disk_continues_exactly(model, tmp_path):
    """Turn 1 (60 tokens, a snapshot at 50) kept by a prefix cache with a disk tier; turn 2
    shares its first 50: the cache returns there (the Mamba states from their snapshot), from
    memory and, after a restart, from the file — the logits of the rest bit for bit equal,
    and equal to a cold prefill up to the chunking's rounding (bound 1e-4)."""
    check_prefix_reuse(model, tmp_path)


def hub_copy(folder, dest, **extra):
    """A copy stating the hub's layer names ("mamba" / "attention"; llama.cpp's converter finds
    the attention layers by them) and `extra` keys."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [legacy[t] for t in cfg["layer_types"]]
    (dest / "config.json").write_text(json.dumps({**cfg, **extra}))
    return dest


def same_weights(m, src) -> None:
    """A GGUF model's weights are the folder's (1e-6: A_log goes through exp and log), its
    split shared MLP concatenated back, Q/K un-permuted (invisible in NoPE logits)."""
    ours = dict(tree_flatten(m.net.parameters()))
    for name, want in tree_flatten(src.net.parameters()):
        if name.endswith("shared_mlp.gate_up_proj.weight"):  # split in the file, gate first
            p = name.removesuffix("gate_up_proj.weight")
            got = mx.concatenate([ours.pop(p + "gate_proj.weight"), ours.pop(p + "up_proj.weight")])
        else:
            got = ours.pop(name)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-6, name
    assert ours == {}


def test_gguf_from_llama_cpp_converter_equals_the_folder(gguf):
    """llama.cpp's convert_hf_to_gguf.py (arch granitehybrid: A stored as −exp(A_log) (H, 1),
    D as (H, 1), the conv kernel squeezed, the gated norm's weight by group, Q/K rows permuted,
    the shared MLP split, head_count_kv 0 on Mamba layers, the scales as metadata) at f32: the
    folder's structure, weights and logits (bound 1e-5: A_log goes through exp and log)."""
    folder, path = gguf
    m, src = mlxlis.load(path, "float32"), mlxlis.load(folder, "float32")
    c, s = m.config, src.config
    assert c.family == "granitemoehybrid" and c.layer_types == s.layer_types
    assert c.moe == s.moe and c.num_key_value_heads == 2 and c.attention == s.attention
    # no chunk size in the file (the default, 256); eps read as float32
    assert replace(c.family_config.mamba, chunk=16, eps=1e-6) == s.family_config.mamba
    same_weights(m, src)
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(m.logits(ids)) - np.array(src.logits(ids))).max() < 1e-5


def test_mlx_quantized_folder_matches_its_dequantized_weights(granite, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; its router at 8 bits, its conv kernel saved
    (C, K, 1), its experts stacked) loads as it is, and gives the logits of transformers on the
    weights dequantized from its files (float32; bound 2e-5)."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = granite("granite4")
    out = tmp_path / "q4"
    src = str(hub_copy(folder, tmp_path / "copy"))
    mlx_lm_convert(src, str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    m = mlxlis.load(out, "float32")
    assert m.format == "safetensors (MLX quantized)"
    dense, stacks = {}, {}
    for name, w in dequantized_folder(out).items():
        if name.endswith("conv1d.weight"):
            w = np.ascontiguousarray(w.transpose(0, 2, 1))  # back to torch's (C, 1, K)
        if ".switch_mlp." in name:
            stacks[name] = w
            continue
        dense[name.replace("router.layer.", "router.")] = torch.from_numpy(w)
    for name in [n for n in stacks if n.endswith("gate_proj.weight")]:
        p = name.split(".switch_mlp.")[0]  # transformers 5's fused experts, gate rows first
        both = np.concatenate([stacks[name], stacks[f"{p}.switch_mlp.up_proj.weight"]], axis=1)
        dense[f"{p}.experts.gate_up_proj"] = torch.from_numpy(both)
        down = stacks[f"{p}.switch_mlp.down_proj.weight"]
        dense[f"{p}.experts.down_proj"] = torch.from_numpy(down)
    twin = ref.__class__(ref.config).eval()
    missing = twin.load_state_dict(dense, strict=False).missing_keys
    assert missing in ([], ["lm_head.weight"]), missing
    twin.tie_weights()
    ids = trajectory(48, vocab=m.config.vocab_size)
    delta = np.abs(np.array(m.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads_and_inspect_says_it(granite, model, gguf, tmp_path):
    """`convert`'s folder of the dense, one-group model (mlx-lm's gated norm is over all
    channels: one group) and of the GGUF file (its split shared MLP fused back): mlx-lm's
    granitemoehybrid gives our logits on it (bound 2e-5), it reloads to the same config and
    bit-identical logits; `inspect` names the Mamba-2 layers, and the footprint counts their
    states (conv inputs and S, float32, with snapshots)."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report
    from mlxlis.models.footprint import footprint

    from mlx_lm import load as mlx_lm_load

    folder, _ = granite("granite4_dense")
    dense = mlxlis.load(folder, "float32")
    ids = trajectory(48, vocab=dense.config.vocab_size)
    ours = np.array(dense.logits(ids))
    out = convert(folder, tmp_path / "out", dtype="float32")
    theirs_model, _ = mlx_lm_load(str(out))
    assert np.abs(ours - np.array(theirs_model(mx.array([ids]))[0])).max() < BOUND
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    assert again.config == dense.config.with_(source=again.config.source)
    back = mlxlis.load(convert(gguf[1], tmp_path / "from_gguf", dtype="float32"), "float32")
    moe_ids = trajectory(40, vocab=model.config.vocab_size)
    assert np.abs(np.array(back.logits(moe_ids)) - np.array(model.logits(moe_ids))).max() < 1e-5
    text = format_report(model_report(model))
    assert "Mamba-2 state space layers in 3 of 5" in text and "NoPE" in text
    state = 4 * (3 * (128 + 2 * 2 * 16) + 128 * 16)  # (K − 1)·conv_dim + inner·N, float32
    kv = 2 * footprint(model).per_token  # the attention layers' share grows with the length
    assert footprint(model).fixed == 3 * state * (1 + RecurrentCache.SNAPSHOTS) and kv > 0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": ["mamba", "conv", "mamba", "mamba", "attention"]}, "layer_types"),
        ({"layer_types": ["mamba", "attention"]}, "layer_types"),
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
        ({"mamba_d_head": 12}, "mamba_d_head"),
        ({"mamba_d_conv": 1}, "mamba_d_conv"),
        ({"mamba_chunk_size": 0}, "mamba_chunk_size"),
        ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"logits_scaling": 0}, "logits_scaling"),
        ({"layer_types": [1, 2, 3, 4, 5]}, "layer_types"),
        ({"mamba_conv_bias": "no"}, "mamba_conv_bias"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(granite, tmp_path, change, field):
    """An unknown or miscounted layer type, groups that do not divide the heads, heads that do
    not make the inner width, a kernel without a state, a bad chunk or dt limit, an unknown
    position embedding, a zero scale, layer types that are no names, a bias flag spelt as a
    string: an MlxlisError naming config.json and the field."""
    from mlxlis.errors import MlxlisError

    check_config_refused(granite("granite4")[0], tmp_path, change, MlxlisError, field)


@pytest.mark.extended  # `make test-all`: the same forward as the tiny specs, at larger shapes
def test_larger_shapes_match_transformers_fp32(tmp_path):
    """Reference parity at larger shapes: 16 Mamba heads of 16 dims in 4 groups, a state of 32,
    a chunk of 32 over 300 tokens (9.4 chunks), 8 experts top-2, 6 layers (bound 5e-5)."""
    spec = {
        **SPECS["granite4"],
        "hidden_size": 128,
        "mamba_n_heads": 16,
        "mamba_n_groups": 4,
        "mamba_d_state": 32,
        "mamba_chunk_size": 32,
        "num_local_experts": 8,
        "num_hidden_layers": 6,
        "layer_types": ["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
    }
    ref = build(tmp_path, spec)
    m = mlxlis.load(tmp_path, "float32")
    ids = trajectory(300, vocab=m.config.vocab_size)
    delta = np.abs(np.array(m.logits(ids)) - reference_logits(ref, ids)).max()
    assert delta < 5e-5, f"max |Δ| = {delta}"


@pytest.mark.extended  # `make test-all`: another run of llama.cpp's converter (about 10 s)
def test_dense_gguf_from_llama_cpp_converter_equals_the_folder(granite, tmp_path):
    """The dense model through llama.cpp's converter (its one MLP as ffn_gate / ffn_up /
    ffn_down, a conv without bias) gives the folder's config, weights and logits (bound 1e-5).
    The folder is stated NoPE: the converter writes RoPE (rope.scaling.finetuned) for Bamba and
    all-attention models only, so a Granite hybrid's GGUF is NoPE, as released ones are."""
    folder = hub_copy(
        granite("granite4_dense")[0], tmp_path / "hub", position_embedding_type="nope"
    )
    path = llama_cpp_convert(folder, tmp_path / "dense.gguf")
    m, src = mlxlis.load(path, "float32"), mlxlis.load(folder, "float32")
    c, s = m.config, src.config
    assert c.moe is None and c.layer_types == s.layer_types and c.attention == s.attention
    assert not c.family_config.mamba.conv_bias and c.family_config.split_shared
    same_weights(m, src)
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(m.logits(ids)) - np.array(src.logits(ids))).max() < 1e-5
