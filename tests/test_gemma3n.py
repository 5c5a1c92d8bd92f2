"""Gemma 3n (text) against transformers, mlx-lm, llama.cpp's file layout and itself.

Reference parity: tiny random `gemma3n_text` checkpoints written by transformers'
save_pretrained against its float32 forward over 72 tokens (9 sliding windows): "e2b" (4
streams, per-layer inputs from a table smaller than the vocabulary, the last 3 of 6 layers
KV-shared, the first two MLPs' gates sparsified at 0.95 / 0.9, per-layer MLP widths, a final
softcap) and "alt" (3 streams with stream 1 active, no output scale, no KV sharing, θ from the
classic keys). Gemma 3n amplifies float32 rounding as Gemma 4 does (test_gemma4.py):
transformers' own float32 forward is 1.1e-5 from its float64 one on "e2b", mlxlis' 7.2e-6;
bounds sit above that. Second reference: mlx-lm's gemma3n (it reads the multimodal wrapper only)
on the same weights, under the wrapper's names beside a vision and an audio tower, and its own
4-bit conversion. GGUF: written with gguf-py as llama.cpp's Gemma3NModel writes it (altup
projections stacked, embeddings padded with zero rows to the vocabulary, Φ⁻¹ per layer), against
transformers on the weights gguf-py dequantizes from the very file. Self-consistency: cached
decode, chunked prefill and batches equal the full forward; `convert` round trips and mlx-lm
reads what it writes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlxlis
from mlxlis.commands.report import format_report, model_report
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.generation.steps import prefill

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from conftest import (
    add_bpe_tokenizer,
    build_tiny,
    check_batched_decode,
    check_config_refused,
    tiny_models,
    trajectory,
)
from safetensors.numpy import load_file, save_file

S, F = "sliding_attention", "full_attention"
Q = gguf.GGMLQuantizationType
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    max_position_embeddings=512,
    hidden_size_per_layer_input=16,
    laurel_rank=8,
)
SPECS = {
    "e2b": dict(
        num_hidden_layers=6,
        intermediate_size=[96, 128, 96, 64, 96, 96],
        layer_types=[S, S, F, S, S, F],
        num_kv_shared_layers=3,
        vocab_size_per_layer_input=300,
        activation_sparsity_pattern=[0.95, 0.9, 0.0, 0.0, 0.0, 0.0],
        altup_num_inputs=4,
        final_logit_softcapping=30.0,
    ),
    "alt": dict(
        num_hidden_layers=4,
        intermediate_size=96,
        layer_types=[S, F, S, F],
        num_kv_shared_layers=0,
        vocab_size_per_layer_input=400,
        activation_sparsity_pattern=[0.8, 0.0, 0.0, 0.0],
        altup_num_inputs=3,
        altup_active_idx=1,
        altup_correct_scale=False,
        final_logit_softcapping=20.0,
    ),
}


def build(folder: Path, spec: dict, seed: int = 0):
    """A tiny random gemma3n_text checkpoint written by transformers; the model (fp32, eval).
    "alt" states its θs the classic way (rope_theta / rope_local_base_freq)."""
    ref = build_tiny(folder, {"kind": "gemma3n_text", **COMMON, **spec}, seed, pad_token_id=1)
    if spec.get("altup_active_idx"):
        cfg = json.loads((folder / "config.json").read_text())
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rp[F]["rope_theta"]
        cfg["rope_local_base_freq"] = rp[S]["rope_theta"]
        (folder / "config.json").write_text(json.dumps(cfg))
    return ref


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


def mlx_lm_logits(model, ids: list[int]) -> np.ndarray:
    """mlx-lm's logits, with its caches: without them its KV-shared layers use their own K/V
    weights instead of the source layer's."""
    from mlx_lm.models.cache import make_prompt_cache

    out = model(mx.array([ids]), cache=make_prompt_cache(model))
    return np.array(out[0].astype(mx.float32))


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(gemma3n, name):
    """Reference parity over 72 tokens within 5e-5 (measured 1.4e-5 e2b at |logit| ≤ 3):
    AltUp's predict / correct and the streams in and out, LAuReL, the sparse gates, per-layer
    inputs (ids past their table read row 0), KV sharing, θ per layer type."""
    folder, ref = gemma3n(name)
    model = mlxlis.load(folder, "float32")
    assert model.config.family == "gemma3n"
    ids = trajectory(72, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 5e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_structure_follows_the_config(gemma3n):
    """KV-shared layers without K/V weights reading the last earlier layer of their type (as
    transformers' kv_sharing_modes), per-layer MLP widths, the sparse layers' cutoffs equal to
    torch's Normal(0, 1).icdf, one cache per layer with its own K/V."""
    folder, ref = gemma3n("e2b")
    model = mlxlis.load(folder, "float32")
    s = model.config.family_config
    modes = ref.config.kv_sharing_modes
    for i, (ours, theirs) in enumerate(zip(model.net.model.layers, ref.model.layers, strict=True)):
        assert ("k_proj" in ours.self_attn) == (modes[i] != "reuse"), i
        assert ours.mlp.up_proj.weight.shape == tuple(theirs.mlp.up_proj.weight.shape), i
    assert s.kv_source == (0, 1, 2, 1, 1, 2)
    icdf = torch.distributions.normal.Normal(0, 1).icdf
    want = [
        float(icdf(torch.tensor(p))) if p else None for p in ref.config.activation_sparsity_pattern
    ]
    assert list(s.sparsity_std) == want
    assert len(model.make_cache()) == 3
    streams = model_report(model)["config"]["streams"]
    assert streams == {"count": 4, "active": 0, "laurel_rank": 8, "sparse_gate_layers": [0, 1]}


def wrapped(folder: Path, dest: Path) -> Path:
    """The checkpoint as a Gemma3nForConditionalGeneration folder: text_config (with the
    classic θ keys mlx-lm reads), the text tensors under `model.language_model.`, a vision and
    an audio tower and their embedders beside them, and K/V weights on the KV-shared layers
    (the hub's checkpoints keep them; transformers ignores them, mlx-lm requires them)."""
    shutil.copytree(folder, dest)
    w = load_file(str(dest / "model.safetensors"))
    out = {"model.language_model." + k[len("model.") :]: v for k, v in w.items()}
    for tower in ("vision_tower.timm_model.conv_stem.conv", "audio_tower.conformer.0.norm"):
        out[f"model.{tower}.weight"] = np.zeros((8, 4), np.float32)
    for emb in ("embed_vision", "embed_audio"):
        out[f"model.{emb}.embedding.weight"] = np.zeros((4, 64), np.float32)
    text = json.loads((dest / "config.json").read_text())
    rng = np.random.default_rng(0)  # hub checkpoints keep K/V weights on KV-shared layers
    kv = text["num_key_value_heads"] * text["head_dim"]
    for i in range(
        text["num_hidden_layers"] - text["num_kv_shared_layers"], text["num_hidden_layers"]
    ):
        p = f"model.language_model.layers.{i}.self_attn."
        for name, shape in (("k_proj", (kv, 64)), ("v_proj", (kv, 64)), ("k_norm", (16,))):
            out[f"{p}{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    rp = text.get("rope_parameters") or {}
    text.setdefault("rope_theta", rp.get(F, {}).get("rope_theta", 1e6))
    text.setdefault("rope_local_base_freq", rp.get(S, {}).get("rope_theta", 1e4))
    cfg = {
        "model_type": "gemma3n",
        "architectures": ["Gemma3nForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "gemma3n_vision"},
        "audio_config": {"model_type": "gemma3n_audio"},
    }
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("name", list(SPECS))
def test_wrapper_and_mlx_lm(gemma3n, name, tmp_path):
    """The wrapper folder loads the language model to the very logits of the text folder, the
    towers skipped and said; mlx-lm's gemma3n on it: the same logits within 1e-4 (measured
    below 2e-5)."""
    from mlx_lm import load as mlx_lm_load

    folder, _ = gemma3n(name)
    wrap = wrapped(folder, tmp_path / "wrapped")
    ids = trajectory(72, vocab=400)
    model = mlxlis.load(wrap, "float32")
    ours = np.array(model.logits(ids))
    assert np.array_equal(ours, np.array(mlxlis.load(folder, "float32").logits(ids)))
    assert any("vision_tower" in s for s in model.skipped)
    assert "audio_tower" in format_report(model_report(model))
    theirs_model, _ = mlx_lm_load(str(wrap))
    theirs = mlx_lm_logits(theirs_model, ids)
    assert np.abs(ours - theirs).max() < 1e-4


def test_mlx_quantized_folder_matches_mlx_lm(gemma3n, tmp_path):
    """mlx-lm's own 4-bit conversion (its layout: K/V weights kept on KV-shared layers, which
    are dropped as transformers drops them) loads as it is and gives mlx-lm's logits on it
    (float32 activations; bound 5e-4)."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = gemma3n("e2b")
    out = tmp_path / "q4"
    mlx_lm_convert(
        str(wrapped(folder, tmp_path / "wrapped")),
        str(out),
        quantize=True,
        q_group_size=32,
        q_bits=4,
        dtype="float32",
    )
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    assert isinstance(model.net.model.altup_projections[0], nn.QuantizedLinear)
    assert isinstance(model.net.model.layers[0].altup.correction_coefs, nn.Linear)  # 4 × 4
    theirs_model, _ = mlx_lm_load(str(out))
    ids = trajectory(48, vocab=400)
    theirs = mlx_lm_logits(theirs_model, ids)
    assert np.abs(np.array(model.logits(ids)) - theirs).max() < 5e-4


def test_cached_decode_and_batches_equal_the_full_forward(gemma3n):
    """Self-consistency over 80 tokens (10 windows): one-token decode and chunked prefill (5,
    16) with the caches, KV-shared layers over their source's cache, the streams carried
    through; generate's prefill (newest position only from the first KV-shared layer) its last
    row; two sequences at different offsets batched equal each alone. Bound 3e-4 (float32
    floor as above); a wrong window, offset, shared cache or stream moves them by 1e-2 or more."""
    model = mlxlis.load(gemma3n("e2b")[0], "float32")
    ids = trajectory(80, vocab=model.config.vocab_size)
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
    check_batched_decode(model, ids, 35, 3e-4)


def test_convert_round_trip_and_mlx_lm(gemma3n, tmp_path):
    """`convert` writes the gemma3n wrapper (the type mlx-lm reads) with the text under
    model.language_model.: it reloads bit for bit to the same config, and mlx-lm loads it to
    the same logits (bound 1e-4)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = gemma3n("e2b")
    out = convert(folder, tmp_path / "out", dtype="float32")
    src, again = mlxlis.load(folder, "float32"), mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=400)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    assert again.config == src.config.with_(
        source=again.config.source,
        special=replace(src.config.special, eos=again.config.special.eos),
    )
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma3n"
    assert written["text_config"]["model_type"] == "gemma3n_text"
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = mlx_lm_logits(theirs_model, ids)
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 1e-4


def test_sparse_gate_holds_in_float16(gemma3n):
    """Self-consistency across dtypes at a real width (E2B's 8192, gate RMS ≈ 3): the sparse
    MLP in float16 equals its float32 result to float16's rounding; the gate's moments, whose
    sum of squares passes float16's range there, are taken in float32 (else the cutoff is
    +∞ and the layer's output 0)."""
    from mlxlis.models.gemma3n_net import SparseMLP

    cfg = mlxlis.load(gemma3n("e2b")[0], "float32").config
    mx.random.seed(0)
    mlp = SparseMLP(cfg, 8192, cfg.family_config.sparsity_std[0])
    mlp.gate_proj.weight = mx.random.normal(mlp.gate_proj.weight.shape) * 0.4
    x = mx.random.normal((1, 4, cfg.hidden_size))
    want = mlp(x)
    mlp.set_dtype(mx.float16)
    got = mlp(x.astype(mx.float16)).astype(mx.float32)
    scale = float(mx.abs(want).max())
    assert scale > 0 and float(mx.abs(got - want).max()) < 1e-2 * scale


BAD = [  # (change to config.json, error class, field it names)
    ({"num_kv_shared_layers": 6}, ConfigError, "num_kv_shared_layers"),
    ({"altup_active_idx": 4}, ConfigError, "altup_active_idx"),
    (
        {"activation_sparsity_pattern": [1.0] + [0.0] * 5},
        ConfigError,
        "activation_sparsity_pattern",
    ),
    ({"activation_sparsity_pattern": [0.5]}, ConfigError, "activation_sparsity_pattern"),
    (  # 1 in float32, where transformers takes Φ⁻¹
        {"activation_sparsity_pattern": [0.99999999] + [0.0] * 5},
        ConfigError,
        "activation_sparsity_pattern",
    ),
    ({"altup_correct_scale": None}, ConfigError, "altup_correct_scale"),
    ({"intermediate_size": [96, 96]}, ConfigError, "intermediate_size"),
    (
        {"rope_parameters": {F: {"rope_type": "linear", "factor": 2.0}, S: {}}},
        UnsupportedError,
        "rope_parameters.full_attention.rope_type",
    ),
    ({"hidden_activation": "relu"}, UnsupportedError, "hidden_activation"),
]


@pytest.mark.parametrize("change,error,field", BAD)
def test_bad_configs_are_named(gemma3n, tmp_path, change, error, field):
    """What Gemma 3n does not implement, or a config that contradicts itself, is refused with
    an MlxlisError naming config.json and the field."""
    check_config_refused(gemma3n("e2b")[0], tmp_path, change, error, field)


# ---------------------------------------------------------------- GGUF


def write_gguf(path: Path, ref, folder: Path, qtype: Q) -> tuple[dict, int]:
    """`ref` as llama.cpp's Gemma3NModel writes it: Gemma3Model's keys plus altup / per-layer
    / KV-sharing / sparsity keys; tensors named by gguf-py's TensorNameMap, `*_scale` with
    `.weight` added, the three altup projections of each kind stacked, both embeddings padded
    with zero rows to the vocabulary, tied head omitted, the unused K/V of KV-shared layers
    kept (hub checkpoints carry them); matrices whose rows fit Q8_0 blocks in `qtype`, the rest
    F32. Returns the state dict the file holds (gguf-py's dequantization) and
    its per-layer table's rows."""
    cfg = ref.config
    n, vocab = cfg.num_hidden_layers, cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "gemma3n")
    w.add_block_count(n)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(list(cfg.intermediate_size))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters[F]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters[S]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_altup_active_idx(cfg.altup_active_idx)
    w.add_altup_num_inputs(cfg.altup_num_inputs)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    icdf = torch.distributions.normal.Normal(0, 1).icdf
    w.add_activation_sparsity_scale(
        [icdf(torch.tensor(p, dtype=torch.float32)).item() for p in cfg.activation_sparsity_pattern]
    )
    w.add_sliding_window_pattern([t == S for t in cfg.layer_types])
    add_bpe_tokenizer(w, folder, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3N, n)
    sd = {k: t.detach().float().numpy() for k, t in ref.state_dict().items()}
    tensors, held = {}, {}
    for kind, gname in (
        ("altup_projections", "altup_proj"),
        ("altup_unembed_projections", "altup_unembd_proj"),
    ):
        parts = [sd.pop(f"model.{kind}.{k}.weight") for k in range(cfg.altup_num_inputs - 1)]
        tensors[f"{gname}.weight"] = (
            np.stack(parts),
            [f"model.{kind}.{k}.weight" for k in range(len(parts))],
        )
    sd.pop("lm_head.weight")
    rng = np.random.default_rng(0)  # hub checkpoints keep unused K/V on KV-shared layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    for i in range(n - cfg.num_kv_shared_layers, n):
        for name, shape in (("k_proj", (kv, cfg.hidden_size)), ("v_proj", (kv, cfg.hidden_size))):
            tensors[f"blk.{i}.attn_{name[0]}.weight"] = (rng.standard_normal(shape), [])
        tensors[f"blk.{i}.attn_k_norm.weight"] = (rng.standard_normal(cfg.head_dim), [])
    for hf, a in sd.items():
        if "embed_tokens" in hf and a.shape[0] < vocab:
            a = np.concatenate([a, np.zeros((vocab - a.shape[0], a.shape[1]), a.dtype)])
        stem, part = hf.rsplit(".", 1) if hf.endswith(".weight") else (hf, "weight")
        tensors[f"{names.get_name(stem)}.{part}"] = (a, [hf])
    for name, (a, sources) in tensors.items():
        q = qtype if a.ndim > 1 and a.shape[-1] % 32 == 0 else Q.F32
        data = a if q == Q.F32 else gguf.quants.quantize(a, q)
        floats = a if q == Q.F32 else gguf.quants.dequantize(data, q).reshape(a.shape)
        w.add_tensor(name, data, raw_dtype=None if q == Q.F32 else q)
        for k, hf in enumerate(sources):
            held[hf] = floats[k] if len(sources) > 1 else floats
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()}, vocab


@pytest.mark.parametrize("qtype,dequantize", [(Q.F32, None), (Q.Q8_0, False), (Q.Q8_0, None)])
def test_gguf_matches_transformers_on_the_files_weights(gemma3n, tmp_path, qtype, dequantize):
    """Reference parity on the GGUF path (Q8_0 kept, and the CPU default dense): transformers
    on the weights gguf-py dequantizes from the very file (its per-layer table the padded one
    the file holds), 72 tokens, float32, bound 1e-4: the keys, the stacked projections split,
    `.weight` on the output scale, the Φ⁻¹ values (−∞: dense), llama.cpp's KV-sharing rule.
    The F32 file also equals the folder of the same model on ids the table holds."""
    folder, ref = gemma3n("e2b")
    path = tmp_path / "m.gguf"
    held, rows = write_gguf(path, ref, folder, qtype)
    twin_cfg = ref.config.__class__.from_dict(
        {**ref.config.to_dict(), "vocab_size_per_layer_input": rows}
    )
    twin_cfg._attn_implementation = "eager"
    twin = ref.__class__(twin_cfg).eval()
    twin.load_state_dict(held, strict=False)
    twin.tie_weights()
    model = mlxlis.load(path, "float32", dequantize=dequantize)
    assert model.config.family == "gemma3n"
    assert (
        model.config.family_config.sparsity_std
        == mlxlis.load(folder, "float32").config.family_config.sparsity_std
    )
    ids = trajectory(72, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(twin, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    if qtype == Q.F32:
        low = [t % 300 for t in ids]
        a = np.array(model.logits(low))
        assert np.abs(a - np.array(mlxlis.load(folder, "float32").logits(low))).max() < 1e-5


def test_an_audio_part_is_refused_not_rendered_as_silence(gemma3n, tmp_path):
    """A checkpoint whose audio tower is skipped, under an official template that writes an
    audio marker for an audio part (Gemma 4's, llama.cpp's copy): the part is refused naming
    it — through encode_chat, render_chat and ChatSession — instead of its marker reaching the
    prompt while nothing hears it (the template does write the marker: checked first)."""
    from conftest import llama_cpp_reference

    template = llama_cpp_reference("templates/google-gemma-4-31B-it.jinja")
    folder, _ = gemma3n(next(iter(SPECS)))
    model = mlxlis.load(
        wrapped(folder, tmp_path / "wrapped"), "float32", chat_template=str(template)
    )
    assert any(s.startswith("model.audio_tower") for s in model.skipped)
    heard = [{"type": "text", "text": "What is said?"}, {"type": "audio", "audio": b"RIFF"}]
    messages = [{"role": "user", "content": heard}]
    assert "<|audio|>" in model.template.render(messages, add_generation_prompt=True)
    for call in (model.encode_chat, model.render_chat):
        with pytest.raises(UnsupportedError, match="audio tower is not loaded") as e:
            call(messages)
        assert e.value.field == "messages[0].content[1].type"
    chat = mlxlis.ChatSession(model)
    with pytest.raises(UnsupportedError, match="cannot hear this audio part"):
        list(chat.send(heard))
