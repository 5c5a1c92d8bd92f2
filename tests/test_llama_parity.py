"""Llama / Qwen2 forward pass against transformers (reference parity) and against itself.

Reference parity: tiny random checkpoints written by transformers' save_pretrained, compared
with transformers' own forward in fp32 as logits along one fixed trajectory.
Self-consistency: the KV-cache paths against our own full forward.
"""

from __future__ import annotations

import mlxlis

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import trajectory

NAMES = ["llama", "llama3_tied", "qwen2"]


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_fp32(tiny, name):
    """Reference parity: our full-forward logits equal transformers' within 3e-5 over 80 tokens
    (GQA, untied/tied head, llama3 RoPE scaling, q/k/v bias, transformers-5 rope_parameters).
    Measured on the CPU: 1.5e-6 to 2.0e-6; the bound is 15x that."""
    folder, ref = tiny(name)
    model = mlxlis.load(folder, "float32")
    ids = trajectory(80, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    theirs = reference_logits(ref, ids)
    assert ours.shape == theirs.shape
    delta = np.abs(ours - theirs).max()
    assert delta < 3e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0  # the logits are not trivially flat


def test_transformers5_rope_base_is_read(tiny):
    """The transformers-5 config (rope_parameters, no rope_theta key) gives θ = 100 000, not the
    10 000 default that a reader of classic keys falls back to; the wrong base moves logits."""
    folder, ref = tiny("llama")
    import json

    cfg = json.loads((folder / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 100000.0
    model = mlxlis.load(folder, "float32")
    assert model.config.rope.theta == 100000.0


@pytest.mark.parametrize("name", NAMES)
def test_cached_decode_equals_full_forward(tiny, name):
    """Self-consistency: token-by-token decode with the KV cache (crossing the 256-slot growth
    step) and chunked prefill (3, 8, 13) give the full forward's logits (measured max |Δ|
    2.1e-6; bound 3e-5)."""
    folder, _ = tiny(name)
    model = mlxlis.load(folder, "float32")
    ids = trajectory(300, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(model.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 3e-5
    for chunk in (3, 8, 13):
        cache = model.make_cache()
        outs = []
        for s in range(0, len(ids), chunk):
            outs.append(np.array(model.net(mx.array([ids[s : s + chunk]]), cache=cache)[0]))
        assert np.abs(np.concatenate(outs) - full).max() < 3e-5, chunk


@pytest.mark.parametrize("name", NAMES)
def test_float16_close_to_float32(tiny, name):
    """float16 weights/activations stay near float32: wherever the fp32 top-2 gap exceeds 0.05
    the fp16 top-1 agrees, and max |Δ| stays below 0.05 on these logits (|logit| ≲ 4; measured
    0.0037 to 0.0044, so the bound is 11-13x)."""
    folder, _ = tiny(name)
    ids = trajectory(80, vocab=400)
    f32 = np.array(mlxlis.load(folder, "float32").logits(ids))
    f16 = np.array(mlxlis.load(folder, "float16").logits(ids))
    assert np.isfinite(f16).all()
    top2 = np.sort(f32, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert (f32.argmax(-1)[clear] == f16.argmax(-1)[clear]).all()
    delta = np.abs(f16 - f32).max()
    assert delta < 0.05, f"fp16 max |Δ| = {delta}"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_logits_match_mlx_lm(tiny, name, tmp_path):
    """Second, independent reference: mlx-lm's implementation on the same weights agrees.
    mlx-lm reads only classic config keys, so it gets a copy with rope_theta spelled out.
    Measured max |Δ| 1.1e-6 to 1.4e-6; bound 2e-5."""
    import json
    import shutil

    from mlx_lm import load as mlx_lm_load

    folder, _ = tiny(name)
    copy = tmp_path / "classic"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (copy / "config.json").write_text(json.dumps(cfg))
    their_model, _ = mlx_lm_load(str(copy))
    ids = trajectory(72, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    assert np.abs(ours - theirs).max() < 2e-5


def test_greedy_generation_follows_argmax(tiny):
    """Self-consistency of the pipelined generator: each greedy token is the argmax of the full
    forward's logits over prompt + previous tokens, and max_tokens is honoured."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    prompt = trajectory(20, vocab=model.config.vocab_size)
    events = list(mlxlis.generate(model, prompt, max_tokens=12, temperature=0.0, stop_ids=set()))
    tokens = [e.token for e in events if e.token is not None]
    assert len(tokens) == 12 and events[-1].finish_reason == "length"
    full = np.array(model.logits(prompt + tokens))
    expected = full[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert tokens == expected
    assert events[-1].stats.generated_tokens == 12 and events[-1].stats.prompt_tokens == 20


def test_generation_stops_on_eos(tiny):
    """The generator stops at the first stop id and does not emit it."""
    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    prompt = trajectory(10, vocab=model.config.vocab_size)
    free = [
        e.token
        for e in mlxlis.generate(model, prompt, max_tokens=8, stop_ids=set())
        if e.token is not None
    ]
    stop_at = free[3]
    events = list(mlxlis.generate(model, prompt, max_tokens=8, stop_ids={stop_at}))
    got = [e.token for e in events if e.token is not None]
    assert stop_at not in got and got == free[: free.index(stop_at)]
    assert events[-1].finish_reason == "stop"
