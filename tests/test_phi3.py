"""Phi-3 / Phi-4 / Phi-4-mini against transformers, mlx-lm, llama.cpp's layout and itself.

Reference parity: tiny random `phi3` checkpoints written by transformers' save_pretrained
against its float32 forward: "phi4" (Phi-4's kind: fused qkv_proj and gate_up_proj, full
RoPE), "mini" (Phi-4-mini's kind: 3 of 4 of each head rotated, LongRoPE over an original
context of 32 with distinct short and long factors, tied) at 24 tokens (within the original
context: the short factors) and 72 (past it: the long ones, as transformers picks them per
pass), and "window" (Phi-3-mini 4k's sliding window on every layer). Second reference:
mlx-lm's phi3 on "phi4" and on what `convert` writes of it (mlx-lm turns by the long factors
always, so LongRoPE is compared with transformers alone). GGUF: "mini" written with gguf-py
as llama.cpp's Phi3MiniModel writes it (fused attn_qkv and ffn_up, the LongRoPE factors as
rope_factors_short / _long tensors, the attention factor as rope.scaling.attn_factor), against
transformers on the weights gguf-py dequantizes from the very file. Self-consistency: cached
decode within the original context and past the window equals the full forward; `convert`
round trips.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import mlxlis
from mlxlis.errors import ConfigError, UnsupportedError

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    add_bpe_tokenizer,
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    check_config_refused,
    tiny_models,
    trajectory,
)

COMMON = dict(
    kind="phi3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    "short_factor": [1.0 + 0.1 * i for i in range(6)],
    "long_factor": [2.0 + 0.5 * i for i in range(6)],
    "original_max_position_embeddings": 32,
}
SPECS = {
    "phi4": dict(**COMMON),
    "mini": dict(
        rope_parameters=LONGROPE,
        original_max_position_embeddings=32,
        tie_word_embeddings=True,
        **COMMON,
    ),
    "window": dict(sliding_window=16, **COMMON),
}


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, lambda f, s: build_tiny(f, s, pad_token_id=1))


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("length", [24, 72])
def test_logits_match_transformers_fp32(phi, name, length):
    """Reference parity within 2e-5 (measured ≤ 2.5e-6): the fused projections split, partial
    rotary, LongRoPE's attention factor (√(1 + ln 16 / ln 32) here) and its factors by the
    pass's reach, the window."""
    folder, ref = phi(name)
    model = mlxlis.load(folder, "float32")
    cfg = model.config
    assert cfg.family == "phi3" and cfg.attention.fused_qkv and cfg.mlp.fused_gate_up
    ids = trajectory(length, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 2e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


@pytest.mark.parametrize("name", ["mini", "window"])
def test_cached_decode_and_batches_equal_the_full_forward(phi, name):
    """Self-consistency within the original context (30 < 32: the short factors throughout)
    and past the window: token-by-token decode after a chunked prefill equals the full
    forward; two sequences at different offsets batched equal each alone."""
    model = mlxlis.load(phi(name)[0], "float32")
    ids = trajectory(30, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 25, 1e-4)


def test_mlx_lm_and_the_convert_round_trip(phi, tmp_path):
    """mlx-lm's phi3 on the same weights (a copy stating θ the classic way, which it reads)
    and on what `convert` writes: the same logits within 2e-5; the converted folders reload
    bit for bit to the same config (LongRoPE's factors and attention factor included)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = phi("phi4")
    ids = trajectory(40, vocab=400)
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    classic = tmp_path / "classic"
    shutil.copytree(folder, classic)
    cfg = json.loads((classic / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (classic / "config.json").write_text(json.dumps(cfg))
    out = convert(folder, tmp_path / "out", dtype="float32")
    for source in (classic, out):
        theirs_model, _ = mlx_lm_load(str(source))
        theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
        assert np.abs(ours - theirs).max() < 2e-5, source
    for name in ("phi4", "mini"):
        src = mlxlis.load(phi(name)[0], "float32")
        again = mlxlis.load(
            convert(phi(name)[0], tmp_path / f"c_{name}", dtype="float32"), "float32"
        )
        assert np.array_equal(np.array(again.logits(ids)), np.array(src.logits(ids)))
        assert again.config == src.config.with_(
            source=again.config.source,
            special=replace(src.config.special, eos=again.config.special.eos),
        )


BAD = [
    (
        {"rope_parameters": {**LONGROPE, "short_factor": [1.0]}},
        ConfigError,
        "rope_parameters.short_factor",
    ),
    (
        {"rope_parameters": {**LONGROPE, "rope_type": "dynamic"}},
        UnsupportedError,
        "rope_parameters.rope_type",
    ),
    ({"partial_rotary_factor": 0.2, "rope_parameters": None}, ConfigError, "partial_rotary_factor"),
]


@pytest.mark.parametrize("change,error,field", BAD)
def test_bad_configs_are_named(phi, tmp_path, change, error, field):
    """A config Phi-3 cannot run is refused with an MlxlisError naming the field."""
    check_config_refused(phi("mini")[0], tmp_path, change, error, field)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0])
def test_gguf_matches_transformers_on_the_files_weights(phi, tmp_path, qtype):
    """Reference parity on the GGUF path at 24 and 72 tokens (the short and the long factors),
    bound 5e-5: Phi3MiniModel's keys and names, the factors read from their tensors, the
    rotary dims from rope.dimension_count, no Q/K permutation (NEOX RoPE)."""
    folder, ref = phi("mini")
    cfg = ref.config
    rp = cfg.rope_parameters
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(
        int(rp["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads
    )
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_sliding_window(0)  # the converter's "no window" (Phi-4)
    scale = cfg.max_position_embeddings / rp["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(rp["original_max_position_embeddings"]))
    )
    add_bpe_tokenizer(w, folder, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg.num_hidden_layers)
    held = {}
    for hf, t in ref.state_dict().items():
        if hf == "lm_head.weight":
            continue  # tied
        a = t.detach().float().numpy()
        stem, part = hf.rsplit(".", 1)
        q = qtype if a.ndim > 1 else gguf.GGMLQuantizationType.F32
        data = a if q == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(a, q)
        held[hf] = a if data is a else gguf.quants.dequantize(data, q).reshape(a.shape)
        w.add_tensor(f"{names.get_name(stem)}.{part}", data, raw_dtype=None if data is a else q)
    w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    twin = ref.__class__(cfg).eval()
    twin.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()}, strict=False
    )
    twin.tie_weights()
    model = mlxlis.load(path, "float32", dequantize=False)
    assert model.config.rope.type == "longrope" and model.config.attention.rotary_dim == 12
    for length in (24, 72):
        ids = trajectory(length, vocab=model.config.vocab_size)
        delta = np.abs(np.array(model.logits(ids)) - reference_logits(twin, ids)).max()
        assert delta < 5e-5, (length, delta)
