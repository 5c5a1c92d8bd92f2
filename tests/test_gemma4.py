"""Gemma 4 (text) against transformers, mlx-lm and itself.

Reference parity: tiny random checkpoints written by transformers' save_pretrained
(`gemma4_text`; transformers 5 saves the full layers' head_dim / KV heads as
`per_layer_config`) against transformers' float32 forward over 72 tokens, 9 times the sliding
window: sliding and full layers with their own head dims, KV heads and RoPE (proportional on
full layers, with and without a factor), per-layer inputs, KV-shared layers with double-wide
MLPs, attention_k_eq_v, the MoE block beside the dense MLP, tied and untied heads, a final
softcap, and per-layer scalars set away from 1 (randomize leaves buffers alone). These models
amplify float32 rounding (attention scale 1 on normed q and k): transformers' own float32
forward is 8.8e-6 from its float64 one, and mlxlis' fused vs explicit attention
(MLXLIS_FAST_MATH=0 / 1) alone moves the logits by 2.5e-5; bounds sit above that floor, and
every convention tested moves them by 1e-2 or more when broken. Second reference: mlx-lm's
gemma4_text on the same weights (and its 4-bit conversion). Self-consistency: chunked prefill
and one-token decode with the caches (KV-shared layers read another layer's) against the full
forward; `convert` round trips.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlxlis
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.generation.steps import prefill
from mlxlis.models.experts import QuantizedSwitchLinear

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_config_refused,
    randomize,
    tiny_models,
    train_tokenizer,
    trajectory,
)

S, F = "sliding_attention", "full_attention"
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    head_dim=16,
    sliding_window=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}
SPECS = {
    # E2B-like: per-layer inputs, the last 2 of 6 layers KV-shared with double-wide MLPs,
    # full layers of head_dim 32 (4 of 16 pairs turned), final softcap, tied
    "e2b": dict(
        num_hidden_layers=6,
        num_key_value_heads=1,
        global_head_dim=32,
        layer_types=[S, S, S, F, S, F],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=400,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        rope_parameters=ROPE,
        tie_word_embeddings=True,
    ),
    # 26B-A4B-like: MoE (top-2 of 4) beside the dense MLP, attention_k_eq_v with 1 global KV
    # head (2 on sliding layers), no per-layer inputs, 8 of 16 pairs turned, untied
    "moe": dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, F, S, F],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
        rope_parameters={**ROPE, F: {**ROPE[F], "partial_rotary_factor": 0.5}},
    ),
    # RoPE variants (Hugging Face only: llama.cpp's converter writes no RoPE factor): a
    # proportional factor on full layers, proportional RoPE on sliding layers too, 31B-like
    # attention_k_eq_v without global KV heads
    "rope": dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        global_head_dim=24,
        attention_k_eq_v=True,
        layer_types=[S, F, S, F],
        hidden_size_per_layer_input=0,
        rope_parameters={
            S: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
            F: {
                "rope_type": "proportional",
                "factor": 2.0,
                "partial_rotary_factor": 0.75,
                "rope_theta": 1e6,
            },
        },
    ),
    # everything at once: per-layer inputs, KV sharing, double-wide, k_eq_v, MoE, softcap
    "all": dict(
        num_hidden_layers=5,
        num_key_value_heads=2,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, S, F, S, F],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=400,
        use_double_wide_mlp=True,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        final_logit_softcapping=30.0,
        rope_parameters=ROPE,
        tie_word_embeddings=True,
    ),
}
NAMES = list(SPECS)


def build(folder: Path, spec: dict, seed: int = 0):
    """A tiny random gemma4_text checkpoint written by transformers; the model (fp32, eval)."""
    return build_tiny(
        folder,
        {"kind": "gemma4_text", **COMMON, **spec},
        seed,
        adjust=lambda m: scalar_noise(m, seed),
        pad_token_id=1,
    )


def scalar_noise(model, seed: int) -> None:
    """layer_scalar is a buffer (randomize touches parameters only): set it away from 1."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    # output_hidden_states: transformers' KV-shared input slicing fails without per-layer
    # inputs (a None subscripted); asking for the hidden states turns that path off
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_fp32(gemma4, name):
    """Reference parity over 72 tokens within 1e-4 (measured 2.6e-5 e2b, 2.2e-5 moe, 1.1e-5
    rope, 1.1e-5 all, at |logit| ≤ 3): every Gemma 4 convention in the module docstring."""
    folder, ref = gemma4(name)
    model = mlxlis.load(folder, "float32")
    assert model.config.family == "gemma4"
    ids = trajectory(72, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_structure_follows_the_config(gemma4):
    """Per-type head dims and KV heads, the KV-shared layers without K/V weights and with
    double-wide MLPs, k_eq_v layers without v_proj, experts in mlx-lm's layout, and one cache
    per layer that has its own K/V, as transformers builds them."""
    folder, ref = gemma4("all")
    model = mlxlis.load(folder, "float32")
    layers = model.net.model.layers
    for i, (ours, theirs) in enumerate(zip(layers, ref.model.layers, strict=True)):
        a, b = ours.self_attn, theirs.self_attn
        assert a.q_proj.weight.shape == tuple(b.q_proj.weight.shape), i
        assert ("k_proj" in a) == (not b.is_kv_shared_layer) == (i < 3), i
        assert ("v_proj" in a) == (getattr(b, "v_proj", None) is not None), i
        assert ours.mlp.up_proj.weight.shape == tuple(theirs.mlp.up_proj.weight.shape), i
        assert ours.experts.switch_glu.gate_proj.weight.shape == (4, 32, 64)
    assert model.net.model.layers[2].self_attn.k_proj.weight.shape == (32, 64)  # 1 KV head of 32
    assert model.config.family_config.kv_source == (0, 1, 2, 1, 2)
    assert len(model.make_cache()) == 3


def classic_copy(folder: Path, dest: Path) -> Path:
    """mlx-lm reads the hub's keys (global_head_dim, num_global_key_value_heads), not
    transformers 5's per_layer_config."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    full = next(iter(cfg.pop("per_layer_config").values()))
    cfg["global_head_dim"] = full["head_dim"]
    cfg["num_global_key_value_heads"] = full.get("num_key_value_heads")
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_mlx_lm(gemma4, name, tmp_path):
    """Second, independent reference: mlx-lm's gemma4_text on the same weights, 72 tokens
    (measured 7.1e-6 to 1.3e-5; bound 2e-4). The copy with the hub's keys instead of
    per_layer_config loads to the very same logits here."""
    from mlx_lm import load as mlx_lm_load

    folder, _ = gemma4(name)
    classic = classic_copy(folder, tmp_path / "classic")
    their_model, _ = mlx_lm_load(str(classic))
    ids = trajectory(72, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    assert np.abs(ours - theirs).max() < 2e-4
    again = np.array(mlxlis.load(classic, "float32").logits(ids))
    assert np.array_equal(again, ours)


@pytest.mark.parametrize("name", ["e2b", "moe"])
def test_mlx_quantized_folder_matches_mlx_lm(gemma4, name, tmp_path):
    """mlx-lm's own 4-bit conversion (experts as switch_glu, the router at 8 bits) loads as it
    is and gives mlx-lm's logits on it (float32 activations; measured 7.6e-6 e2b, 7.9e-5 moe;
    bound 5e-4)."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = gemma4(name)
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
    if name == "moe":
        layer = model.net.model.layers[0]
        assert isinstance(layer.experts.switch_glu.gate_proj, QuantizedSwitchLinear)
        assert layer.router.proj.bits == 8
    their_model, _ = mlx_lm_load(str(out))
    ids = trajectory(48, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(model.logits(ids)) - theirs).max() < 5e-4


@pytest.mark.parametrize("name", NAMES)
def test_cached_decode_equals_full_forward(gemma4, name):
    """Self-consistency over 96 tokens (12 sliding windows): one-token decode and chunked
    prefill (5, 16: chunks across the window) with the caches, KV-shared layers attending over
    their source layer's cache, give the full forward's logits; generate's prefill (newest
    position only through the KV-shared layers) its last row. Measured ≤ 5.6e-5 (0 when run
    alone: the same float32 floor as above), bound 3e-4; a wrong window, offset or shared
    cache moves them by 1e-2 or more."""
    folder, _ = gemma4(name)
    model = mlxlis.load(folder, "float32")
    ids = trajectory(96, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(model.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 3e-4
    for chunk in (5, 16):
        cache = model.make_cache()
        outs = [
            np.array(model.net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 3e-4, chunk
    cache = model.make_cache()
    last = np.array(prefill(model.net, ids, cache, step=40)[0])
    assert np.abs(last - full[-1]).max() < 3e-4
    assert all(c.offset == len(ids) for c in cache)


def test_multimodal_wrapper_loads(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint (text_config, `model.language_model.*`, a
    vision tower) loads its language model, the tower skipped, to transformers' logits
    (measured 8.8e-6, bound 1e-4)."""
    import transformers
    from safetensors import safe_open

    folder = tmp_path / "mm"
    folder.mkdir()
    vocab = train_tokenizer(folder)
    text = dict(
        vocab_size=vocab, bos_token_id=0, eos_token_id=2, pad_token_id=1, **COMMON, **SPECS["e2b"]
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    cfg = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    randomize(ref, 3)
    scalar_noise(ref, 3)
    ref.tie_weights()
    ref.save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.vision_tower.") for k in keys)
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    model = mlxlis.load(folder, "float32")
    assert model.config.family == "gemma4" and model.config.family_config.per_layer_dim == 16
    ids = trajectory(64, vocab=vocab)
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids]), output_hidden_states=True).logits[0].numpy()
    assert np.abs(np.array(model.logits(ids)) - theirs).max() < 1e-4


@pytest.mark.parametrize("name", ["e2b", "moe"])
def test_convert_round_trip_and_mlx_lm(gemma4, name, tmp_path):
    """`convert` writes the folder as gemma4_text config.json keys (the hub's and transformers
    5's) + our weights: it reloads bit for bit to the same config, and mlx-lm loads it to the
    same logits (measured 8.8e-6 e2b, 1.1e-5 moe; bound 2e-4); so does transformers where it
    can (e2b: measured 2.6e-5; bound 1e-4): it reads experts only in its fused layout, not in
    mlx-lm's switch_glu one that convert writes."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = gemma4(name)
    out = convert(folder, tmp_path / "out", dtype="float32")
    src, again = mlxlis.load(folder, "float32"), mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=400)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    assert again.config == src.config.with_(
        source=again.config.source,
        special=replace(src.config.special, eos=again.config.special.eos),
    )
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 2e-4
    if src.config.moe is None:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        assert np.abs(np.array(again.logits(ids)) - reference_logits(ref.eval(), ids)).max() < 1e-4


BAD = [  # (change to config.json, error class, field it names)
    (
        {"rope_parameters": {**ROPE, F: {"rope_type": "yarn", "factor": 2.0}}},
        UnsupportedError,
        "rope_parameters.full_attention.rope_type",
    ),
    ({"num_kv_shared_layers": 6}, ConfigError, "num_kv_shared_layers"),
    (
        {"per_layer_config": {"3": {"head_dim": 32, "intermediate_size": 8}}},
        UnsupportedError,
        "per_layer_config.3.intermediate_size",
    ),
    (
        {"per_layer_config": {"3": {"num_key_value_heads": 3}, "5": {"num_key_value_heads": 3}}},
        ConfigError,
        "per_layer_config",
    ),
    ({"per_layer_config": {"3": {"head_dim": 32}}}, UnsupportedError, "per_layer_config"),
    (
        {
            "enable_moe_block": True,
            "num_experts": 2,
            "top_k_experts": 3,
            "moe_intermediate_size": 8,
        },
        ConfigError,
        "top_k_experts",
    ),
    ({"use_bidirectional_attention": "both"}, ConfigError, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, UnsupportedError, "hidden_activation"),
]


@pytest.mark.parametrize("change,error,field", BAD)
def test_bad_configs_are_named(gemma4, tmp_path, change, error, field):
    """What Gemma 4 does not implement, or a config that contradicts itself, is refused with
    an MlxlisError naming config.json and the field."""
    check_config_refused(gemma4("e2b")[0], tmp_path, change, error, field)
