"""LFM2 (gated short convolutions + GQA attention) against transformers, llama.cpp's converter,
mlx-lm and itself.

Reference parity: tiny random `lfm2` checkpoints written by transformers' save_pretrained (3
query heads on 1 KV head, conv and attention layers both present, the MLP width adjusted by
block_auto_adjust_ff_dim; a tied head with L = 3 and no conv bias, and an untied one with L = 4
and conv biases) against its float32 forward over 72 tokens. GGUF: the folder converted by
llama.cpp's own convert_hf_to_gguf.py (its LFM2Model; tests/llama_cpp_convert.py) gives the
folder's logits. MLX-quantized: mlx-lm's 4-bit conversion against transformers on the weights
dequantized from that very folder. `convert` writes what mlx-lm's lfm2 reads. Self-consistency
(the conv state: a RecurrentCache of the last L − 1 gated inputs): chunked prefill ≡ decode ≡
full forward; batched ≡ alone in the serving engine; greedy n-gram speculation ≡ plain greedy;
a rejection at each position rewinds the conv state to exactly what the kept tokens build; a
prefix reused from memory and from the disk cache continues exactly.
"""

from __future__ import annotations

import json
import shutil

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

CONV, FULL = "conv", "full_attention"
COMMON = dict(
    kind="lfm2",
    hidden_size=96,
    intermediate_size=192,  # adjusted: int(2·192/3) = 128, a multiple of 16
    block_multiple_of=16,
    num_attention_heads=3,
    num_key_value_heads=1,
    max_position_embeddings=512,
)
SPECS = {
    "lfm2": dict(num_hidden_layers=5, layer_types=[CONV, CONV, FULL, CONV, FULL], **COMMON),
    "lfm2_bias": dict(
        num_hidden_layers=4,
        layer_types=[FULL, CONV, CONV, FULL],
        conv_L_cache=4,
        conv_bias=True,
        tie_word_embeddings=False,
        **COMMON,
    ),
}
BOUND = 2e-5  # float32 against transformers; measured 5.1e-6


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build_tiny)


@pytest.fixture(scope="module")
def model(lfm2):
    return mlxlis.load(lfm2("lfm2")[0], "float32")


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(lfm2, name):
    """Reference parity over 72 tokens (far past the conv length) within 2e-5: the gated short
    convolution, per-head q/k norms, the adjusted MLP width, the final `embedding_norm`, a tied
    and an untied head; and the conv layers matter (their B gate zeroed moves the logits)."""
    folder, ref = lfm2(name)
    m = mlxlis.load(folder, "float32")
    c = m.config
    assert c.family == "lfm2" and c.layer_types == tuple(SPECS[name]["layer_types"])
    assert c.mlp.intermediate_size == 128 and c.head_dim == 32
    assert c.tie_word_embeddings == (name == "lfm2")
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(m.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0
    layer = m.net.model.layers[1].conv
    saved = layer.in_proj.weight
    layer.in_proj.weight = mx.concatenate([mx.zeros_like(saved[:96]), saved[96:]])
    assert np.abs(np.array(m.logits(ids)) - ours).max() > 1e-2
    layer.in_proj.weight = saved


def test_chunked_prefill_decode_and_batches_equal_the_full_forward(model):
    """Self-consistency: token-by-token decode and chunked prefills (chunks of 1, 2, 5 and 40:
    shorter and longer than the conv length) with a cache equal the full forward; two
    sequences at different offsets decoded together equal each alone."""
    ids = trajectory(80, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    for chunk in (1, 2, 5, 40):
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
    rejected: the conv states rewound); 4 requests in the serving engine (two speculating,
    their verification batched; two plain, in the batched decode step) each get their lone
    tokens."""
    check_speculation_and_engine(model)


def test_a_rejection_at_each_position_rewinds_the_conv_state_exactly(model):
    """A verification of 1 + 5 tokens trimmed back to its first 1 + j: every conv state and KV
    cache equals that of a verification of those 1 + j tokens only (conv states bit for bit;
    the kept states are slices of the same inputs), and so do the next step's logits (bound
    1e-5: fewer rows take other matmul kernels)."""

    def shapes(c) -> None:
        assert c.conv_state.shape[1] == 2

    check_rewinds(model, shapes)


def test_a_prefix_reused_from_memory_and_from_disk_continues_exactly(model, tmp_path):
    """Turn 1 (60 tokens, a snapshot at 50) kept by a prefix cache with a disk tier; turn 2
    shares its first 50: the cache returns there (the conv states from their snapshot), from
    memory and, after a restart, from the file — the logits of the rest bit for bit equal,
    and equal to a cold prefill up to the chunking's rounding (bound 1e-4)."""
    check_prefix_reuse(model, tmp_path)


def test_gguf_from_llama_cpp_converter_equals_the_folder(lfm2, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (arch lfm2: the conv kernel squeezed to (C, L),
    head_count_kv 0 on conv layers, the MLP width pre-adjusted, token_embd_norm as the final
    norm) at f32: the folder's structure and logits (measured equal; bound 1e-6). Its squeeze
    of every `conv.conv` tensor fails on a conv bias (1-D): no released LFM2 has one."""
    folder = lfm2("lfm2")[0]
    path = llama_cpp_convert(folder, tmp_path / "lfm2.gguf")
    m, src = mlxlis.load(path, "float32"), mlxlis.load(folder, "float32")
    c, s = m.config, src.config
    assert c.family == "lfm2" and c.tie_word_embeddings
    assert c.layer_types == s.layer_types and c.family_config == s.family_config
    assert c.mlp == s.mlp and c.num_key_value_heads == 1
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(m.logits(ids)) - np.array(src.logits(ids))).max() < 1e-6


def with_block_dim(folder, dest):
    """A copy stating block_dim, which mlx-lm's lfm2 requires (hub configs carry it)."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "block_dim": cfg["hidden_size"]}))
    return dest


def test_mlx_quantized_folder_matches_its_dequantized_weights(lfm2, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; its conv kernel saved as (C, L, 1)) loads as it
    is, and gives the logits of transformers on the weights dequantized from its files
    (float32; bound 2e-5)."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = lfm2("lfm2")
    out = tmp_path / "q4"
    src = str(with_block_dim(folder, tmp_path / "copy"))
    mlx_lm_convert(src, str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    m = mlxlis.load(out, "float32")
    assert m.format == "safetensors (MLX quantized)"
    dense = {}
    for name, w in dequantized_folder(out).items():
        if name.endswith("conv.conv.weight"):
            w = np.ascontiguousarray(w.transpose(0, 2, 1))  # back to torch's (C, 1, L)
        dense[name] = torch.from_numpy(w)
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(dense, strict=False)
    twin.tie_weights()
    ids = trajectory(48, vocab=m.config.vocab_size)
    delta = np.abs(np.array(m.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads_and_inspect_says_it(lfm2, model, tmp_path):
    """`convert`'s folder: mlx-lm's lfm2 gives our logits on it (bound 2e-5), it reloads to the
    same config and bit-identical logits; `inspect` names the short convolutions, and the
    footprint counts their states (L − 1 inputs × hidden per conv layer, with snapshots)."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report
    from mlxlis.models.footprint import footprint

    from mlx_lm import load as mlx_lm_load

    folder, _ = lfm2("lfm2")
    ids = trajectory(48, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    out = convert(folder, tmp_path / "out", dtype="float32")
    theirs_model, _ = mlx_lm_load(str(out))
    assert np.abs(ours - np.array(theirs_model(mx.array([ids]))[0])).max() < BOUND
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    assert again.config == model.config.with_(source=again.config.source)
    text = format_report(model_report(model))
    assert "gated short convolution" in text and "in 3 of 5 layers" in text
    fixed = 3 * 2 * 96 * 4 * (1 + RecurrentCache.SNAPSHOTS)  # layers · (L − 1) · hidden · f32
    assert footprint(model).fixed == fixed


def test_hub_spellings_read_as_transformers_reads_them(lfm2, tmp_path):
    """Hub configs' block_ff_dim, tie_embedding and full_attn_idxs (no layer_types) give the
    folder's config, as transformers' Lfm2Config reads them."""
    import transformers

    folder, _ = lfm2("lfm2")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["layer_types"], cfg["tie_word_embeddings"]
    cfg.update(full_attn_idxs=[2, 4], block_ff_dim=cfg.pop("intermediate_size"), tie_embedding=True)
    hub = tmp_path / "hub"
    shutil.copytree(folder, hub)
    (hub / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoConfig.from_pretrained(hub)
    c = mlxlis.load(hub, "float32").config
    assert list(c.layer_types) == theirs.layer_types and theirs.intermediate_size == 192
    assert c == mlxlis.load(folder, "float32").config.with_(source=c.source)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": [CONV, "linear_attention", FULL, CONV, FULL]}, "layer_types"),
        ({"layer_types": [CONV, FULL]}, "layer_types"),
        ({"conv_L_cache": 1}, "conv_L_cache"),
        ({"conv_L_cache": 0}, "conv_L_cache"),
        ({"block_multiple_of": 0}, "block_multiple_of"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(lfm2, tmp_path, change, field):
    """An unknown or miscounted layer type, a kernel without a state, a bad multiple: an
    MlxlisError naming config.json and the field, never a model built on a guess."""
    from mlxlis.errors import MlxlisError

    check_config_refused(lfm2("lfm2")[0], tmp_path, change, MlxlisError, field)
