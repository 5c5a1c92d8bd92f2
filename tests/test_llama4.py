"""Llama 4 (text) against transformers, mlx-lm and llama.cpp's file layout.

Reference parity: tiny random checkpoints written by transformers' save_pretrained
(Llama4ForCausalLM): "scout" has chunks of 16 over 72 tokens (four chunk boundaries), a NoPE
full layer whose queries are scaled by position (floor 8, scale 0.5: the scale changes every 8
positions), L2 q/k norms, llama3 RoPE scaling with low = high frequency factor (Scout's), top-2
of 4 experts with a shared expert on every second layer; "maverick" has no q/k norm, explicit
no_rope_layers and moe_layers, top-1 routing, within mlx-lm's constraints (top-1, NoPE every
4th layer) so that mlx-lm runs it too. Both against
transformers' float32 forward; "maverick" against mlx-lm's llama4 on the same weights, full
precision and mlx-lm's own 4-bit conversion. GGUF: the "scout" weights written with gguf-py's
GGUFWriter under llama.cpp's names and keys (convert_hf_to_gguf's Llama4Model: experts' fused
gate_up split and transposed, no Q/K permutation, rope_freqs for llama3 scaling), whose fixed
chunk and temperature constants transformers is given too ("scout_gguf"). Self-consistency:
cached decode and chunked prefill equal the full forward across chunk boundaries; batched
decode of sequences at different chunk phases equals each alone; `convert` round trips.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlxlis
from mlxlis.commands.report import format_report, model_report
from mlxlis.errors import ConfigError
from mlxlis.models.experts import QuantizedSwitchLinear

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, tiny_models, trajectory
from test_qwen3_gguf import encode

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 64,
}
COMMON = dict(
    kind="llama4_text",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
SPECS = {
    "scout": dict(
        **COMMON,
        intermediate_size=48,
        intermediate_size_mlp=96,
        num_hidden_layers=4,
        num_experts_per_tok=2,
        interleave_moe_layer_step=2,
        attention_chunk_size=16,
        floor_scale=8,
        attn_scale=0.5,
        rope_parameters=LLAMA3_ROPE,
    ),
    "maverick": dict(
        **COMMON,
        intermediate_size=32,
        intermediate_size_mlp=80,
        num_hidden_layers=4,
        num_experts_per_tok=1,
        moe_layers=[1, 3],
        interleave_moe_layer_step=2,  # what mlx-lm reads
        no_rope_layers=[1, 1, 1, 0],
        use_qk_norm=False,
        attention_chunk_size=24,
        floor_scale=16,
        attn_scale=0.25,
        rms_norm_eps=1e-6,  # mlx-lm's L2 norm uses 1e-6 whatever the config says
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    # llama.cpp's fixed constants (chunk 8192, floor 8192, scale 0.1); K-quant-sized rows
    "scout_gguf": dict(
        **{**COMMON, "hidden_size": 256, "head_dim": 64},
        intermediate_size=256,
        intermediate_size_mlp=256,
        num_hidden_layers=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
    ),
}


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS)


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_logits_match_transformers_fp32(llama4, name):
    """Reference parity over 72 tokens within 3e-5 (measured 2.7e-6 and 1.5e-6): chunked
    attention, the NoPE layer's temperature, L2 q/k norms (scout) or none, interleaved RoPE
    with llama3 scaling, the sigmoid router scaling the experts' input, the shared expert,
    dense layers of intermediate_size_mlp."""
    folder, ref = llama4(name)
    model = mlxlis.load(folder, "float32")
    cfg = model.config
    assert cfg.family == "llama4" and cfg.attention.rope_interleaved
    assert cfg.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    assert cfg.attention.no_rope_layers == (False, False, False, True)
    assert cfg.moe.sparse_layers == (False, True, False, True)
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 3e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_cached_decode_and_batches_equal_the_full_forward(llama4):
    """Self-consistency across chunk boundaries (chunk 16, 80 tokens): token-by-token decode
    and chunked prefill (5, 16, 23) give the full forward's logits; three sequences decoding
    together (decode_batch, their chunked rings stacked) at different chunk phases give each
    one's lone logits (bound 3e-5)."""
    model = mlxlis.load(llama4("scout")[0], "float32")
    net = model.net
    ids = trajectory(80, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 3e-5
    for chunk in (5, 16, 23):
        cache = model.make_cache()
        outs = [
            np.array(net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 3e-5, chunk
    prompts = [ids[:13], ids[3:30], ids[7:22]]  # ends at 13, 27, 15: different phases of 16
    caches = [model.make_cache() for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        net(mx.array([p]), cache=c)
    lone = [model.make_cache() for _ in prompts]
    for p, c in zip(prompts, lone, strict=True):
        net(mx.array([p]), cache=c)
    for step in range(12):  # through the boundary at 16 (and 32) for each
        toks = [ids[40 + step + 3 * i] for i in range(3)]
        got = np.array(net.decode_batch(mx.array(toks), caches))
        pairs = zip(toks, lone, strict=True)
        want = [np.array(net(mx.array([[t]]), cache=c)[0, -1]) for t, c in pairs]
        assert np.abs(got - np.stack(want)).max() < 3e-5, step


def classic_wrapper(folder: Path, dest: Path) -> Path:
    """The checkpoint as a `llama4` wrapper folder in mlx-lm's classic keys: text_config with
    rope_theta / rope_scaling spelled out, tensors under `language_model.`."""
    from safetensors.numpy import load_file, save_file

    dest.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dest / f.name)
    text = json.loads((folder / "config.json").read_text())
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["rope_theta"]
    text["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}
    (dest / "config.json").write_text(json.dumps({**cfg, "text_config": text}))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(
        {f"language_model.{k}": v for k, v in tensors.items()}, str(dest / "model.safetensors")
    )
    return dest


def test_logits_match_mlx_lm(llama4, tmp_path):
    """Second, independent reference: mlx-lm's llama4 on the same weights (the wrapper folder
    it reads; it splits the fused experts itself), and mlx-lm's own 4-bit conversion of it
    loaded as it is (stacked quantized experts under `language_model.`). Float32; measured
    ≤ 2e-6 (dense), bounds 2e-5 / 3e-5."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = llama4("maverick")
    wrapper = classic_wrapper(folder, tmp_path / "wrapper")
    ids = trajectory(72, vocab=300)
    theirs_model, _ = mlx_lm_load(str(wrapper))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    ours_model = mlxlis.load(wrapper, "float32")
    assert np.abs(np.array(ours_model.logits(ids)) - theirs).max() < 2e-5
    q4 = tmp_path / "q4"
    mlx_lm_convert(str(wrapper), str(q4), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(q4, "float32")
    assert model.format == "safetensors (MLX quantized)"
    experts = model.net.model.layers[1].feed_forward.experts
    assert isinstance(experts.gate_proj, QuantizedSwitchLinear)
    theirs_q, _ = mlx_lm_load(str(q4))
    want = np.array(theirs_q(mx.array([ids[:48]]))[0].astype(mx.float32))
    assert np.abs(np.array(model.logits(ids[:48])) - want).max() < 3e-5


def test_wrapper_skips_the_vision_tower_and_says_so(llama4, tmp_path):
    """A `llama4` multimodal folder (vision tower and projector tensors beside the language
    model's) loads its language model to the text checkpoint's logits, and reports the
    skipped tower; a bad value in text_config is an error naming the key."""
    from safetensors.numpy import load_file, save_file

    folder, _ = llama4("scout")
    wrapper = tmp_path / "mm"
    wrapper.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, wrapper / f.name)
    text = json.loads((folder / "config.json").read_text())
    vision = {"model_type": "llama4_vision_model", "hidden_size": 8}
    cfg = {"model_type": "llama4", "text_config": text, "vision_config": vision}
    (wrapper / "config.json").write_text(json.dumps(cfg))
    tensors = {
        f"language_model.{k}": v for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    tensors["vision_model.patch_embedding.linear.weight"] = np.zeros((8, 12), np.float32)
    tensors["multi_modal_projector.linear_1.weight"] = np.zeros((64, 8), np.float32)
    save_file(tensors, str(wrapper / "model.safetensors"))
    ids = trajectory(40, vocab=300)
    model = mlxlis.load(wrapper, "float32")
    same = mlxlis.load(folder, "float32")
    assert bool(mx.array_equal(model.logits(ids), same.logits(ids)))
    assert model.skipped == [
        "multi_modal_projector.linear_1.weight",
        "vision_model.patch_embedding.linear.weight",
    ]
    assert "vision tower is not implemented" in model.text_only_reason()
    report = model_report(model)  # what `mlxlis inspect` prints
    assert report["config"]["attention_chunk_size"] == 16
    assert report["config"]["no_rope_layers"] == [3]
    assert "2 tensors not used" in report["skipped"]
    printed = format_report(report)
    assert "attention chunks of 16 in 3 layers" in printed and "none in layers 3 (NoPE)" in printed
    bad = {**cfg, "text_config": {**text, "no_rope_layers": [1, 1]}}
    (wrapper / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as e:
        mlxlis.load(wrapper, "float32")
    assert e.value.field == "no_rope_layers" and "config.json" in str(e.value)


# ---------------------------------------------------------------- GGUF

Q = gguf.GGMLQuantizationType
BLOCK = {  # transformers' names -> llama.cpp's (convert_hf_to_gguf's tensor map for llama4)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
    "feed_forward.router": "ffn_gate_inp",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensors(ref) -> dict[str, np.ndarray]:
    """transformers' weights as Llama4Model.modify_tensors writes them: the fused gate_up
    (E, hidden, 2F) transposed and split into ffn_gate_exps / ffn_up_exps (E, F, hidden),
    down_proj (E, F, hidden) transposed to ffn_down_exps (E, hidden, F)."""
    out = {}
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        stem, part = name.rsplit(".", 1)
        if stem in TOP:
            out[f"{TOP[stem]}.{part}"] = a
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "feed_forward.experts.gate_up_proj":
            gate, up = np.split(a.transpose(0, 2, 1), 2, axis=1)
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = gate, up
        elif rest == "feed_forward.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = a.transpose(0, 2, 1)
        else:
            stem, part = rest.rsplit(".", 1)
            out[f"blk.{i}.{BLOCK[stem]}.{part}"] = a
    return out


def back_to_transformers(held: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    inverse = {v: k for k, v in BLOCK.items()} | {v: k for k, v in TOP.items()}
    sd = {}
    for name, a in held.items():
        stem, part = name.rsplit(".", 1)
        if name == "rope_freqs.weight":
            continue
        if stem in inverse:
            sd[f"{inverse[stem]}.{part}"] = a
            continue
        _, i, key = stem.split(".", 2)
        if key == "ffn_gate_exps":
            up = held[f"blk.{i}.ffn_up_exps.weight"]
            sd[f"model.layers.{i}.feed_forward.experts.gate_up_proj"] = np.concatenate(
                [a, up], 1
            ).transpose(0, 2, 1)
        elif key == "ffn_down_exps":
            sd[f"model.layers.{i}.feed_forward.experts.down_proj"] = a.transpose(0, 2, 1)
        elif key != "ffn_up_exps":
            sd[f"model.layers.{i}.{inverse[key]}.{part}"] = a
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def llama3_factors(rope: dict, dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' rope_freqs for llama3 scaling, as it computes them."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(rope["factor"])
        else:
            s = (old / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            out.append(1 / ((1 - s) / rope["factor"] + s))
    return np.array(out, np.float32)


def write_gguf(path: Path, ref, folder: Path) -> dict[str, np.ndarray]:
    """`ref` as llama.cpp's converter writes it: Q8_0 matrices (gguf-py's quantizer), Q4_K
    routed experts' gate/up (random blocks with sane scales), F32 norms and rope_freqs."""
    cfg = ref.config
    w = gguf.GGUFWriter(str(path), "llama4")
    add_gguf_sizes(w, cfg)
    w.add_feed_forward_length(cfg.intermediate_size_mlp)  # the converter swaps the two
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    w.add_vocab_size(cfg.vocab_size)
    add_bpe_tokenizer(w, folder, cfg)
    rng = np.random.default_rng(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, cfg.num_hidden_layers)
    tensors = gguf_tensors(ref)
    tensors["rope_freqs.weight"] = llama3_factors(cfg.rope_parameters, cfg.head_dim)
    held = {}
    for name, a in tensors.items():
        assert names.get_name(name.rsplit(".", 1)[0]) is not None, name  # llama.cpp knows it
        experts = "ffn_gate_exps" in name or "ffn_up_exps" in name
        qtype = Q.F32 if a.ndim == 1 else Q.Q4_K if experts else Q.Q8_0
        data, held[name] = encode(name, a, qtype, rng)
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def gguf_file(llama4, tmp_path_factory):
    """(path, transformers model holding the file's weights, tiny folder)."""
    folder, ref = llama4("scout_gguf")
    path = tmp_path_factory.mktemp("gguf") / "llama4.gguf"
    held = write_gguf(path, ref, folder)
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(back_to_transformers(held), strict=True)
    return path, twin, folder


@pytest.mark.parametrize("dequantize", [False, None])
def test_gguf_matches_transformers_on_the_files_weights(gguf_file, dequantize):
    """Reference parity on the GGUF path, blocks kept (dequantize=False: Q8_0 and the Q4_K
    experts in MLX's quantized forms) and the CPU default (dense): transformers on the weights
    gguf-py dequantizes from the very file, 64 tokens, float32; llama.cpp's constants (chunk
    8192, NoPE every 4th, floor 8192, scale 0.1, q/k norm with 4 experts) and the rope_freqs
    factors read as the checkpoint's llama3 scaling (measured 1.9e-5, bound 1e-4)."""
    path, twin, _ = gguf_file
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    cfg = model.config
    assert cfg.family == "llama4" and cfg.attention.chunk_size == 8192 and cfg.attention.qk_l2_norm
    assert cfg.moe.sparse_layers == (False, True, False, True)
    ids = trajectory(64, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 0.5


def test_convert_round_trip_and_mlx_lm(gguf_file, tmp_path):
    """`convert` writes the GGUF as a `llama4` wrapper folder (tensors under
    `language_model.`, experts stacked as mlx-lm names them): it reloads bit for bit, and
    mlx-lm loads it to the same logits (bound 1e-4)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    path, _, _ = gguf_file
    out = convert(path, tmp_path / "out", dtype="float32")
    src = mlxlis.load(path, "float32", dequantize=False)
    again = mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=src.config.vocab_size)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "llama4"
    overrides = [k for k, v in written["quantization"].items() if isinstance(v, dict)]
    assert overrides and all(k.startswith("language_model.") for k in overrides)  # mixed bits
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 1e-4


def test_convert_of_a_folder_loads_in_mlx_lm(llama4, tmp_path):
    """A folder without RoPE scaling converts to a wrapper mlx-lm reads (it requires
    rope_scaling stated, null), and to the same logits (bound 2e-5)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = llama4("maverick")
    out = convert(folder, tmp_path / "out", dtype="float32")
    ids = trajectory(40, vocab=300)
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(mlxlis.load(folder, "float32").logits(ids)) - theirs).max() < 2e-5


def test_bad_values_are_named(llama4, tmp_path):
    """config.json values Llama 4 reads are checked, each error naming the key."""
    folder, _ = llama4("maverick")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for key, value in (
        ("moe_layers", [1, 9]),
        ("no_rope_layers", [1, 1, 2, 0]),
        ("attention_chunk_size", 0),
        ("num_experts_per_tok", 5),
        ("layer_types", ["sliding_attention"] * 4),
    ):
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError) as e:
            mlxlis.load(bad, "float32")
        assert e.value.field == key and "config.json" in str(e.value), key
