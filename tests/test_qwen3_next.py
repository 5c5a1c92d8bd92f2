"""Qwen3-Next against transformers, mlx-lm, llama.cpp's file layout and itself.

Reference parity: tiny random `qwen3_next` checkpoints written by transformers' save_pretrained
against its float32 forward over 72 tokens (across a 64-token chunk of the delta rule): "next"
(layers L L L F, 4 value heads over 2 key heads with k_dim 8 ≠ v_dim 12 — the per-key-head
fusing of in_proj_qkvz / in_proj_ba is exercised —, a dense MLP where mlp_only_layers says,
norm_topk_prob false, untied) and "gguf" (every layer MoE as llama.cpp requires, top-k
renormalised, tied). Second reference: mlx-lm's qwen3_next on the same weights and its own
4-bit conversion. GGUF: written with gguf-py as llama.cpp's Qwen3NextModel writes it (qkvz
split into attn_qkv and attn_gate, ssm_ba, A = −exp(A_log), conv squeezed, norms + 1; also
an older file's ssm_in), against transformers on the weights gguf-py dequantizes from the very
file. Self-consistency: chunked prefill ≡ one-step decode ≡ full forward; `convert` round trips
and mlx-lm reads what it writes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlxlis
from mlxlis.errors import ConfigError, UnsupportedError

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    add_bpe_tokenizer,
    add_gguf_sizes,
    build_tiny,
    check_batched_decode,
    check_config_refused,
    tiny_models,
    trajectory,
)
from test_qwen3_5 import realistic

Q = gguf.GGMLQuantizationType
COMMON = dict(
    kind="qwen3_next",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=512,
)
SPECS = {
    "next": dict(
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        tie_word_embeddings=False,
        **COMMON,
    ),
    "gguf": dict(
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
        **COMMON,
    ),
}


@pytest.fixture(scope="module")
def qwen3n(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, lambda f, s: build_tiny(f, s, adjust=realistic))


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(qwen3n, name):
    """Reference parity over 72 tokens within 1e-4 (measured 2.4e-5 next, 2.3e-5 gguf, the
    same float32 floor as Qwen3.5's): the fused projections split per key head, the dense
    layer, the router with and without renormalisation, the shared expert."""
    folder, ref = qwen3n(name)
    model = mlxlis.load(folder, "float32")
    cfg = model.config
    assert cfg.family == "qwen3_next" and cfg.deltanet.fused == ("qkvz", "ba")
    assert cfg.moe.sparse_layers == tuple(i not in ref.config.mlp_only_layers for i in range(4))
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def mlx_lm_copy(folder: Path, dest: Path) -> Path:
    """mlx-lm reads θ, the rotary fraction and the layer placement from the classic keys."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    rp = cfg["rope_parameters"]
    cfg.update(
        rope_theta=rp["rope_theta"],
        partial_rotary_factor=rp["partial_rotary_factor"],
        full_attention_interval=4,
    )
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_logits_match_mlx_lm_and_its_4_bit_folder(qwen3n, tmp_path):
    """Second, independent reference: mlx-lm's qwen3_next on the same weights (bound 1e-4),
    and the folder its 4-bit conversion saves (conv kernel axis last, norms + 1, experts
    stacked, the fused projections quantized): it loads as it is, to mlx-lm's logits on it."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen3n("next")
    copy = mlx_lm_copy(folder, tmp_path / "copy")
    ids = trajectory(72, vocab=400)
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    theirs_model, _ = mlx_lm_load(str(copy))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - theirs).max() < 1e-4
    out = tmp_path / "q4"
    mlx_lm_convert(str(copy), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids[:48]]))[0].astype(mx.float32))
    assert np.abs(np.array(model.logits(ids[:48])) - theirs).max() < 1e-4


def test_chunked_prefill_equals_step_decode_equals_full(qwen3n):
    """Self-consistency over 150 tokens: one-step decode and chunked prefill (5, 70: inside a
    64-token chunk and across chunk borders) give the full forward's logits (bound 1e-4);
    two sequences decoding together equal each alone."""
    model = mlxlis.load(qwen3n("next")[0], "float32")
    ids = trajectory(150, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(model.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 1e-4
    for chunk in (5, 70):
        cache = model.make_cache()
        outs = [
            np.array(model.net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 1e-4, chunk
    check_batched_decode(model, ids, 35, 1e-4)


def test_convert_round_trip_and_mlx_lm(qwen3n, tmp_path):
    """`convert` writes qwen3_next config.json keys (transformers' and the classic ones mlx-lm
    reads, mlp_only_layers for the dense layer): it reloads bit for bit to the same config and
    mlx-lm loads it to the same logits (bound 1e-4); the layout it writes keeps bfloat16 norms
    in bfloat16, as mlx-lm's own folders (a float32 one would turn mlx-lm's pass float32)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen3n("next")
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
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 1e-4
    # the layout convert writes keeps a bfloat16 folder's norms bfloat16 (the MoE does not run
    # in bfloat16 on the CPU, so convert's own check cannot run on such a folder here)
    from mlxlis.models.qwen3_next import mlx_lm_layout

    w = mx.array([0.001, -0.5], mx.bfloat16)
    shifted = mlx_lm_layout("model.layers.0.input_layernorm.weight", w)
    assert shifted.dtype == mx.bfloat16 and mx.array_equal(shifted, w + 1).item()


BAD = [
    ({"mlp_only_layers": [4]}, ConfigError, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, ConfigError, "decoder_sparse_step"),
    ({"norm_topk_prob": "false"}, ConfigError, "norm_topk_prob"),
    ({"linear_num_key_heads": 3}, ConfigError, "linear_num_key_heads"),
]


@pytest.mark.parametrize("change,error,field", BAD)
def test_bad_configs_are_named(qwen3n, tmp_path, change, error, field):
    """A config Qwen3-Next cannot run is refused with an MlxlisError naming the field."""
    check_config_refused(qwen3n("next")[0], tmp_path, change, error, field)


# ---------------------------------------------------------------- GGUF


def llama_cpp_tensors(ref, legacy: bool) -> dict[str, tuple[np.ndarray, str, object]]:
    """GGUF name -> (array, transformers name, how to get it back) as Qwen3NextModel writes
    it; `legacy`: in_proj_qkvz kept whole as ssm_in (what older converters wrote)."""
    c = ref.config
    kh, dk = c.linear_num_key_heads, c.linear_key_head_dim
    rv = c.linear_num_value_heads // kh * c.linear_value_head_dim
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, c.num_hidden_layers)
    out = {}
    for hf, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf.endswith(".A_log"):
            out[hf.replace("model.layers.", "blk.").replace("linear_attn.A_log", "ssm_a")] = (
                -np.exp(a),
                hf,
                lambda x: np.log(-x),
            )
            continue
        if hf.endswith(".dt_bias"):
            out[
                hf.replace("model.layers.", "blk.").replace("linear_attn.dt_bias", "ssm_dt.bias")
            ] = (
                a,
                hf,
                None,
            )
            continue
        if hf.endswith("mlp.experts.gate_up_proj"):  # (E, 2·F, hidden): gate rows, up rows
            i, f = hf.split(".")[2], a.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = (a[:, :f], hf, "gate")
            out[f"blk.{i}.ffn_up_exps.weight"] = (a[:, f:], hf, "up")
            continue
        if hf.endswith("mlp.experts.down_proj"):
            out[f"blk.{hf.split('.')[2]}.ffn_down_exps.weight"] = (a, hf, None)
            continue
        stem, part = hf.rsplit(".", 1)
        gname = f"{names.get_name(stem)}.{part}"
        if "conv1d" in hf:
            out[gname] = (a.squeeze(1), hf, lambda x: x[:, None, :])
        elif hf.endswith("norm.weight") and "linear_attn.norm" not in hf:
            out[gname] = (a + 1, hf, lambda x: x - 1)
        elif "in_proj_qkvz" in hf and not legacy:  # [q, k, v, z] per key head -> [q|k|v], z
            per = a.reshape(kh, 2 * dk + 2 * rv, -1)
            q, k, v, z = np.split(per, [dk, 2 * dk, 2 * dk + rv], axis=1)
            i = hf.split(".")[2]
            qkv = np.concatenate([y.reshape(-1, a.shape[1]) for y in (q, k, v)])
            out[f"blk.{i}.attn_qkv.weight"] = (qkv, hf, "qkv")
            out[f"blk.{i}.attn_gate.weight"] = (z.reshape(-1, a.shape[1]), hf, "z")
        else:
            out[gname] = (a, hf, None)
    return out


def write_gguf(path: Path, ref, folder: Path, qtype: Q, legacy: bool = False) -> dict:
    """The file and the transformers state dict of the weights it holds."""
    c = ref.config
    w = gguf.GGUFWriter(str(path), "qwen3next")
    add_gguf_sizes(w, c)  # Qwen2MoeModel's: feed_forward_length = intermediate_size
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    add_bpe_tokenizer(w, folder, c)
    held = {}
    for name, (a, hf, back) in llama_cpp_tensors(ref, legacy).items():
        floats = _add(w, name, a, qtype)
        if isinstance(back, str):  # one piece of a transformers tensor
            held.setdefault(hf, {})[back] = floats
        else:
            held[hf] = back(floats) if back else floats
    kh, dk = c.linear_num_key_heads, c.linear_key_head_dim
    for hf, v in list(held.items()):
        if not isinstance(v, dict):
            continue
        if "gate" in v:  # the experts' gate and up halves
            held[hf] = np.concatenate([v["gate"], v["up"]], axis=1)
            continue
        kd = kh * dk  # attn_qkv ([q | k | v]) + attn_gate back to in_proj_qkvz per key head
        q, k, vv = v["qkv"][:kd], v["qkv"][kd : 2 * kd], v["qkv"][2 * kd :]
        per = [y.reshape(kh, -1, y.shape[1]) for y in (q, k, vv, v["z"])]
        held[hf] = np.concatenate(per, axis=1).reshape(-1, q.shape[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in held.items()}


def _add(w, name: str, a: np.ndarray, qtype: Q) -> np.ndarray:
    forced_f32 = ("norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")
    if qtype == Q.F32 or a.ndim == 1 or a.shape[-1] % 32 or name.endswith(forced_f32):
        w.add_tensor(name, a.astype(np.float32))
        return a.astype(np.float32)
    data = gguf.quants.quantize(a, qtype)
    w.add_tensor(name, data, raw_dtype=qtype)
    return gguf.quants.dequantize(data, qtype).reshape(a.shape)


@pytest.mark.parametrize(
    "qtype,dequantize,legacy",
    [(Q.F32, None, False), (Q.Q8_0, False, False), (Q.Q8_0, None, False), (Q.F32, None, True)],
)
def test_gguf_matches_transformers_on_the_files_weights(
    qwen3n, tmp_path, qtype, dequantize, legacy
):
    """Reference parity on the GGUF path (Q8_0 kept and dense; an older file's ssm_in):
    transformers on the weights gguf-py dequantizes from the very file, 72 tokens, bound 1e-4:
    attn_qkv / attn_gate (value heads grouped, as transformers), ssm_ba fused per key head,
    A = −exp(A_log), the squeezed conv, the +1 norms and the stacked experts undone."""
    folder, ref = qwen3n("gguf")
    path = tmp_path / "m.gguf"
    held = write_gguf(path, ref, folder, qtype, legacy)
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(held, strict=False)
    twin.tie_weights()
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    assert model.config.deltanet.fused == (("qkvz", "ba") if legacy else ("ba",))
    ids = trajectory(72, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"


def test_gguf_convert_is_refused_for_the_split_layout(qwen3n, tmp_path):
    """A GGUF with attn_qkv / attn_gate has no config.json form yet: `convert` says so, naming
    the tensor, and writes nothing."""
    from mlxlis.commands.convert import convert

    folder, ref = qwen3n("gguf")
    path = tmp_path / "m.gguf"
    write_gguf(path, ref, folder, Q.F32)
    with pytest.raises(UnsupportedError) as e:
        convert(path, tmp_path / "out", dtype="float32")
    assert e.value.field == "attn_qkv" and not (tmp_path / "out").exists()
