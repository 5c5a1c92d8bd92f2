"""MiniMax-M2 (`minimax_m2`) against transformers, llama.cpp's converter, mlx-lm and itself.

Reference parity: a tiny random `minimax_m2` checkpoint written by transformers' save_pretrained
(4 query heads on 2 KV heads of 32, q/k norms over the whole projection, RoPE on the first 16
dims of each head, two MoE layers of 8 experts, top 2 renormalised, a random correction bias of
spread 0.3 on the routers, an untied head; the hub's names: block_sparse_moe, experts w1/w2/w3)
against its float32 forward over 72 tokens; each mechanism is shown to bite (RoPE over whole
heads, the correction bias off: the logits move); transformers 5's in-memory layout (mlp.*,
fused experts) loads to the same logits. GGUF: the folder converted by llama.cpp's own
convert_hf_to_gguf.py (its MiniMaxM2Model; tests/llama_cpp_convert.py) gives the folder's
logits. MLX-quantized: mlx-lm's 4-bit conversion (its router at 8 bits) against transformers on
the weights dequantized from that very folder. `convert` writes what mlx-lm's minimax reads.
Self-consistency: chunked prefill ≡ decode ≡ full forward, batched decode ≡ each alone, greedy
n-gram speculation ≡ plain greedy.
"""

from __future__ import annotations

import json
import shutil

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

THETA = 20000.0
EXPERTS = 8
SPECS = {
    "minimax_m2": dict(
        kind="minimax_m2",
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        rotary_dim=16,  # the hub's key, which llama.cpp's converter reads
        scoring_func="sigmoid",
        use_qk_norm=True,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5},
    ),
}
BOUND = 2e-5  # float32 against transformers; measured 2.4e-6


def with_bias(model) -> None:
    """A random correction bias on each router (a buffer randomize() leaves at zero)."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        layer.mlp.e_score_correction_bias.copy_(0.3 * torch.randn(EXPERTS, generator=g))


def build(folder, spec):
    return build_tiny(folder, spec, adjust=with_bias)


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    get = tiny_models(tmp_path_factory, SPECS, build)
    return lambda: get("minimax_m2")


@pytest.fixture(scope="module")
def model(minimax):
    return mlxlis.load(minimax()[0], "float32")


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def edited(folder, dest, **changes):
    """A copy of the checkpoint `folder` with `changes` merged into config.json."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


def test_logits_match_transformers_fp32(minimax, model, tmp_path):
    """Reference parity over 72 tokens within 2e-5; and each mechanism bites: the same weights
    with RoPE on whole heads, or without the correction bias, move the logits."""
    folder, ref = minimax()
    c = model.config
    assert c.family == "minimax_m2" and not c.tie_word_embeddings
    assert c.moe.sparse_layers == (True, True) and c.attention.rotary_dim == 16
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0
    rope = {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 1.0}
    whole = mlxlis.load(edited(folder, tmp_path / "whole", rope_parameters=rope), "float32")
    assert whole.config.attention.rotary_dim is None
    assert np.abs(np.array(whole.logits(ids)) - ours).max() > 1e-2
    unbiased = mlxlis.load(folder, "float32")
    for layer in unbiased.net.model.layers:
        layer.block_sparse_moe.e_score_correction_bias = mx.zeros((EXPERTS,))
    assert np.abs(np.array(unbiased.logits(ids)) - ours).max() > 1e-2


def test_hub_rotary_dim_key_reads_as_partial_rope(minimax, model, tmp_path):
    """A config.json as the hub ships it (rotary_dim and rope_theta, no rope_parameters) reads
    to the same structure and logits."""
    folder, _ = minimax()
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["rope_parameters"]
    hub = tmp_path / "hub"
    shutil.copytree(folder, hub)
    (hub / "config.json").write_text(json.dumps({**cfg, "rope_theta": THETA}))
    again = mlxlis.load(hub, "float32")
    assert (again.config.attention, again.config.rope) == (
        model.config.attention,
        model.config.rope,
    )
    ids = trajectory(24, vocab=model.config.vocab_size)
    assert np.array_equal(np.array(again.logits(ids)), np.array(model.logits(ids)))


def test_cached_decode_batches_and_speculation(model):
    """Self-consistency: a chunked prefill (9, 11) then token-by-token decode equals the full
    forward; two sequences at different offsets decoded together equal each alone; greedy
    prompt-lookup speculation gives the plain greedy tokens."""
    ids = trajectory(48, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 35, 1e-4)
    prompt = (trajectory(12, seed=3, vocab=model.config.vocab_size) * 4)[:40]
    plain, _ = greedy_tokens(model, prompt, 30)
    got, seq = greedy_tokens(model, prompt, 30, Speculation("ngram", tokens=4))
    assert got == plain and len(plain) == 30
    assert seq.usage.draft_tokens > 0


def test_gguf_from_llama_cpp_converter_equals_the_folder(minimax, model, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (arch minimax-m2: rows as they are, whole q/k norms,
    experts stacked, the correction bias as exp_probs_b, rotary_dim as rope.dimension_count) at
    f32: the GGUF loads with the folder's structure and gives the folder's logits (measured
    equal; bound 1e-6)."""
    path = llama_cpp_convert(minimax()[0], tmp_path / "minimax.gguf")
    g, s = mlxlis.load(path, "float32"), model.config
    c = g.config
    assert c.family == "minimax_m2" and c.num_hidden_layers == 2 and not c.tie_word_embeddings
    assert (c.moe, c.attention) == (s.moe, s.attention)
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(g.logits(ids)) - np.array(model.logits(ids))).max() < 1e-6


def mlx_lm_folder(folder, dest):
    """A copy with the classic keys mlx-lm's minimax requires."""
    return edited(folder, dest, rope_theta=THETA, shared_intermediate_size=0)


def test_mlx_quantized_folder_matches_its_dequantized_weights(minimax, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; its router at 8 bits, group 64; its experts
    stacked as switch_mlp) loads as it is, and gives the logits of transformers on the weights
    dequantized from its files."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = minimax()
    out = tmp_path / "q4"
    src = mlx_lm_folder(folder, tmp_path / "classic")
    mlx_lm_convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    assert (
        json.loads((out / "config.json").read_text())["quantization"][
            "model.layers.0.block_sparse_moe.gate"
        ]["bits"]
        == 8
    )
    dense = {k: torch.from_numpy(w) for k, w in dequantized_folder(out).items()}
    for i in range(2):  # transformers 5's in-memory names: mlp.*, gate rows then up rows
        p, q = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        gate, up = (
            dense.pop(p + "switch_mlp.gate_proj.weight"),
            dense.pop(p + "switch_mlp.up_proj.weight"),
        )
        dense[q + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        dense[q + "experts.down_proj"] = dense.pop(p + "switch_mlp.down_proj.weight")
        dense[q + "gate.weight"] = dense.pop(p + "gate.weight")
        dense[q + "e_score_correction_bias"] = dense.pop(p + "e_score_correction_bias")
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(dense)
    ids = trajectory(48, vocab=model.config.vocab_size)
    delta = np.abs(np.array(model.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads_and_inspect_says_it(model, minimax, tmp_path):
    """`convert`'s folder: mlx-lm's minimax gives our logits on it, and it reloads to the same
    config and bit-identical logits; `inspect` says the routing and the norms in words."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report

    from mlx_lm import load as mlx_lm_load

    ids = trajectory(48, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    out = convert(minimax()[0], tmp_path / "out", dtype="float32")
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - theirs).max() < BOUND
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    a, s = again.config, model.config
    assert (a.moe, a.attention, a.rope) == (s.moe, s.attention, s.rope)
    text = format_report(model_report(model))
    assert "correction bias sways the choice" in text and "renormalised to sum 1" in text
    assert "first 16 dims" in text and "over all heads" in text


def test_transformers_in_memory_layout_loads_the_same(minimax, model, tmp_path):
    """A checkpoint in transformers 5's in-memory layout (mlp.gate, mlp.e_score_correction_bias,
    experts.gate_up_proj (E, 2·F, hidden), experts.down_proj (E, hidden, F), as its state_dict
    holds them) gives the same logits."""
    from safetensors.torch import save_file

    folder, ref = minimax()
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    ids = trajectory(24, vocab=model.config.vocab_size)
    got = np.array(mlxlis.load(fused, "float32").logits(ids))
    assert np.array_equal(got, np.array(model.logits(ids)))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        (
            {"rope_parameters": {"rope_theta": THETA, "partial_rotary_factor": 0.3}},
            "rope_parameters.partial_rotary_factor",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(minimax, tmp_path, change, field):
    """Another router, q/k norms off or a shared expert (none of which MiniMax-M2 has), more
    experts per token than experts, a rotary width of an odd count: an MlxlisError naming
    config.json and the field."""
    from mlxlis.errors import MlxlisError

    check_config_refused(minimax()[0], tmp_path, change, MlxlisError, field)
