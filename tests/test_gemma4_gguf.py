"""Gemma 4 GGUF files, written the way llama.cpp's converter writes them.

What the converter does is written here from llama.cpp's conversion/gemma.py (Gemma4Model on
Gemma3Model on TextModel) and read by its src/models/gemma4.cpp: arch `gemma4`; the shared keys
(block_count, context_length, embedding_length, feed_forward_length, head_count(_kv),
layer_norm_rms_epsilon, rope.freq_base = the full layers' θ, rope.freq_base_swa = the sliding
layers'), then sliding_window, final_logit_softcapping, attention.shared_kv_layers,
embedding_length_per_layer_input, attention.sliding_window_pattern (one bool per layer),
key_length/value_length = the full layers' head dim, key_length_swa/value_length_swa = the
sliding layers', rope.dimension_count = the full head dim, rope.dimension_count_swa,
expert_feed_forward_length; per-layer arrays for feed_forward_length (double-wide MLPs: twice
the width in KV-shared layers) and head_count_kv (global KV heads on full layers). Tensors:
norms stored as they are (Gemma 4's norm is x̂·w: no +1), names from gguf-py's TensorNameMap,
plus `blk.N.ffn_gate_inp.scale` (router.scale), `blk.N.ffn_down_exps.scale` (per_expert_scale),
`blk.N.layer_output_scale.weight`, the experts' fused gate_up as ffn_gate_up_exps (llama.cpp
also reads separate ffn_gate_exps / ffn_up_exps), and `rope_freqs.weight`: 1 for the
proportional RoPE's turned pairs, 1e30 for the rest. The vocabulary is the tiny BPE one, not
Gemma 4's own tokenizer model.

Reference parity: quantized tensors are Q8_0 (gguf-py's quantizer); transformers runs the
weights gguf-py dequantizes from the very file, and mlxlis' logits for the file must match.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlxlis
from mlxlis.errors import ConfigError, MlxlisError, UnsupportedError
from mlxlis.models.experts import QuantizedSwitchLinear

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, trajectory
from test_gemma4 import SPECS, build, reference_logits

Q = gguf.GGMLQuantizationType


def full_shape(hp: dict) -> tuple[int, int | None]:
    """(full head dim, full KV heads or None) as the converter finds them in config.json:
    global_* keys, else a full layer's per_layer_config (what transformers 5 saves)."""
    full = next(
        (
            v
            for i, v in (hp.get("per_layer_config") or {}).items()
            if hp["layer_types"][int(i)] == "full_attention"
        ),
        {},
    )
    hd = hp.get("global_head_dim") or full.get("head_dim")
    return hd, hp.get("num_global_key_value_heads") or full.get("num_key_value_heads")


def write_metadata(w: gguf.GGUFWriter, hp: dict) -> None:
    """The keys llama.cpp's converter writes from config.json (`hp`), in its order (a later
    write overwrites an earlier one)."""
    n, swa = hp["num_hidden_layers"], [t == "sliding_attention" for t in hp["layer_types"]]
    rp = hp["rope_parameters"]
    # TextModel.set_gguf_parameters
    w.add_block_count(n)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(rp["full_attention"]["rope_theta"])  # "proportional": no scaling key
    w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_experts"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["top_k_experts"])
    # Gemma3Model.set_gguf_parameters
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    # Gemma4Model.set_gguf_parameters
    w.add_shared_kv_layers(hp["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    head_full, kv_full = full_shape(hp)
    w.add_key_length(head_full)
    w.add_value_length(head_full)
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    if hp.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    first = n - hp["num_kv_shared_layers"]
    if hp.get("use_double_wide_mlp"):
        ff = hp["intermediate_size"]
        w.add_feed_forward_length([ff if i < first else 2 * ff for i in range(n)])
    if kv_full is not None:
        w.add_head_count_kv([hp["num_key_value_heads"] if s else kv_full for s in swa])
    w.add_rope_dimension_count(head_full)  # proportional RoPE: via rope_freqs
    w.add_rope_dimension_count_swa(int(hp["head_dim"] * rp.get("partial_rotary_factor", 1.0)))


def rope_freqs(hp: dict) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: 1 for each turned pair, 1e30 for the others."""
    head_full, _ = full_shape(hp)
    turned = int(head_full * hp["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turned + [1e30] * (head_full // 2 - turned), np.float32)


def gguf_tensors(ref, hp: dict, fused: bool = True) -> dict[str, tuple[np.ndarray, list[str]]]:
    """llama.cpp name -> (array, the transformers names it came from): gguf-py's TensorNameMap
    plus the converter's own renames (Gemma4Model.filter_tensors / modify_tensors)."""
    cfg = ref.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_hidden_layers)
    out: dict[str, tuple[np.ndarray, list[str]]] = {"rope_freqs.weight": (rope_freqs(hp), [])}
    for hf, t in ref.state_dict().items():
        a = t.detach().float().numpy()
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp omits output.weight when tied
        i = re.match(r"model\.layers\.(\d+)\.", hf)
        if hf.endswith("router.scale"):
            out[f"blk.{i.group(1)}.ffn_gate_inp.scale"] = (a, [hf])
        elif hf.endswith("router.per_expert_scale"):  # moved onto the down experts
            out[f"blk.{i.group(1)}.ffn_down_exps.scale"] = (a, [hf])
        elif hf.endswith("experts.gate_up_proj") and not fused:  # (E, 2·F, hidden): gate, up
            f = a.shape[1] // 2
            out[f"blk.{i.group(1)}.ffn_gate_exps.weight"] = (a[:, :f], [hf])
            out[f"blk.{i.group(1)}.ffn_up_exps.weight"] = (a[:, f:], [hf])
        else:  # layer_scalar and the experts get ".weight" appended (filter_tensors)
            stem, part = hf.rsplit(".", 1) if hf.endswith((".weight", ".bias")) else (hf, "weight")
            target = names.get_name(stem)
            assert target is not None, hf  # llama.cpp knows every text tensor
            out[f"{target}.{part}"] = (a, [hf])
    return out


def encode(a: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(data to write, the floats the file holds per gguf-py's dequantize)."""
    if qtype == Q.F32:
        return a, a
    data = gguf.quants.quantize(a, qtype)  # rows (the last dim) are independent
    return data, gguf.quants.dequantize(data, qtype).reshape(a.shape)


def write_gguf(
    path: Path,
    ref,
    folder: Path,
    qtype: Q,
    fused: bool = True,
    extra: dict | None = None,
    meta: dict | None = None,
) -> dict[str, torch.Tensor]:
    """`ref` as llama.cpp's converter writes it (matrices whose rows Q8_0 blocks fit in
    `qtype`, the rest F32), plus `extra` tensors and `meta` keys changed ((value, type), or None:
    removed); returns the state dict of the weights the file holds."""
    hp = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "gemma4")
    write_metadata(w, hp)
    for key, change in (meta or {}).items():
        w.kv_data[0].pop(key)
        if change is not None:
            w.add_key_value(key, *change)
    add_bpe_tokenizer(w, folder, ref.config)
    held: dict[str, list[np.ndarray]] = {}
    for name, (a, sources) in {
        **gguf_tensors(ref, hp, fused),
        **{k: (v, []) for k, v in (extra or {}).items()},
    }.items():
        q = qtype if a.ndim > 1 and a.shape[-1] % 32 == 0 else Q.F32
        data, floats = encode(a, q)
        w.add_tensor(name, data, raw_dtype=None if q == Q.F32 else q)
        for hf in sources:
            held.setdefault(hf, []).append(floats)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        k: torch.from_numpy(np.ascontiguousarray(np.concatenate(v, 1) if len(v) > 1 else v[0]))
        for k, v in held.items()
    }


CASES = {  # file -> (tiny model, tensor type, experts fused as the converter writes them)
    "e2b-f32": ("e2b", Q.F32, True),
    "e2b-q8_0": ("e2b", Q.Q8_0, True),
    "moe-q8_0": ("moe", Q.Q8_0, True),
    "all-q8_0-split": ("all", Q.Q8_0, False),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (path, transformers model holding the file's weights, tiny folder)."""
    models: dict[str, tuple] = {}
    made: dict[str, tuple] = {}

    def get(case: str, extra: dict | None = None, meta: dict | None = None):
        key = case + ("+extra" if extra else "") + "".join(f"+{k}" for k in meta or {})
        if key not in made:
            spec, qtype, fused = CASES[case]
            if spec not in models:
                folder = tmp_path_factory.mktemp(spec)
                models[spec] = (folder, build(folder, SPECS[spec]))
            folder, ref = models[spec]
            path = tmp_path_factory.mktemp("gguf") / f"{key}.gguf"
            sd = write_gguf(path, ref, folder, qtype, fused, extra, meta)
            twin = ref.__class__(ref.config).eval()
            twin.load_state_dict(sd, strict=False)
            if ref.config.tie_word_embeddings:
                twin.tie_weights()
            made[key] = (path, twin, folder)
        return made[key]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dequantize", [False, None])
def test_gguf_matches_transformers_on_the_files_weights(files, case, dequantize):
    """Reference parity on the whole GGUF path, quantized blocks kept (dequantize=False: the
    experts through gather_qmm, the per-layer embedding a quantized lookup) and the CPU default
    (dense): transformers on the dequantized weights, 64 tokens, float32; bound 1e-4 (measured
    1.3e-5 to 2.6e-5 at |logit| ≤ 3; test_gemma4.py says why not lower): per-layer arrays,
    the swa pattern, per-type head dims, RoPE from rope_freqs, KV sharing by llama.cpp's rule,
    unshifted norms, the `.scale` tensors."""
    path, twin, _ = files(case)
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    ids = trajectory(64, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 0.5
    s = model.config.family_config
    assert model.config.layer_types == tuple(twin.config.layer_types)
    if case.startswith(("moe", "all")):
        experts = model.net.model.layers[0].experts.switch_glu
        assert s.fused_gate_up == ("split" not in case)
        proj = experts.gate_up_proj if s.fused_gate_up else experts.gate_proj
        assert isinstance(proj, QuantizedSwitchLinear) == (dequantize is False)


def test_gguf_equals_safetensors_path(files, tmp_path):
    """The F32 file and the transformers folder of the same model give the same logits
    (measured 0, bound 1e-5): the two readers agree on every convention."""
    path, _, folder = files("e2b-f32")
    ids = trajectory(48, vocab=400)
    a = np.array(mlxlis.load(path, "float32").logits(ids))
    b = np.array(mlxlis.load(folder, "float32").logits(ids))
    assert np.abs(a - b).max() < 1e-5


def test_unused_kv_of_shared_layers_is_ignored(files):
    """Hub checkpoints carry K/V weights for KV-shared layers and the converter writes them
    (llama.cpp loads them as optional, unused): such a file loads to the same logits."""
    rng = np.random.default_rng(0)
    extra = {
        "blk.4.attn_k.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "blk.4.attn_v.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "blk.4.attn_k_norm.weight": np.ones(16, np.float32),
    }
    plain, _, _ = files("e2b-f32")
    path, _, _ = files("e2b-f32", extra)
    ids = trajectory(40, vocab=400)
    a = mlxlis.load(path, "float32").logits(ids)
    assert bool(mx.array_equal(a, mlxlis.load(plain, "float32").logits(ids)))


def test_written_file_reads_back_as_llama_cpp_expects(files):
    """gguf-py reads the file back: the fused experts as ne [hidden, 2·F, E], rope_freqs
    [1, 1, 1, 1, 1e30 × 12] for 4 turned pairs of 16, the per-layer feed_forward_length and
    head_count_kv arrays llama.cpp's get_key_or_arr takes."""
    path, _, _ = files("moe-q8_0")
    r = gguf.GGUFReader(path)
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert shapes["blk.0.ffn_gate_up_exps.weight"] == (64, 64, 4)
    assert shapes["blk.0.ffn_down_exps.scale"] == (4,)
    assert "blk.1.attn_v.weight" not in shapes and "blk.0.attn_v.weight" in shapes  # k_eq_v
    kv = r.fields["gemma4.attention.head_count_kv"]
    assert [int(kv.parts[i][0]) for i in kv.data] == [2, 1, 2, 1]
    e2b = gguf.GGUFReader(files("e2b-f32")[0])
    ff = e2b.fields["gemma4.feed_forward_length"]
    assert [int(ff.parts[i][0]) for i in ff.data] == [96] * 4 + [192] * 2
    freqs = next(t for t in e2b.tensors if t.name == "rope_freqs.weight").data
    assert list(freqs) == [1.0] * 4 + [1e30] * 12


def test_convert_round_trip_and_mlx_lm(files, tmp_path):
    """The full layers' proportional RoPE, a rope_freqs tensor in the GGUF (1 for the turned
    pairs, 1e30 for the rest), is read as config, so `convert` writes it into config.json: the
    folder reloads bit for bit and mlx-lm loads it to the same logits (bound 1e-4)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    path, _, _ = files("e2b-q8_0")
    src = mlxlis.load(path, "float32", dequantize=False)
    assert src.config.family_config.full_rotated == 4  # [1.0] * 4 + [1e30] * 12
    out = convert(path, tmp_path / "out", dtype="float32")
    again = mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=src.config.vocab_size)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    theirs, _ = mlx_lm_load(str(out))
    delta = np.abs(np.array(theirs(mx.array([ids]))[0]) - np.array(again.logits(ids))).max()
    assert delta < 1e-4, delta


BAD = [  # (metadata change, error class, field it names)
    (
        {"gemma4.attention.sliding_window_pattern": None},
        ConfigError,
        "gemma4.attention.sliding_window_pattern",
    ),
    (
        {"gemma4.attention.shared_kv_layers": (3, gguf.GGUFValueType.UINT32)},
        UnsupportedError,
        "gemma4.attention.shared_kv_layers",
    ),
    ({"gemma4.attention.key_length_swa": None}, ConfigError, "gemma4.attention.key_length_swa"),
    (
        {"gemma4.rope.dimension_count": (30, gguf.GGUFValueType.UINT32)},
        ConfigError,
        "rope_freqs.weight",
    ),
]


@pytest.mark.parametrize("change,error,field", BAD)
def test_bad_metadata_is_named(files, change, error, field):
    """A file llama.cpp would refuse or read differently is refused with an MlxlisError naming
    the file and the key or tensor."""
    path, _, _ = files("e2b-f32", meta=change)
    with pytest.raises(error) as e:
        mlxlis.load(path, "float32")
    assert isinstance(e.value, MlxlisError)
    assert e.value.field == field and str(path) in str(e.value), str(e.value)


def test_cached_decode_on_the_fused_experts_file(files):
    """Self-consistency on the GGUF path with blocks kept (Q8_0, fused gate/up experts: the
    per-token gather in decode, the expert-sorted one in prefill): one-token decode and chunked
    prefill give the full forward's logits (measured 1.3e-5 decode, 5.7e-6
    chunked; bound 3e-4)."""
    path, _, _ = files("moe-q8_0")
    model = mlxlis.load(path, "float32", dequantize=False)
    ids = trajectory(64, vocab=400)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(model.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 3e-4
    cache = model.make_cache()
    outs = [
        np.array(model.net(mx.array([ids[s : s + 24]]), cache=cache)[0])
        for s in range(0, len(ids), 24)
    ]
    assert np.abs(np.concatenate(outs) - full).max() < 3e-4
