"""gpt-oss against transformers, mlx-lm and llama.cpp's file layout.

Reference parity: a tiny random checkpoint written by transformers' save_pretrained
(GptOssForCausalLM, float32): sliding windows of 8 alternating with full layers over 72 tokens,
sink logits of unit size, YaRN ×32 over gpt-oss's original context of 4096 without truncation
(as its config says: the ramp then differs from a rounded one), top-2 of 4 experts with biases and a
SwiGLU limit of 0.5 (the clamps bite). The same folder with its experts as OpenAI ships them
(MXFP4 `*_blocks` / `*_scales`, random codes and exponents), which transformers dequantizes on
load: the reference for the MXFP4 layout, kept here as MLX's mxfp4. mlx-lm's gpt_oss on that
MXFP4 folder (its YaRN always truncates, so the folder says truncate true there). GGUF: the
weights written with gguf-py's GGUFWriter under llama.cpp's names and keys (convert_hf_to_gguf's
GptOssModel: gate_up split by even and odd rows, MXFP4 experts by gguf-py's quantizer), against
transformers on the weights gguf-py dequantizes from the very file. Self-consistency: cached
decode and batches equal the full forward past the window; `convert` round trips.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlxlis
from mlxlis.errors import ConfigError
from mlxlis.models.experts import QuantizedSwitchLinear

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, build_tiny, tiny_models, trajectory
from safetensors.numpy import load_file, save_file

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
SPECS = {
    "oss": dict(
        kind="gpt_oss",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=0.5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_parameters=YARN,
    ),
}
SPECS["gguf"] = {  # llama.cpp's fixed SwiGLU limit, and its YaRN rounding the ramp's ends
    **SPECS["oss"],
    "swiglu_limit": 7.0,
    "rope_parameters": {**YARN, "truncate": True},
}


def _sinks_of_unit_size(model) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(10)  # randomize gives N(0, 0.1): make them matter


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    return tiny_models(
        tmp_path_factory,
        SPECS,
        build=lambda folder, spec: build_tiny(folder, spec, adjust=_sinks_of_unit_size),
    )


def mxfp4_folder(folder: Path, out: Path) -> None:
    """`folder` with its experts as OpenAI's checkpoints hold them: (E, out, in/32, 16) uint8
    codes, two e2m1 values a byte, and (E, out, in/32) E8M0 exponents (random, 2⁻¹⁰ to 2⁻⁶:
    weights of the dense ones' size)."""
    shutil.copytree(folder, out)
    w = load_file(str(out / "model.safetensors"))
    rng = np.random.default_rng(0)
    for k in [k for k in w if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = w.pop(k).shape  # (E, in, out)
        w[f"{k}_blocks"] = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
        w[f"{k}_scales"] = rng.integers(117, 122, (e, d_out, d_in // 32), dtype=np.uint8)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def mxfp4(oss, tmp_path_factory):
    """(folder, transformers' model dequantized from it on load)."""
    import transformers

    out = tmp_path_factory.mktemp("mxfp4") / "m"
    mxfp4_folder(oss("oss")[0], out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return out, ref


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("layout", ["dense", "mxfp4"])
def test_logits_match_transformers_fp32(oss, mxfp4, layout):
    """Reference parity over 72 tokens within 3e-5 (measured 1.4e-6 dense, 1.2e-6 MXFP4):
    sinks, sliding windows, untruncated YaRN, biased router and experts, the clamped SwiGLU;
    the MXFP4 experts held as MLX's mxfp4 (not dequantized)."""
    folder, ref = oss("oss") if layout == "dense" else mxfp4
    model = mlxlis.load(folder, "float32")
    cfg = model.config
    assert cfg.family == "gpt_oss" and cfg.attention.sinks and cfg.rope.type == "yarn"
    assert not cfg.rope.truncate and cfg.layer_types[:2] == ("sliding_attention", "full_attention")
    experts = model.net.model.layers[0].mlp.experts.gate_proj
    assert isinstance(experts, QuantizedSwitchLinear) == (layout == "mxfp4")
    if layout == "mxfp4":
        assert experts.mode == "mxfp4" and experts.group_size == 32
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 3e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_cached_decode_and_batches_equal_the_full_forward(mxfp4):
    """Self-consistency past the window (8) with sinks: token-by-token decode and a chunked
    prefill equal the full forward; a batch of two sequences at different offsets equals each
    alone."""
    model = mlxlis.load(mxfp4[0], "float32")
    ids = trajectory(40, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    model.net(mx.array([ids[:13]]), cache)
    steps = [np.array(model.net(mx.array([[t]]), cache)[0, -1]) for t in ids[13:]]
    assert np.abs(np.stack(steps) - full[13:]).max() < 1e-4
    a, b = model.make_cache(), model.make_cache()
    model.net(mx.array([ids[:20]]), a)
    model.net(mx.array([ids[5:16]]), b)
    lone_a = np.array(model.logits(ids[:21]))[-1]
    lone_b = np.array(model.logits(ids[5:17]))[-1]
    both = np.array(model.net.decode_batch(mx.array([ids[20], ids[16]]), [a, b]))
    assert np.abs(both[0] - lone_a).max() < 1e-4 and np.abs(both[1] - lone_b).max() < 1e-4


def test_logits_match_mlx_lm_on_openais_mxfp4_layout(mxfp4, tmp_path):
    """mlx-lm's gpt_oss reads the same MXFP4 folder (its YaRN rounds the ramp and its SwiGLU
    limit is fixed at 7, so the copy says truncate true and limit 7): the same logits within
    2e-5 (measured 1.0e-6)."""
    from mlx_lm import load as mlx_lm_load

    folder = tmp_path / "m"
    shutil.copytree(mxfp4[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["truncate"] = True
    cfg["rope_scaling"] = cfg["rope_parameters"]  # what mlx-lm reads
    cfg["swiglu_limit"] = 7.0
    (folder / "config.json").write_text(json.dumps(cfg))
    ids = trajectory(72, vocab=cfg["vocab_size"])
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    theirs_model, _ = mlx_lm_load(str(folder))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - theirs).max() < 2e-5


# ---------------------------------------------------------------- GGUF

Q = gguf.GGMLQuantizationType
BLOCK = {  # transformers' names -> llama.cpp's (convert_hf_to_gguf's tensor map for gpt-oss)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensors(ref) -> dict[str, np.ndarray]:
    """transformers' weights as GptOssModel.modify_tensors writes dense experts: gate_up
    transposed to (E, 2F, in) and split by even / odd rows, down_proj transposed; the biases
    split likewise; sinks as attn_sinks.weight."""
    out = {}
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        stem, part = name.rsplit(".", 1)
        if stem in TOP:
            out[f"{TOP[stem]}.{part}"] = a
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            a = a.transpose(0, 2, 1)
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = (
                a[:, ::2],
                a[:, 1::2],
            )
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"blk.{i}.ffn_gate_exps.bias"], out[f"blk.{i}.ffn_up_exps.bias"] = (
                a[:, ::2],
                a[:, 1::2],
            )
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = a.transpose(0, 2, 1)
        elif rest == "mlp.experts.down_proj_bias":
            out[f"blk.{i}.ffn_down_exps.bias"] = a
        elif rest == "self_attn.sinks":
            out[f"blk.{i}.attn_sinks.weight"] = a
        else:
            stem, part = rest.rsplit(".", 1)
            out[f"blk.{i}.{BLOCK[stem]}.{part}"] = a
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def back_to_transformers(held: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    inverse = {v: k for k, v in BLOCK.items()} | {v: k for k, v in TOP.items()}
    sd = {}
    for name, a in held.items():
        stem, part = name.rsplit(".", 1)
        if stem in inverse:
            sd[f"{inverse[stem]}.{part}"] = a
            continue
        _, i, key = stem.split(".", 2)
        p = f"model.layers.{i}"
        if key == "attn_sinks":
            sd[f"{p}.self_attn.sinks"] = a
        elif key == "ffn_gate_exps":  # gate and up rows interleaved again
            up = held[f"blk.{i}.ffn_up_exps.{part}"]
            if part == "weight":  # (E, F, in) ×2 -> (E, F, 2, in) -> (E, 2F, in) -> (E, in, 2F)
                both = np.stack([a, up], axis=2).reshape(a.shape[0], -1, a.shape[2])
                sd[f"{p}.mlp.experts.gate_up_proj"] = both.transpose(0, 2, 1)
            else:  # (E, F) ×2 -> (E, F, 2) -> (E, 2F)
                sd[f"{p}.mlp.experts.gate_up_proj_bias"] = np.stack([a, up], -1).reshape(
                    a.shape[0], -1
                )
        elif key == "ffn_down_exps":
            if part == "weight":
                sd[f"{p}.mlp.experts.down_proj"] = a.transpose(0, 2, 1)
            else:
                sd[f"{p}.mlp.experts.down_proj_bias"] = a
        elif key != "ffn_up_exps":
            sd[f"{p}.{inverse[key]}.{part}"] = a
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def write_gguf(path: Path, ref, folder: Path) -> dict[str, np.ndarray]:
    """`ref` as llama.cpp's converter writes it (the keys GptOssModel.set_gguf_parameters and
    the shared YaRN keys): MXFP4 experts and Q8_0 matrices by gguf-py's quantizers, F32
    norms, biases and sinks. Returns the floats each tensor holds."""
    cfg = ref.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    add_gguf_sizes(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    add_bpe_tokenizer(w, folder, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    held = {}
    for name, a in gguf_tensors(ref).items():
        assert names.get_name(name.rsplit(".", 1)[0]) is not None, name  # llama.cpp knows it
        experts = name.endswith("_exps.weight")
        qtype = Q.F32 if a.ndim == 1 or name.endswith(".bias") else Q.MXFP4 if experts else Q.Q8_0
        if qtype == Q.F32:
            data = held[name] = a.astype(np.float32)
        else:
            data = gguf.quants.quantize(a, qtype)
            held[name] = gguf.quants.dequantize(data, qtype).reshape(a.shape)
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def gguf_file(oss, tmp_path_factory):
    """(path, transformers model holding the file's weights)."""
    folder, ref = oss("gguf")
    path = tmp_path_factory.mktemp("gguf") / "gpt-oss.gguf"
    held = write_gguf(path, ref, folder)
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(back_to_transformers(held), strict=True)
    return path, twin


@pytest.mark.parametrize("dequantize", [False, None])
def test_gguf_matches_transformers_on_the_files_weights(gguf_file, dequantize):
    """Reference parity on the GGUF path, blocks kept (dequantize=False: the MXFP4 experts as
    MLX's mxfp4, Q8_0 affine) and the CPU default (dense): transformers on the weights gguf-py
    dequantizes from the very file, 72 tokens, float32 (measured 1.5e-6, bound 1e-4)."""
    path, twin = gguf_file
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    cfg = model.config
    assert cfg.family == "gpt_oss" and cfg.attention.sliding_window == 8 and cfg.rope.truncate
    experts = model.net.model.layers[1].mlp.experts.down_proj
    assert isinstance(experts, QuantizedSwitchLinear) == (dequantize is False)
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_convert_round_trip_and_mlx_lm(gguf_file, tmp_path):
    """`convert` writes the GGUF in mlx-lm's layout with the experts' mxfp4 stated: it
    reloads bit for bit, and mlx-lm loads it to the same logits (bound 2e-5)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    path, _ = gguf_file
    out = convert(path, tmp_path / "out", dtype="float32")
    src = mlxlis.load(path, "float32", dequantize=False)
    again = mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=src.config.vocab_size)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    written = json.loads((out / "config.json").read_text())
    modes = {v["mode"] for v in written["quantization"].values() if isinstance(v, dict)}
    assert written["model_type"] == "gpt_oss" and "mxfp4" in modes | {
        written["quantization"]["mode"]
    }
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 2e-5


def test_bad_values_are_named(oss, tmp_path):
    """config.json values gpt-oss reads are checked, each error naming the key."""
    folder, _ = oss("oss")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for key, value in (
        ("layer_types", ["chunked_attention"] * 4),
        ("sliding_window", 0),
        ("swiglu_limit", "7"),
        ("num_experts_per_tok", 5),
        ("rope_parameters", {**YARN, "truncate": "no"}),
        ("rope_parameters", {**YARN, "original_max_position_embeddings": None}),
        ("rope_parameters", {**YARN, "rope_theta": 1.0}),
    ):
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError) as e:
            mlxlis.load(bad, "float32")
        assert e.value.field in (key, "rope_parameters"), (key, e.value)
    no_window = {k: v for k, v in cfg.items() if k != "layer_types"}
    (bad / "config.json").write_text(json.dumps({**no_window, "sliding_window": None}))
    assert set(mlxlis.load(bad, "float32").config.layer_types) == {"full_attention"}
