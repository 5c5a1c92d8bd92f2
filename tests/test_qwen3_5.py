"""Qwen3.5 (hybrid Gated DeltaNet + gated attention), dense and MoE, against transformers and
mlx-lm.

Reference parity: tiny random checkpoints written by transformers' save_pretrained, several
layer-type patterns (the default every-4th-layer-full, an explicit alternation), DeltaNet with
more value heads than key heads and k_dim ≠ v_dim, partial RoPE, tied and untied heads, the MoE
with a shared expert; compared with transformers' float32 forward over 72 tokens (it runs the
chunked delta rule, 64-token chunks, so the sequence crosses a chunk border) and with mlx-lm on
the same weights, full precision and mlx-lm's own 4-bit conversion (whose saved tensors carry
mlx-lm's conventions: conv1d kernel axis last, norms + 1). Self-consistency: chunked prefill
(any chunk size) ≡ one-step decode ≡ full forward; a chat whose later turn reuses the prefix
(the recurrent state restored from its snapshot at the end of the earlier prompt) gives exactly
the tokens of a fresh run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlxlis

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import build_tiny, tiny_models, trajectory

COMMON = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
SPECS = {
    # layers L L L F (every 4th full), 4 value heads over 2 key heads, v_dim 24 ≠ k_dim 16
    "qwen3_5": dict(
        kind="qwen3_5_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        linear_num_value_heads=4,
        linear_value_head_dim=24,
        tie_word_embeddings=False,
        **COMMON,
    ),
    # explicit alternation F L F L L, one value head per key head, tied
    "qwen3_5_alt": dict(
        kind="qwen3_5_text",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        linear_num_value_heads=2,
        linear_value_head_dim=16,
        layer_types=[
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
        ],
        tie_word_embeddings=True,
        **COMMON,
    ),
    # MoE: top-2 of 8 routed experts plus a shared expert, layers L L L F
    "qwen3_5_moe": dict(
        kind="qwen3_5_moe_text",
        hidden_size=64,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        linear_num_value_heads=4,
        linear_value_head_dim=24,
        tie_word_embeddings=False,
        **COMMON,
    ),
}
NAMES = list(SPECS)


def realistic(model) -> None:
    """randomize(), then what real checkpoints look like where it matters: zero-centred norm
    weights near 0 (x̂·(1 + w)), decays A = exp(A_log) in [0.5, 4.5], dt_bias around 0."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name and "linear_attn.norm" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build(folder: Path, spec: dict):
    return build_tiny(folder, spec, adjust=realistic)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_fp32(qwen35, name):
    """Reference parity over 72 tokens within 1e-4 (measured 1.2e-5 to 3.5e-5; the DeltaNet
    state sums over the whole sequence, so rounding grows with it: our own step and chunked
    forms differ by the same order, 1e-5)."""
    folder, ref = qwen35(name)
    model = mlxlis.load(folder, "float32")
    assert model.config.family == ("qwen3_5_moe" if "moe" in name else "qwen3_5")
    assert model.config.layer_types == tuple(ref.config.layer_types)
    ids = trajectory(72, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


def test_multimodal_wrapper_reads_the_language_model(qwen35, tmp_path):
    """A Qwen3_5ForConditionalGeneration-style folder (text_config, tie flag outside it,
    model.language_model.* names, a vision tower and an mtp head) loads the language model and
    skips the rest, saying so: the same logits as the text-only folder."""
    from safetensors.numpy import load_file, save_file

    folder, _ = qwen35("qwen3_5_alt")
    wrapped = tmp_path / "wrapped"
    shutil.copytree(folder, wrapped)
    text = json.loads((folder / "config.json").read_text())
    tie = text.pop("tie_word_embeddings")
    (wrapped / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_5",
                "tie_word_embeddings": tie,
                "text_config": {**text, "model_type": "qwen3_5_text"},
                "vision_config": {"depth": 1},
            }
        )
    )
    tensors = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, str(wrapped / "model.safetensors"), {"format": "pt"})
    ids = trajectory(40, vocab=400)
    a = np.array(mlxlis.load(folder, "float32").logits(ids))
    model = mlxlis.load(wrapped, "float32")
    assert np.array_equal(a, np.array(model.logits(ids)))
    assert model.skipped == ["model.visual.patch_embed.proj.weight", "mtp.fc.weight"]
    said = model.describe()["skipped"]  # what --verbose, inspect and the app show
    assert "2 tensors not used" in said and "model.visual.*" in said and "mtp.fc.*" in said


def fuse_experts(folder: Path) -> None:
    """Rewrite per-expert tensors (what transformers' save_pretrained writes) in the fused layout
    Qwen3.5-MoE checkpoints ship: experts.gate_up_proj (E, 2·F, hidden), experts.down_proj."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    layers = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for prefix in layers:
        n = sum(1 for k in tensors if k.startswith(f"{prefix}.experts.") and "down" in k)
        gate, up, down = (
            np.stack([tensors.pop(f"{prefix}.experts.{e}.{p}.weight") for e in range(n)])
            for p in ("gate_proj", "up_proj", "down_proj")
        )
        tensors[f"{prefix}.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        tensors[f"{prefix}.experts.down_proj"] = down
    save_file(tensors, str(path), {"format": "pt"})


def mlx_lm_copy(folder: Path, dest: Path) -> Path:
    """mlx-lm knows the wrapper model types only (qwen3_5, qwen3_5_moe), under which it reads a
    text-only config, and the fused expert layout only."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["model_type"] = cfg["model_type"].removesuffix("_text")
    (dest / "config.json").write_text(json.dumps(cfg))
    if "num_experts" in cfg:
        fuse_experts(dest)
    return dest


def test_fused_experts_load_like_per_expert(qwen35, tmp_path):
    """The fused expert layout (gate_up_proj sliced into gate and up, down_proj as it is) gives
    exactly the logits of the per-expert layout of the same weights."""
    folder, _ = qwen35("qwen3_5_moe")
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    fuse_experts(fused)
    ids = trajectory(40, vocab=400)
    a = np.array(mlxlis.load(folder, "float32").logits(ids))
    b = np.array(mlxlis.load(fused, "float32").logits(ids))
    assert np.array_equal(a, b)


# mlx-lm 0.32 places full-attention layers by full_attention_interval only (it ignores
# layer_types), so the explicit alternation is compared with transformers alone
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_logits_match_mlx_lm(qwen35, name, tmp_path):
    """Second, independent reference: mlx-lm's qwen3_5 / qwen3_5_moe on the same weights (its
    sanitize moves the conv axis and adds 1 to the norms). Bound 1e-4 (measured ≤ 2e-5)."""
    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen35(name)
    their_model, _ = mlx_lm_load(str(mlx_lm_copy(folder, tmp_path / "copy")))
    ids = trajectory(72, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(mlxlis.load(folder, "float32").logits(ids))
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_mlx_lm_saved_folder_matches_mlx_lm(qwen35, name, tmp_path):
    """A folder saved by mlx-lm (its 4-bit conversion: conv1d as (C, kernel, 1), norms + 1,
    experts stacked and quantized) loads — the layout is recognised, the +1 undone — and gives
    mlx-lm's logits on it (bound 1e-4)."""
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen35(name)
    out = tmp_path / "q4"
    mlx_lm_convert(
        str(mlx_lm_copy(folder, tmp_path / "copy")),
        str(out),
        quantize=True,
        q_group_size=32,
        q_bits=4,
        dtype="float32",
    )
    model = mlxlis.load(out, "float32")
    their_model, _ = mlx_lm_load(str(out))
    ids = trajectory(48, vocab=400)
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(model.logits(ids))
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_equals_step_decode_equals_full(qwen35, name):
    """Self-consistency: one-step decode (the recurrent form, token by token) and chunked
    prefill with a cache (chunks of 5, 16 and 70: inside one 64-token chunk, across chunk
    borders, the chunked form continuing a carried state) give the full forward's logits
    (bound 1e-4)."""
    folder, _ = qwen35(name)
    model = mlxlis.load(folder, "float32")
    ids = trajectory(150, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    cache = model.make_cache()
    steps = [np.array(model.net(mx.array([[t]]), cache=cache)[0, -1]) for t in ids]
    assert np.abs(np.stack(steps) - full).max() < 1e-4
    for chunk in (5, 16, 70):
        cache = model.make_cache()
        outs = [
            np.array(model.net(mx.array([ids[s : s + chunk]]), cache=cache)[0])
            for s in range(0, len(ids), chunk)
        ]
        assert np.abs(np.concatenate(outs) - full).max() < 1e-4, chunk


def test_chat_prefix_reuse_equals_fresh_run(qwen35):
    """A later chat turn on a hybrid model reuses the earlier prompt (KV caches trimmed, the
    recurrent states restored from their snapshot at that prompt's end) and produces exactly
    the greedy tokens of a fresh run over the whole conversation."""
    folder, _ = qwen35("qwen3_5")
    model = mlxlis.load(folder, "float32", chat_template="chatml")
    chat = mlxlis.ChatSession(model)
    first = [
        e.token
        for e in chat.send("Hello there, how are you?", max_tokens=12)
        if e.token is not None
    ]
    second = [e.token for e in chat.send("Tell me more.", max_tokens=12) if e.token is not None]
    assert chat.last_reused_tokens > 0 and first
    fresh = mlxlis.ChatSession(model)
    fresh.turns = chat.turns[:-1]  # the conversation up to the second user message
    ids = model.tokenizer.encode(fresh.render(), special=True)
    again = [e.token for e in mlxlis.generate(model, ids, max_tokens=12) if e.token is not None]
    assert second == again


def test_convert_round_trip_and_mlx_lm(qwen35, tmp_path):
    """`convert` writes the hybrid model as a folder (Hugging Face layout) that reloads bit for
    bit and that mlx-lm loads to the same logits (bound 1e-4)."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = qwen35("qwen3_5_moe")
    out = convert(folder, tmp_path / "out", dtype="float32")
    src = mlxlis.load(folder, "float32")
    again = mlxlis.load(out, "float32")
    ids = trajectory(40, vocab=400)
    assert bool(mx.array_equal(again.logits(ids), src.logits(ids)))
    their_model, _ = mlx_lm_load(str(out))
    theirs = np.array(their_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(np.array(again.logits(ids)) - theirs).max() < 1e-4
