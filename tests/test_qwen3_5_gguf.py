"""Qwen3.5 GGUF files (`qwen35`, `qwen35moe`), written the way llama.cpp's converter writes them.

What the converter does is written out here from conversion/qwen.py (Qwen3_5TextModel /
Qwen3_5MoeTextModel on Qwen3NextModel, _LinearAttentionVReorderBase, Qwen2MoeModel), on the
transformers model's own tensors: value heads reordered from grouped to tiled order on every
value-head axis (llama.cpp pairs value head h with q/k head h mod Kh); A_log stored as
A = −exp(A_log) under `blk.N.ssm_a`; dt_bias as `ssm_dt.bias`; conv1d squeezed to (C, kernel);
1 added to every norm but DeltaNet's gated one; experts stacked (the fused gate_up split);
the keys ssm.*, attention.recurrent_layers, rope.dimension_count / dimension_sections,
expert_* and
nextn_predict_layers with a multi-token-prediction block appended after the layers (loaded
by llama.cpp, unused by the main pass: mlxlis ignores it).

Reference parity: an F32 file against transformers on the original weights, and Q8_0 files
(gguf-py's quantizer) against transformers on the weights gguf-py dequantizes from the file.
"""

from __future__ import annotations

from pathlib import Path

import mlxlis

import gguf
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, trajectory
from test_qwen3_5 import COMMON, build, reference_logits

Q = gguf.GGMLQuantizationType
# llama.cpp's DeltaNet uses one state size for k and v heads (k_dim = v_dim); 32 wide heads are
# whole Q8_0 blocks, so the value-head reorder moves whole blocks (real heads: 128)
HEADS = {**COMMON, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
SPECS = {
    "qwen35": dict(
        kind="qwen3_5_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
        **HEADS,
    ),
    "qwen35moe": dict(
        kind="qwen3_5_moe_text",
        hidden_size=64,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        linear_num_value_heads=4,
        tie_word_embeddings=True,
        **HEADS,
    ),
}
LINEAR = {
    "in_proj_qkv": "attn_qkv",
    "in_proj_z": "attn_gate",
    "in_proj_b": "ssm_beta",
    "in_proj_a": "ssm_alpha",
    "out_proj": "ssm_out",
    "norm": "ssm_norm",
}
BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    **{f"linear_attn.{k}": v for k, v in LINEAR.items()},
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def tile(a: np.ndarray, kh: int, vh: int, axis: int) -> np.ndarray:
    """The converter's reorder along a value-head axis: new head r·Kh + g <- old g·(Vh/Kh) + r."""
    a = np.moveaxis(a, axis, 0)
    width = a.shape[0] // vh
    heads = a.reshape(vh, width, *a.shape[1:])
    order = [g * (vh // kh) + r for r in range(vh // kh) for g in range(kh)]
    return np.moveaxis(heads[order].reshape(a.shape), 0, axis)


def llama_cpp_tensors(ref) -> dict[str, np.ndarray]:
    """transformers' in-memory weights as llama.cpp's converter writes them (F32 values)."""
    c = ref.config
    kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
    kd = kh * c.linear_key_head_dim
    out = {}
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        if name in TOP:
            if not (c.tie_word_embeddings and name == "lm_head.weight"):
                out[TOP[name]] = a + (1.0 if name == "model.norm.weight" else 0.0)
            continue
        _, _, i, rest = name.split(".", 3)
        stem, part = rest.rsplit(".", 1) if rest.count(".") else (rest, "")
        if rest.startswith("linear_attn."):
            field = rest.split(".")[1]
            if field in ("in_proj_qkv", "conv1d"):  # only the V rows move
                a = np.concatenate([a[: 2 * kd], tile(a[2 * kd :], kh, vh, 0)])
            elif field in ("in_proj_z", "in_proj_a", "in_proj_b", "A_log", "dt_bias"):
                a = tile(a, kh, vh, 0)
            elif field == "out_proj":
                a = tile(a, kh, vh, 1)
            if field == "conv1d":
                out[f"blk.{i}.ssm_conv1d.weight"] = a.squeeze(1)
            elif field == "A_log":
                out[f"blk.{i}.ssm_a"] = -np.exp(a)
            elif field == "dt_bias":
                out[f"blk.{i}.ssm_dt.bias"] = a
            else:
                out[f"blk.{i}.{BLOCK[stem]}.{part}"] = a
        elif rest == "mlp.experts.gate_up_proj":  # (E, 2·F, hidden): gate rows, then up rows
            f = a.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = (
                a[:, :f],
                a[:, f:],
            )
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = a
        else:
            out[f"blk.{i}.{BLOCK[stem]}.{part}"] = a
        key = list(out)[-1]
        if key.endswith("norm.weight") and not key.endswith("ssm_norm.weight"):
            out[key] = out[key] + 1.0  # zero-centred norms: llama.cpp computes x̂·w
    return out


def untile(a: np.ndarray, kh: int, vh: int, axis: int) -> np.ndarray:
    a = np.moveaxis(a, axis, 0)
    width = a.shape[0] // vh
    heads = a.reshape(vh, width, *a.shape[1:])
    order = [g * (vh // kh) + r for r in range(vh // kh) for g in range(kh)]
    back = np.empty_like(heads)
    back[order] = heads
    return np.moveaxis(back.reshape(a.shape), 0, axis)


def as_transformers(ref, held: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The file's values back in transformers' layout (the converter's steps inverted)."""
    c = ref.config
    kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
    kd = kh * c.linear_key_head_dim
    sd = {}
    for name in ref.state_dict():
        if name in TOP:
            src = held.get(TOP[name], held["token_embd.weight"])
            sd[name] = src - (1.0 if name == "model.norm.weight" else 0.0)
            continue
        _, _, i, rest = name.split(".", 3)
        stem, part = rest.rsplit(".", 1) if rest.count(".") else (rest, "")
        if rest == "mlp.experts.gate_up_proj":
            sd[name] = np.concatenate(
                [held[f"blk.{i}.ffn_gate_exps.weight"], held[f"blk.{i}.ffn_up_exps.weight"]], 1
            )
            continue
        if rest == "mlp.experts.down_proj":
            sd[name] = held[f"blk.{i}.ffn_down_exps.weight"]
            continue
        field = rest.split(".")[1] if rest.startswith("linear_attn.") else None
        if field == "conv1d":
            a = held[f"blk.{i}.ssm_conv1d.weight"][:, None, :]
        elif field == "A_log":
            a = np.log(-held[f"blk.{i}.ssm_a"])
        elif field == "dt_bias":
            a = held[f"blk.{i}.ssm_dt.bias"]
        else:
            a = held[f"blk.{i}.{BLOCK[stem]}.{part}"]
        if field in ("in_proj_qkv", "conv1d"):
            a = np.concatenate([a[: 2 * kd], untile(a[2 * kd :], kh, vh, 0)])
        elif field in ("in_proj_z", "in_proj_a", "in_proj_b", "A_log", "dt_bias"):
            a = untile(a, kh, vh, 0)
        elif field == "out_proj":
            a = untile(a, kh, vh, 1)
        if name.endswith("norm.weight") and field != "norm":
            a = a - 1.0
        sd[name] = a
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}


def write(path: Path, ref, folder: Path, qtype: Q, mtp: bool = True) -> dict[str, np.ndarray]:
    c = ref.config
    moe = c.model_type == "qwen3_5_moe_text"
    n = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "qwen35moe" if moe else "qwen35")
    if moe:
        c.intermediate_size = c.moe_intermediate_size  # add_gguf_sizes writes it; removed below
    add_gguf_sizes(w, c)
    w.add_block_count(n + int(mtp))  # the MTP block counts
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_uint32(
        "qwen35moe.ssm.conv_kernel" if moe else "qwen35.ssm.conv_kernel", c.linear_conv_kernel_dim
    )
    arch = "qwen35moe" if moe else "qwen35"
    w.add_uint32(f"{arch}.ssm.state_size", c.linear_key_head_dim)
    w.add_uint32(f"{arch}.ssm.group_count", c.linear_num_key_heads)
    w.add_uint32(f"{arch}.ssm.time_step_rank", c.linear_num_value_heads)
    w.add_uint32(f"{arch}.ssm.inner_size", c.linear_num_value_heads * c.linear_value_head_dim)
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])  # the converter's default
    w.add_array(
        f"{arch}.attention.recurrent_layers",
        [t == "linear_attention" for t in c.layer_types] + [False] * int(mtp),
    )
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    add_bpe_tokenizer(w, folder, c)
    tensors = llama_cpp_tensors(ref)
    if mtp:  # an MTP block after the layers: a full-attention block plus nextn.* tensors
        full = next(i for i, t in enumerate(c.layer_types) if t == "full_attention")
        for k, v in list(tensors.items()):
            if k.startswith(f"blk.{full}."):
                tensors[k.replace(f"blk.{full}.", f"blk.{n}.", 1)] = v
        tensors[f"blk.{n}.nextn.eh_proj.weight"] = np.ones(
            (c.hidden_size, 2 * c.hidden_size), np.float32
        )
    held = {}
    forced_f32 = (
        "norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_inp_shexp.weight",
        "ssm_conv1d.weight",
        "ssm_a",
        "ssm_dt.bias",
    )  # as the converter forces
    for name, a in tensors.items():
        if qtype == Q.F32 or a.ndim == 1 or name.endswith(forced_f32):
            data, raw = a.astype(np.float32), None
            held[name] = data
        else:
            data, raw = gguf.quants.quantize(a, qtype), qtype
            held[name] = gguf.quants.dequantize(data, qtype).reshape(a.shape)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, spec in SPECS.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, build(folder, spec))
    return out


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_gguf_matches_transformers(models, arch, qtype, tmp_path):
    """Reference parity on the whole GGUF path: the V-head reorder, A = −exp(A_log), the
    squeezed conv, the +1 norms and the expert stacking undone; the MTP block ignored. F32:
    against transformers on the original weights; Q8_0 (kept quantized, and dense): against
    transformers on the file's dequantized weights. 64 tokens; bound 1e-4 (measured 2.1e-5 to
    4.1e-5)."""
    folder, ref = models[arch]
    path = tmp_path / f"{arch}.gguf"
    held = write(path, ref, folder, qtype)
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(as_transformers(ref, held), strict=False)
    if ref.config.tie_word_embeddings:
        twin.tie_weights()
    ids = trajectory(64, vocab=400)
    theirs = reference_logits(twin if qtype != Q.F32 else ref, ids)
    for dequantize in (False, True):
        model = mlxlis.load(path, "float32", dequantize=dequantize)
        assert model.config.num_hidden_layers == ref.config.num_hidden_layers  # MTP not a layer
        n = ref.config.num_hidden_layers
        assert model.skipped and all(k.startswith(f"blk.{n}.") for k in model.skipped)
        assert model.config.layer_types == tuple(ref.config.layer_types)
        delta = np.abs(np.array(model.logits(ids)) - theirs).max()
        assert delta < 1e-4, f"{dequantize}: max |Δ| = {delta}"


def test_convert_round_trip_and_mlx_lm(models, tmp_path):
    """`convert` turns the Q8_0 MoE file into a folder (blocks kept, llama.cpp's conventions
    undone, config.json under the qwen3_5_moe wrapper type): it reloads bit for bit and mlx-lm
    loads it to the same logits (measured 5.6e-6; bound 1e-4)."""
    from mlxlis.commands.convert import convert

    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load

    folder, ref = models["qwen35moe"]
    path = tmp_path / "moe.gguf"
    write(path, ref, folder, Q.Q8_0)
    out = convert(path, tmp_path / "out", dtype="float32")
    src = mlxlis.load(path, "float32", dequantize=False)
    again = mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=400)
    assert bool(mx.array_equal(src.logits(ids), again.logits(ids)))
    theirs, _ = mlx_lm_load(str(out))
    delta = np.abs(np.array(theirs(mx.array([ids]))[0]) - np.array(again.logits(ids))).max()
    assert delta < 1e-4
