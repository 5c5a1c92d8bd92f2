"""Mistral, Ministral 3 and the mistral3 wrapper against transformers, mlx-lm and llama.cpp's
file layout.

Reference parity: tiny random checkpoints written by transformers' save_pretrained, float32,
72 tokens: "ministral3" (Ministral3ForCausalLM) with YaRN ×16 over an original context of 32,
mscale_all_dim 0.5 (an attention factor other than YaRN's default), llama_4_scaling_beta 0.5
(the query temperature steps at positions 32 and 64) and a sliding window of 24 over every
layer; "mistral" (MistralForCausalLM) with a window of 16 (Mistral 7B v0.1's kind). The
mistral3 wrapper: the "ministral3" tensors under `model.language_model.` beside a vision
tower and projector, the same logits, the skipped parts said. mlx-lm's ministral3 on the same
weights (it takes no window: a copy without one). GGUF: the weights written with gguf-py's
GGUFWriter as llama.cpp's Ministral3Model does (Q/K permuted as for Llama, YaRN keys with
yarn_log_multiplier = mscale_all_dim, attention.temperature_scale = the beta), against
transformers on the weights gguf-py dequantizes from the very file. Self-consistency: cached
decode and batches equal the full forward past the window and the temperature's steps;
`convert` round trips and mlx-lm reads what it writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlxlis
from mlxlis.commands.report import format_report, model_report
from mlxlis.errors import ConfigError

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    add_bpe_tokenizer,
    add_gguf_sizes,
    check_batched_decode,
    check_cached_decode,
    tiny_models,
    trajectory,
)
from safetensors.numpy import load_file, save_file
from test_conventions import llama_cpp_permute

YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 16.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "llama_4_scaling_beta": 0.5,
}
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    num_hidden_layers=3,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
SPECS = {
    "ministral3": dict(kind="ministral3", sliding_window=24, rope_parameters=YARN, **COMMON),
    "mistral": dict(
        kind="mistral",
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **COMMON,
    ),
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS)


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", ["ministral3", "mistral"])
def test_logits_match_transformers_fp32(mistral, name):
    """Reference parity over 72 tokens within 3e-5 (measured 1.8e-6 ministral3): the window
    on every layer, YaRN with mscale_all_dim, the query temperature past 32 and 64."""
    folder, ref = mistral(name)
    model = mlxlis.load(folder, "float32")
    cfg = model.config
    assert cfg.family == "mistral3" and cfg.layer_types == ("sliding_attention",) * 3
    if name == "ministral3":
        assert cfg.rope.type == "yarn" and cfg.attention.temperature == (32, 0.5)
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 3e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_cached_decode_and_batches_equal_the_full_forward(mistral):
    """Self-consistency past the window (24) and the temperature's step at 32: token-by-token
    decode after a chunked prefill equals the full forward; two sequences at different
    offsets batched equal each alone."""
    model = mlxlis.load(mistral("ministral3")[0], "float32")
    ids = trajectory(44, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 35, 1e-4)


def test_wrapper_skips_the_vision_tower_and_says_so(mistral, tmp_path):
    """A mistral3 folder (text under model.language_model., Pixtral's tower and projector
    beside): the same logits as the text model, the skipped parts in `inspect`."""
    folder, _ = mistral("ministral3")
    out = tmp_path / "wrapped"
    shutil.copytree(folder, out)
    w = load_file(str(out / "model.safetensors"))
    wrapped = {
        (k if k.startswith("lm_head.") else "model.language_model." + k[len("model.") :]): v
        for k, v in w.items()
    }
    wrapped["model.vision_tower.patch_conv.weight"] = np.zeros((8, 3, 4, 4), np.float32)
    wrapped["model.multi_modal_projector.linear_1.weight"] = np.zeros((64, 8), np.float32)
    save_file(wrapped, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((out / "config.json").read_text())
    cfg = {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "pixtral", "hidden_size": 8},
        "image_token_index": 10,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    ids = trajectory(40, vocab=text["vocab_size"])
    model = mlxlis.load(out, "float32")
    assert bool(mx.array_equal(model.logits(ids), mlxlis.load(folder, "float32").logits(ids)))
    assert any("vision_tower" in s for s in model.skipped)
    assert "vision_tower" in format_report(model_report(model))


def test_logits_match_mlx_lm(mistral, tmp_path):
    """mlx-lm's ministral3 on the same weights (a copy without the window, which it does not
    read): the same logits within 2e-5; and on what `convert` writes of it."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder = tmp_path / "m"
    shutil.copytree(mistral("ministral3")[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = None
    (folder / "config.json").write_text(json.dumps(cfg))
    ids = trajectory(72, vocab=cfg["vocab_size"])
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    for source in (folder, convert(folder, tmp_path / "out", dtype="float32")):
        theirs_model, _ = mlx_lm_load(str(source))
        theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
        assert np.abs(ours - theirs).max() < 2e-5, source
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "ministral3"
    again = mlxlis.load(tmp_path / "out", "float32")
    assert np.abs(np.array(again.logits(ids)) - ours).max() == 0.0


# ---------------------------------------------------------------- GGUF

BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gguf(path: Path, ref, folder: Path) -> dict[str, torch.Tensor]:
    """`ref` as llama.cpp's Ministral3Model writes it: Q8_0 matrices (Q/K permuted first),
    F32 norms; LlamaModel's keys plus YaRN's and the temperature's. Returns the state dict the
    file holds (gguf-py's dequantization)."""
    cfg = ref.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "mistral3")
    add_gguf_sizes(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    w.add_vocab_size(cfg.vocab_size)
    add_bpe_tokenizer(w, folder, cfg)
    held = {}
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        stem, part = name.rsplit(".", 1)
        if stem in TOP:
            gname = f"{TOP[stem]}.{part}"
        else:
            _, _, i, rest = stem.split(".", 3)
            gname = f"blk.{i}.{BLOCK[rest]}.{part}"
        if a.ndim == 1:
            data, held[name], qtype = a, a, None
        else:
            data = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            held[name] = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
            qtype = gguf.GGMLQuantizationType.Q8_0
        heads = cfg.num_attention_heads
        if "q_proj" in name:
            data = llama_cpp_permute(data, heads, heads)
        elif "k_proj" in name:
            data = llama_cpp_permute(data, heads, cfg.num_key_value_heads)
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()}


@pytest.mark.parametrize("dequantize", [False, None])
def test_gguf_matches_transformers_on_the_files_weights(mistral, tmp_path, dequantize):
    """Reference parity on the GGUF path (Q8_0 kept, and the CPU default dense): YaRN from
    its keys (the attention factor from yarn_log_multiplier), the temperature from
    attention.temperature_scale over the original context; transformers on the weights
    gguf-py dequantizes from the very file, without the window (llama.cpp's mistral3 has
    none), 72 tokens, float32 (bound 1e-4)."""
    folder, ref = mistral("ministral3")
    path = tmp_path / "m.gguf"
    held = write_gguf(path, ref, folder)
    twin_cfg = ref.config.__class__.from_dict({**ref.config.to_dict(), "sliding_window": None})
    twin = ref.__class__(twin_cfg).eval()
    twin.load_state_dict(held, strict=True)
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    cfg = model.config
    assert cfg.family == "mistral3" and cfg.attention.temperature == (32, 0.5)
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"


def test_bad_values_are_named(mistral, tmp_path):
    """config.json values Mistral 3 reads are checked, each error naming the key."""
    folder, _ = mistral("ministral3")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for key, value in (
        ("sliding_window", 0),
        ("rope_parameters", {**YARN, "llama_4_scaling_beta": "0.1"}),
        ("rope_parameters", {**YARN, "mscale": None, "original_max_position_embeddings": 0}),
    ):
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError) as e:
            mlxlis.load(bad, "float32")
        assert e.value.field == key, (key, e.value)
