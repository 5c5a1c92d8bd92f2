"""Gemma 1 / 2 / 3 forward pass against transformers (reference parity) and against itself.

Reference parity: tiny random checkpoints built with transformers' own Gemma classes (eager
attention, fp32), written by save_pretrained (transformers-5 keys), compared with transformers'
forward as logits along one fixed trajectory, at 64 tokens: more than 3 × the
sliding window of 8, so every sliding layer clips (short prompts hide window bugs).
Self-consistency (proves only that our paths agree): token-by-token decode and chunked
prefill through KVCache / RotatingKVCache against our own full forward, at the same length.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlxlis
from mlxlis.cache import KVCache, RotatingKVCache, trimmable, window_mask
from mlxlis.errors import MissingTensorError
from mlxlis.models import config_from_hf
from mlxlis.models.config import read_json

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import build_tiny, randomize, trajectory

WINDOW = 8
N = 64  # > 3 × WINDOW and ≥ 40
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
SPECS = {
    # MQA, tanh GELU, non-default θ
    "gemma": dict(
        COMMON,
        num_hidden_layers=2,
        num_key_value_heads=1,
        hidden_act="gelu_pytorch_tanh",
        rope_theta=20000.0,
    ),
    # alternating sliding/full (the classic pattern), both softcaps biting, exact GELU,
    # query_pre_attn_scalar ≠ head_dim
    "gemma2": dict(
        COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        hidden_activation="gelu",
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    # q/k norms, mixed layer_types, local θ for sliding layers, global θ + linear scaling
    "gemma3": dict(
        COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 200000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
    ),
}
NAMES = list(SPECS)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """tiny_gemma(name) -> (folder, transformers model); built once per module."""
    built: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            # norms 1 + N(0, 0.1) (conftest.randomize): x̂·(1 + w) ≈ 2x̂, so the +1 matters
            spec = {"kind": name, "pad_token_id": 0, **SPECS[name]}
            built[name] = (folder, build_tiny(folder, spec))
        return built[name]

    return get


def load_net(folder: Path, dtype=mx.float32):
    return mlxlis.load(folder, dtype).net


def ours(net, ids: list[int]) -> np.ndarray:
    return np.array(net(mx.array([ids]))[0].astype(mx.float32))


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_fp32(tiny_gemma, name):
    """Reference parity past the window: full-forward logits equal transformers' within 2e-4 at
    64 tokens (8 × the sliding window): (1 + w) norms, √hidden embedding scale, GeGLU, tied
    head, sandwich norms, both softcaps, query_pre_attn_scalar, q/k norms, local/global RoPE.
    Measured on the CPU: 4.6e-6 (Gemma), 6.0e-6 (Gemma 2), 2.0e-5 (Gemma 3); the bound is 10x
    the largest."""
    folder, ref = tiny_gemma(name)
    net = load_net(folder)
    ids = trajectory(N, vocab=net.config.vocab_size)
    a, b = ours(net, ids), reference_logits(ref, ids)
    assert a.shape == b.shape
    delta = np.abs(a - b).max()
    assert delta < 2e-4, f"max |Δ| = {delta}"
    assert np.abs(b).max() > 1.0  # the logits are not trivially flat


@pytest.mark.parametrize("name", NAMES)
def test_cache_paths_equal_full_forward(tiny_gemma, name):
    """Self-consistency at 64 tokens: token-by-token decode, chunked prefill (3, 8, 13 — chunks
    straddling the window) and decode after a chunked prefill all give the full forward's
    logits; last_only gives the last row. The decode is also checked against transformers'
    logits, so the rotating cache is reference-exact past the window too. (Measured: cache
    paths 4.7e-6 to 1.9e-5 from the full forward, bound 1e-4; decode vs transformers as the
    full forward, bound 2e-4.)"""
    folder, ref = tiny_gemma(name)
    net = load_net(folder)
    ids = trajectory(N, vocab=net.config.vocab_size)
    full = ours(net, ids)
    cache = net.make_cache()
    if name != "gemma":
        assert any(isinstance(c, RotatingKVCache) for c in cache)
        assert any(isinstance(c, KVCache) for c in cache)
    steps = np.stack([np.array(net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids])
    assert np.abs(steps - full).max() < 1e-4
    assert np.abs(steps - reference_logits(ref, ids)).max() < 2e-4
    for c in cache:  # memory stays bounded by the window on sliding layers
        if isinstance(c, RotatingKVCache):
            assert c.keys.shape[2] == WINDOW
    for chunk in (3, 8, 13):
        cache = net.make_cache()
        outs = [
            np.array(net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 1e-4, chunk
    cache = net.make_cache()
    outs = [np.array(net(mx.array([ids[s : s + 13]]), cache=cache)[0]) for s in range(0, 39, 13)]
    outs += [np.array(net(mx.array([[t]]), cache=cache, last_only=True)[0]) for t in ids[39:]]
    assert np.abs(np.concatenate(outs) - full).max() < 1e-4
    last = np.array(net(mx.array([ids]), last_only=True)[0])
    assert last.shape == (1, full.shape[1]) and np.abs(last[0] - full[-1]).max() < 1e-5


def test_window_mask_matches_transformers_rule():
    """Reference parity of the mask: window_mask equals transformers' own sliding-window causal
    mask (query p sees keys in (p − window, p]) for a square block and for a chunk whose
    queries start at an offset into a longer key range."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    theirs = sdpa_mask(
        batch_size=1,
        q_length=20,
        kv_length=20,
        mask_function=sliding_window_causal_mask_function(WINDOW),
        allow_is_causal_skip=False,
    )[0, 0].numpy()
    assert (np.array(window_mask(0, 20, 0, 20, WINDOW)) == theirs).all()
    mine = np.array(window_mask(15, 5, 8, 12, WINDOW))  # queries 15..19, keys 8..19
    assert (mine == theirs[15:20, 8:20]).all()


def test_rotating_cache_trim_and_memory(tiny_gemma):
    """Self-consistency of RotatingKVCache.trim: exact while nothing has rotated out; once it
    has, only one position can be trimmed, a larger trim returns 0 and leaves the cache as it
    was; decoding on after an allowed trim still equals the full forward."""
    folder, _ = tiny_gemma("gemma3")
    net = load_net(folder)
    ids = trajectory(40, vocab=net.config.vocab_size)
    full = ours(net, ids)

    cache = net.make_cache()
    net(mx.array([ids[:6]]), cache=cache)  # shorter than the window: trimming is exact
    assert trimmable(cache) == 6 and all(c.trim(2) == 2 for c in cache)
    outs = [np.array(net(mx.array([[t]]), cache=cache)[0]) for t in ids[4:20]]
    assert np.abs(np.concatenate(outs) - full[4:20]).max() < 1e-4

    cache = net.make_cache()
    net(mx.array([ids[:30]]), cache=cache)  # 30 > window: positions have rotated out
    assert trimmable(cache) == 1
    sliding = [c for c in cache if isinstance(c, RotatingKVCache)]
    assert all(c.trim(3) == 0 and c.offset == 30 for c in sliding)
    assert all(c.trim(1) == 1 for c in cache)
    outs = [np.array(net(mx.array([[t]]), cache=cache)[0]) for t in ids[29:]]
    assert np.abs(np.concatenate(outs) - full[29:]).max() < 1e-4
    assert all(c.keys.shape[2] == WINDOW for c in sliding)


def test_gemma3_classic_keys_parse_like_transformers5(tiny_gemma):
    """A hub-style Gemma 3 config (rope_theta, rope_local_base_freq, rope_scaling linear,
    sliding_window_pattern instead of layer_types) gives the same ModelConfig rope, window and
    layer fields as the transformers-5 form (rope_parameters per layer type, layer_types)."""
    folder, _ = tiny_gemma("gemma3")
    t5 = read_json(folder / "config.json")
    assert "full_attention" in t5["rope_parameters"] and "rope_theta" not in t5
    classic = {k: v for k, v in t5.items() if k not in ("rope_parameters", "layer_types")}
    classic.update(
        rope_theta=200000.0,
        rope_local_base_freq=5000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=2,
        num_hidden_layers=4,
    )
    a, b = config_from_hf(t5), config_from_hf(classic)
    assert a.rope == b.rope and a.rope.type == "linear" and a.rope.factor == 4.0
    assert a.rope.theta == 200000.0 and a.attention.rope_local == b.attention.rope_local
    local = a.attention.rope_local
    assert local.theta == 5000.0 and local.type == "default"
    assert b.layer_types == ("sliding_attention", "full_attention") * 2
    assert a.attention.sliding_window == b.attention.sliding_window == WINDOW
    # defaults when the keys are absent, as transformers' Gemma3TextConfig has them
    bare = {
        k: v
        for k, v in classic.items()
        if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")
    }
    c = config_from_hf(bare)
    assert (c.rope.theta, c.attention.rope_local.theta) == (1e6, 1e4)
    assert c.layer_types.count("full_attention") == 0  # 4 layers: the 6th would be global


@pytest.mark.parametrize("name", NAMES)
def test_float16_close_to_float32(tiny_gemma, name):
    """float16 weights/activations stay near float32: finite; wherever the fp32 top-2 gap
    exceeds 0.05 the fp16 top-1 agrees; max |Δ| < 0.1 (|logit| ≲ 7) and within 1.5× (+0.01)
    of transformers' own float16-vs-float32 difference on the same weights."""
    import copy

    folder, ref = tiny_gemma(name)
    ids = trajectory(N, vocab=400)
    f32 = ours(load_net(folder, mx.float32), ids)
    f16 = ours(load_net(folder, mx.float16), ids)
    assert np.isfinite(f16).all()
    top2 = np.sort(f32, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert (f32.argmax(-1)[clear] == f16.argmax(-1)[clear]).all()
    delta = np.abs(f16 - f32).max()
    theirs = np.abs(
        reference_logits(copy.deepcopy(ref).half(), ids) - reference_logits(ref, ids)
    ).max()
    assert delta < 0.1 and delta < 1.5 * theirs + 0.01, (delta, theirs)


def test_float16_residual_past_fp16_range(tiny_gemma, tmp_path):
    """The float32 residual stream: with post-sublayer norm weights scaled up so the residual
    (measured in fp32) exceeds float16's 65 504 while every sublayer output stays inside it,
    our float16 logits stay finite and agree with float32 (a float16 residual would be inf)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, _ = tiny_gemma("gemma3")
    big = tmp_path / "big"
    shutil.copytree(folder, big)
    weights = load_file(big / "model.safetensors")
    for k in weights:
        if "post_feedforward_layernorm" in k or "post_attention_layernorm" in k:
            weights[k] = (weights[k] * 0 + 7000.0).astype(weights[k].dtype)
    save_file(weights, big / "model.safetensors", metadata={"format": "pt"})
    ids = trajectory(N, vocab=400)
    net32 = load_net(big, mx.float32)
    h = net32.model.embed_tokens(mx.array([ids])) * (64**0.5)
    peak = sub_peak = 0.0
    for i, layer in enumerate(net32.model.layers):  # residual and sublayer outputs, in fp32
        mask = window_mask(0, N, 0, N, WINDOW) if net32.config.is_sliding(i) else "causal"
        a = layer.post_attention_layernorm(layer.self_attn(layer.input_layernorm(h), mask, None))
        h = h + a
        f = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        h = h + f
        peak = max(peak, float(mx.abs(h).max()))
        sub_peak = max(sub_peak, float(mx.abs(a).max()), float(mx.abs(f).max()))
    assert sub_peak < 65504 < peak, (sub_peak, peak)
    f32 = ours(net32, ids)
    f16 = ours(load_net(big, mx.float16), ids)
    assert np.isfinite(f16).all()
    top2 = np.sort(f32, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert (f32.argmax(-1)[clear] == f16.argmax(-1)[clear]).all()


def test_multimodal_gemma3_checkpoint_names(tiny_gemma, tmp_path):
    """Reference parity for a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration,
    config.json with a text_config, tensors under model.language_model.* plus a vision tower):
    Model.sanitize keeps the language model's tensors under our names and drops the vision
    ones, and the text logits equal transformers' for a text-only trajectory."""
    import shutil

    import transformers as tf

    folder, _ = tiny_gemma("gemma3")
    text = tf.Gemma3TextConfig(
        **{
            k: v
            for k, v in read_json(folder / "config.json").items()
            if k not in ("architectures", "transformers_version", "model_type", "dtype")
        }
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = tf.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=5,
        boi_token_index=6,
        eoi_token_index=7,
    )
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = tf.Gemma3ForConditionalGeneration(cfg).eval()
    randomize(ref, 3)
    ref.tie_weights()
    mm = tmp_path / "mm"
    ref.save_pretrained(mm)
    for tok_file in folder.glob("tokenizer*"):
        shutil.copy(tok_file, mm / tok_file.name)
    assert "text_config" in json.loads((mm / "config.json").read_text())
    try:
        net = load_net(mm)
    except MissingTensorError as e:
        pytest.fail(f"the loader must pass the tensors through net.sanitize before binding: {e}")
    assert net.config.family == "gemma3" and net.config.attention.sliding_window == WINDOW
    ids = trajectory(N, vocab=net.config.vocab_size)
    delta = np.abs(ours(net, ids) - reference_logits(ref, ids)).max()
    assert delta < 2e-4, f"max |Δ| = {delta}"  # measured 1.8e-5
