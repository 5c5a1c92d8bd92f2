"""Qwen3 and Qwen3-MoE GGUF files, written the way llama.cpp's converter writes them.

What the converter does is written here from convert_hf_to_gguf (Qwen3Model / Qwen3MoeModel
on Qwen2Model / Qwen2MoeModel): arch `qwen3` / `qwen3moe`; keys block_count, context_length,
embedding_length, feed_forward_length, attention.head_count(_kv), attention.key_length and
value_length (= head_dim), rope.freq_base, attention.layer_norm_rms_epsilon, and for the MoE
expert_count, expert_used_count, expert_feed_forward_length; tensors under llama.cpp's names,
no Q/K permutation, each layer's experts stacked in expert order into 3-D
ffn_gate_exps / ffn_up_exps (E, n_ff, n_embd) and ffn_down_exps (E, n_embd, n_ff), the router
as ffn_gate_inp, output.weight omitted when tied. The names are written out here, independently
of the families' tables, and checked against gguf-py's TensorNameMap.

Reference parity: quantized tensors are Q8_0 (gguf-py's quantizer on the real weights) or
Q4_K / Q6_K (random blocks with sane scales: gguf-py has no K-quantizer); transformers runs the
weights gguf-py dequantizes from the very file, and mlxlis' logits for the file must match.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlxlis
from mlxlis.models import family
from mlxlis.models.experts import QuantizedSwitchLinear

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, trajectory
from test_qwen3 import SPECS, build, reference_logits

Q = gguf.GGMLQuantizationType
BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
K_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the fp16 scales in a block
K_SCALE = {Q.Q4_K: 2e-4, Q.Q6_K: 3e-5}  # |w| ≲ 0.2 (Q4_K: d·63·15; Q6_K: d·128·32)


def gguf_tensors(ref) -> dict[str, np.ndarray]:
    """transformers' in-memory weights under llama.cpp's names, experts split and stacked."""
    cfg = ref.config
    out = {}
    for name, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # llama.cpp omits output.weight when tied
        stem, part = name.rsplit(".", 1)
        if stem in TOP:
            out[f"{TOP[stem]}.{part}"] = a
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # (E, 2·n_ff, n_embd): gate rows, then up rows
            f = a.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = a[:, :f]
            out[f"blk.{i}.ffn_up_exps.weight"] = a[:, f:]
        elif rest == "mlp.experts.down_proj":  # (E, n_embd, n_ff)
            out[f"blk.{i}.ffn_down_exps.weight"] = a
        else:
            stem, part = rest.rsplit(".", 1)
            out[f"blk.{i}.{BLOCK[stem]}.{part}"] = a
    return out


def back_to_transformers(ref, held: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The inverse of gguf_tensors: a state dict for transformers' model."""
    inverse = {v: k for k, v in BLOCK.items()} | {v: k for k, v in TOP.items()}
    sd = {}
    for name, a in held.items():
        stem, part = name.rsplit(".", 1)
        if stem in inverse:
            sd[f"{inverse[stem]}.{part}"] = a
            continue
        _, i, key = stem.split(".", 2)
        if key == "ffn_gate_exps":
            up = held[f"blk.{i}.ffn_up_exps.weight"]
            sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([a, up], 1)
        elif key == "ffn_down_exps":
            sd[f"model.layers.{i}.mlp.experts.down_proj"] = a
        elif key != "ffn_up_exps":
            sd[f"model.layers.{i}.{inverse[key]}.{part}"] = a
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def encode(name: str, a: np.ndarray, qtype: Q, rng) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or floats to write, the floats the file holds per gguf-py's dequantize)."""
    if qtype == Q.F32 or a.ndim == 1:
        return a, a
    if qtype in K_FIELDS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n = a.size // block
        raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
        for off in K_FIELDS[qtype]:
            d = (np.abs(rng.standard_normal(n)) * K_SCALE[qtype]).astype(np.float16)
            raw[:, off : off + 2] = d.view(np.uint8).reshape(n, 2)
        data = raw.reshape(*a.shape[:-1], a.shape[-1] // block * size)
    else:
        data = gguf.quants.quantize(a, qtype)  # rows (the last dim) are independent
    return data, gguf.quants.dequantize(data, qtype).reshape(a.shape)


def write_gguf(path: Path, ref, folder: Path, types) -> dict[str, np.ndarray]:
    """`ref` as llama.cpp's converter writes it; `types(gguf_name) -> GGML type`. Returns the
    floats each tensor holds, under the GGUF names."""
    cfg = ref.config
    moe = cfg.model_type == "qwen3_moe"
    w = gguf.GGUFWriter(str(path), "qwen3moe" if moe else "qwen3")
    add_gguf_sizes(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    add_bpe_tokenizer(w, folder, cfg)
    rng = np.random.default_rng(0)
    held = {}
    arch = gguf.MODEL_ARCH.QWEN3MOE if moe else gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, a in gguf_tensors(ref).items():
        assert names.get_name(name.rsplit(".", 1)[0]) is not None, name  # llama.cpp knows it
        qtype = types(name)
        data, held[name] = encode(name, a, qtype, rng)
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 or a.ndim == 1 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def k_types(name: str) -> Q:
    """The K-quant file: Q4_K experts (gate/up) and attention, Q6_K down experts and the
    embedding, Q8_0 for the rest (o_proj rows are 128 long: no K-quant fits)."""
    if any(k in name for k in ("ffn_gate_exps", "ffn_up_exps", "attn_q.", "attn_k.", "attn_v.")):
        return Q.Q4_K
    if "ffn_down_exps" in name or name.startswith("token_embd"):
        return Q.Q6_K
    return Q.Q8_0


BOUND = {"qwen3-q8_0": 3e-5, "qwen3-tied-f32": 3e-5, "qwen3moe-q8_0": 1e-4, "qwen3moe-k": 1e-4}
CASES = {  # file -> (tiny model, tensor types)
    "qwen3-q8_0": ("qwen3", lambda n: Q.Q8_0),
    "qwen3-tied-f32": ("qwen3_tied", lambda n: Q.F32),
    "qwen3moe-q8_0": ("qwen3_moe_k", lambda n: Q.Q8_0),
    "qwen3moe-k": ("qwen3_moe_k", k_types),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """file name -> (path, transformers model holding the file's weights, tiny folder)."""
    models: dict[str, tuple] = {}
    made: dict[str, tuple] = {}

    def get(case: str):
        if case not in made:
            spec_name, types = CASES[case]
            if spec_name not in models:
                folder = tmp_path_factory.mktemp(spec_name)
                models[spec_name] = (folder, build(folder, SPECS[spec_name]))
            folder, ref = models[spec_name]
            path = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            held = write_gguf(path, ref, folder, types)
            twin = ref.__class__(ref.config).eval()
            twin.load_state_dict(back_to_transformers(ref, held), strict=False)
            if ref.config.tie_word_embeddings:
                twin.tie_weights()
            made[case] = (path, twin, folder)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dequantize", [False, None])
def test_gguf_matches_transformers_on_the_files_weights(files, case, dequantize):
    """Reference parity on the whole GGUF path, quantized blocks kept (dequantize=False: the
    expert tensors run through gather_qmm) and the CPU default (dense): transformers on the
    dequantized weights, 64 tokens, float32; bounds per file about 15x the measured max |Δ|
    (2.0e-6 dense Qwen3, 2.3e-6 tied F32), at most 1e-4 (1.1e-5 Q8_0 MoE, 3.0e-5 K-quant MoE
    at |logit| 6.5)."""
    path, twin, _ = files(case)
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    ids = trajectory(64, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND[case], f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 0.5
    if "moe" in case:
        assert model.config.family == "qwen3_moe" and all(model.config.moe.sparse_layers)
        assert model.config.moe.norm_topk_prob  # llama.cpp's qwen3moe always renormalises
        experts = model.net.model.layers[0].mlp.switch_mlp
        kept = dequantize is False and not case.endswith("f32")
        assert isinstance(experts.gate_proj, QuantizedSwitchLinear) == kept
        if case == "qwen3moe-k":  # Q6_K has no exact MLX form: it is made dense
            assert not isinstance(experts.down_proj, QuantizedSwitchLinear)


def test_gguf_equals_safetensors_path(files, tmp_path):
    """The Q8_0 MoE file and a folder holding the same (dequantized) weights in the Hugging
    Face per-expert layout give the same logits (bound 1e-5)."""
    path, twin, folder = files("qwen3moe-q8_0")
    same = tmp_path / "same"
    same.mkdir()
    for f in folder.iterdir():
        if not f.name.endswith(".safetensors"):
            (same / f.name).write_bytes(f.read_bytes())
    twin.save_pretrained(same)
    ids = trajectory(48, vocab=400)
    a = np.array(mlxlis.load(path, "float32", dequantize=True).logits(ids))
    b = np.array(mlxlis.load(same, "float32").logits(ids))
    assert np.abs(a - b).max() < 1e-5


@pytest.mark.parametrize("case", ["qwen3-q8_0", "qwen3moe-k"])
def test_convert_round_trip_and_mlx_lm(files, case, tmp_path):
    """`convert` writes the GGUF as an MLX folder (blocks kept: stacked quantized experts under
    mlx-lm's switch_mlp names): it reloads bit for bit, and mlx-lm loads it to the same logits
    (bound 1e-4)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    path, _, _ = files(case)
    out = convert(path, tmp_path / "out", dtype="float32")
    src = mlxlis.load(path, "float32", dequantize=False)
    again = mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=src.config.vocab_size)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family(src.config.family).export.model_type
    theirs_model, _ = mlx_lm_load(str(out))  # classic keys, as convert writes them
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 1e-4


def test_inspect_names_the_family_and_the_experts(files):
    """`mlxlis inspect --json` on the MoE file reports the family, its quant types and the
    experts as the file's metadata states them (expert_count 8, expert_used_count 2)."""
    path, _, _ = files("qwen3moe-k")
    out = subprocess.run(
        [sys.executable, "-m", "mlxlis", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["family"] == "qwen3_moe"
    assert "Q4_K" in report["quant"] and "Q6_K" in report["quant"], report["quant"]
    assert report["config"]["experts"] == {
        "count": 8,
        "per_token": 2,
        "width": 256,
        "sparse_layers": [0, 1],
        "norm_topk_prob": True,
    }
    text = subprocess.run(
        [sys.executable, "-m", "mlxlis", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert "experts: 2 of 8 per token, width 256, in 2 layers" in text


def test_expert_tensor_shapes_follow_llama_cpp(files):
    """gguf-py reads the stacked experts back as ggml ne = [n_embd, n_ff, E] (gate/up) and
    [n_ff, n_embd, E] (down): the layout llama.cpp's qwen3moe loader requires."""
    path, twin, _ = files("qwen3moe-q8_0")
    cfg = twin.config
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in gguf.GGUFReader(path).tensors}
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert shapes["blk.0.ffn_gate_exps.weight"] == (d, f, e)
    assert shapes["blk.0.ffn_down_exps.weight"] == (f, d, e)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (d, e)
    assert math.prod(shapes["blk.1.ffn_up_exps.weight"]) == e * f * d
