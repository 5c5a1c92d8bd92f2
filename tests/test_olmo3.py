"""OLMo 3 against transformers, llama.cpp's converter, mlx-lm and itself.

Reference parity: a tiny random `olmo3` checkpoint written by transformers' save_pretrained
(3 query heads on 1 KV head, a sliding window of 16 on layers 0, 1, 3 and full attention on
layer 2, YaRN on the full layer only, an untied head) against its float32 forward over 72
tokens; a copy whose sliding layers state another RoPE θ (transformers 5's per-type
rope_parameters) against transformers run on that very copy. GGUF: the folder converted by
llama.cpp's own convert_hf_to_gguf.py (its Olmo2Model; tests/llama_cpp_convert.py) gives the
folder's logits. MLX-quantized: mlx-lm's 4-bit conversion against transformers on the weights
dequantized from that very folder. `convert` writes what mlx-lm's olmo3 reads: its logits on the
converted folder are ours. Self-consistency past the window: chunked prefill ≡ decode ≡ full
forward, batched decode ≡ each alone, greedy prompt-lookup speculation ≡ plain greedy.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlxlis
from mlxlis.generation.speculative import Speculation

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    check_config_refused,
    dequantized_folder,
    greedy_tokens,
    tiny_models,
    trajectory,
)
from llama_cpp_convert import convert as llama_cpp_convert

SLIDING, FULL = "sliding_attention", "full_attention"
THETA = 20000.0
SPECS = {
    "olmo3": dict(
        kind="olmo3",
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=512,
        sliding_window=16,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING],
        tie_word_embeddings=False,
        rope_parameters={
            FULL: {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": THETA,
            },
            SLIDING: {"rope_type": "default", "rope_theta": THETA},
        },
    ),
}
BOUND = 2e-5  # float32 against transformers; measured 3.4e-6


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    get = tiny_models(tmp_path_factory, SPECS, lambda f, s: build_tiny(f, s, pad_token_id=1))
    return lambda: get("olmo3")


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def edited(folder, dest, **changes):
    """A copy of the checkpoint `folder` with `changes` merged into config.json."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


def local_theta_copy(folder, dest):
    """A copy whose sliding layers turn by θ 5000 (the full layer keeps YaRN over θ 2e4)."""
    params = json.loads((folder / "config.json").read_text())["rope_parameters"]
    params[SLIDING]["rope_theta"] = 5000.0
    return edited(folder, dest, rope_parameters=params)


def test_logits_match_transformers_fp32(olmo, tmp_path):
    """Reference parity over 72 tokens (4× the window) within 2e-5: post-norm blocks, q/k norms
    over the whole projection, the window on the layers layer_types names, YaRN on the full
    layer only; and the window bites (the same weights without it move the logits)."""
    folder, ref = olmo()
    model = mlxlis.load(folder, "float32")
    c = model.config
    assert c.family == "olmo3" and not c.tie_word_embeddings
    assert c.layer_types == (SLIDING, SLIDING, FULL, SLIDING) and c.attention.sliding_window == 16
    assert c.rope.type == "yarn" and c.attention.rope_local.type == "default"
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0
    unwindowed = mlxlis.load(edited(folder, tmp_path / "wide", sliding_window=512), "float32")
    assert np.abs(np.array(unwindowed.logits(ids)) - ours)[20:].max() > 1e-2


def test_sliding_layers_keep_their_own_rope(olmo, tmp_path):
    """transformers 5 states RoPE per layer type: a copy whose sliding layers turn by θ 5000
    (the full layer keeps YaRN over θ 2e4) matches transformers run on that copy (measured
    3.7e-6; bound 2e-5)."""
    import transformers

    folder, ref = olmo()
    copy = local_theta_copy(folder, tmp_path / "local")
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        copy, attn_implementation="eager"
    ).eval()
    model = mlxlis.load(copy, "float32")
    assert model.config.attention.rope_local.theta == 5000.0
    ids = trajectory(48, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    assert np.abs(ours - reference_logits(theirs_model, ids)).max() < BOUND
    assert np.abs(ours - reference_logits(ref, ids)).max() > 1e-2  # θ mattered


def test_cached_decode_batches_and_speculation_past_the_window(olmo):
    """Self-consistency past the window (16): a chunked prefill (9, 11) then token-by-token
    decode equals the full forward; two sequences at different offsets decoded together
    equal each alone; greedy prompt-lookup speculation gives the plain greedy tokens."""
    model = mlxlis.load(olmo()[0], "float32")
    ids = trajectory(48, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 35, 1e-4)
    prompt = (trajectory(12, seed=3, vocab=model.config.vocab_size) * 4)[:40]
    plain, _ = greedy_tokens(model, prompt, 30)
    got, seq = greedy_tokens(model, prompt, 30, Speculation("ngram", tokens=4))
    assert got == plain and len(plain) == 30
    assert seq.usage.draft_tokens > 0


def test_gguf_from_llama_cpp_converter_equals_the_folder(olmo, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (arch olmo2: Q/K rows as they are, post_attention_norm
    / post_ffw_norm, the window pattern, rope.freq_base_swa) at f32, on the copy whose sliding
    layers have their own θ: the GGUF loads with the folder's structure and gives the folder's
    logits (measured equal; bound 1e-6)."""
    folder = local_theta_copy(olmo()[0], tmp_path / "local")
    path = llama_cpp_convert(folder, tmp_path / "olmo3.gguf")
    model = mlxlis.load(path, "float32")
    src = mlxlis.load(folder, "float32")
    c, s = model.config, src.config
    assert c.family == "olmo3" and not c.tie_word_embeddings
    assert c.layer_types == s.layer_types and c.attention.sliding_window == 16
    assert c.rope == s.rope and c.attention.rope_local == s.attention.rope_local
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(model.logits(ids)) - np.array(src.logits(ids))).max() < 1e-6


def test_mlx_quantized_folder_matches_its_dequantized_weights(olmo, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32) loads as it is, and gives the logits of
    transformers on the weights dequantized from its files (float32; measured 2.9e-6)."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = olmo()
    classic = edited(folder, tmp_path / "classic", rope_theta=THETA)  # mlx-lm requires it
    out = tmp_path / "q4"
    mlx_lm_convert(
        str(classic), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32"
    )
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    dense = {k: torch.from_numpy(w) for k, w in dequantized_folder(out).items()}
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(dense)
    ids = trajectory(48, vocab=model.config.vocab_size)
    delta = np.abs(np.array(model.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads(olmo, tmp_path):
    """`convert`'s folder: mlx-lm's olmo3 gives our logits on it (measured 2.6e-6; bound 2e-5;
    classic rope_theta / rope_scaling beside the per-type rope_parameters), and it reloads to the
    same config and bit-identical logits; `inspect` says the block in words."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report

    from mlx_lm import load as mlx_lm_load

    folder, _ = olmo()
    src = mlxlis.load(folder, "float32")
    ids = trajectory(48, vocab=src.config.vocab_size)
    ours = np.array(src.logits(ids))
    out = convert(folder, tmp_path / "out", dtype="float32")
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - theirs).max() < BOUND
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    assert again.config == src.config.with_(
        source=again.config.source,
        special=replace(src.config.special, eos=again.config.special.eos),
    )
    text = format_report(model_report(src))
    assert "post-norm" in text and "sliding window 16 in 3 of 4 layers" in text


def test_classic_keys_and_derived_layer_types(olmo, tmp_path):
    """A hub-style config.json (rope_theta and rope_scaling, no rope_parameters) reads as the
    folder's config: θ on both layer types, the scaling on the full layers only (mlx-lm's and
    llama.cpp's reading; transformers 5.25 gives its sliding layers 5e5 instead). Without
    layer_types, the layers are Olmo3Config's own: three sliding, then one full."""
    import transformers

    folder, _ = olmo()
    cfg = json.loads((folder / "config.json").read_text())
    full = dict(cfg["rope_parameters"][FULL])
    classic = {"rope_theta": full.pop("rope_theta"), "rope_scaling": full}
    copy = edited(folder, tmp_path / "classic", rope_parameters=None, **classic)
    src = mlxlis.load(folder, "float32").config
    assert mlxlis.load(copy, "float32").config == src.with_(source=str(copy / "config.json"))
    del cfg["layer_types"]
    derived = tmp_path / "derived"
    shutil.copytree(folder, derived)
    (derived / "config.json").write_text(json.dumps(cfg))
    want = transformers.AutoConfig.from_pretrained(derived).layer_types
    assert list(mlxlis.load(derived, "float32").config.layer_types) == want
    assert want == [SLIDING, SLIDING, SLIDING, FULL]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": [SLIDING, "chunked_attention", FULL, SLIDING]}, "layer_types"),
        ({"layer_types": [SLIDING, FULL]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        (
            {"rope_parameters": {FULL: {"rope_type": "dynamic", "factor": 2.0}}},
            "rope_parameters.full_attention",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(olmo, tmp_path, change, field):
    """An unknown or miscounted layer type, a window of 0, an unimplemented RoPE type: an
    MlxlisError naming config.json and the field, never a model built on a guess."""
    from mlxlis.errors import MlxlisError

    check_config_refused(olmo()[0], tmp_path, change, MlxlisError, field)
