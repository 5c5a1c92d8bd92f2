"""GLM-4.5 (`glm4_moe`) against transformers, llama.cpp's converter, mlx-lm and itself.

Reference parity: a tiny random `glm4_moe` checkpoint written by transformers' save_pretrained
(3 query heads on 1 KV head, q/k/v biases, per-head q/k norms, RoPE on half of each head, one
dense layer then two MoE layers of 8 experts in 2 groups with 1 group used, top 2 renormalised
and scaled by 2.5, a shared expert, a random correction bias of spread 0.3 on the routers, an
untied head) against its float32 forward over 72 tokens; each routing mechanism is shown to
bite (turned off, the logits move); transformers 5's fused expert layout and a checkpoint
holding its next-token layer load to the same logits. GGUF: the folder converted by llama.cpp's own
convert_hf_to_gguf.py (its Glm4MoeModel; tests/llama_cpp_convert.py) gives the folder's logits.
MLX-quantized: mlx-lm's 4-bit conversion against transformers on the weights dequantized from
that very folder. `convert` writes what mlx-lm's glm4_moe reads. Self-consistency: chunked
prefill ≡ decode ≡ full forward, batched decode ≡ each alone, greedy n-gram speculation ≡
plain greedy.
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
SPECS = {
    "glm4_moe": dict(
        kind="glm4_moe",
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        moe_intermediate_size=48,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5},
    ),
}
# the added tokens llama.cpp's GLM vocabulary step looks up
GLM_SPECIAL = ("[gMASK]", "<|user|>", "<|observation|>")
BOUND = 2e-5  # float32 against transformers; measured 4.1e-6


def with_bias(model) -> None:
    """A random correction bias on each router (a buffer randomize() leaves at zero)."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))


def build(folder, spec):
    kw = dict(extra_special=GLM_SPECIAL)
    return build_tiny(folder, spec, tokenizer_kw=kw, adjust=with_bias)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    get = tiny_models(tmp_path_factory, SPECS, build)
    return lambda: get("glm4_moe")


@pytest.fixture(scope="module")
def model(glm):
    return mlxlis.load(glm()[0], "float32")


@pytest.fixture(scope="module")
def with_mtp(glm, tmp_path_factory):
    """A copy holding a next-token layer (model.layers.3.*: a decoder layer's tensors, eh_proj,
    enorm, hnorm, shared_head.norm), as the released checkpoints do."""
    from safetensors.numpy import load_file, save_file

    copy = tmp_path_factory.mktemp("glm4_moe_mtp") / "mtp"
    shutil.copytree(glm()[0], copy)
    tensors = load_file(copy / "model.safetensors")
    extra = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if ".2." in k}
    extra["model.layers.3.eh_proj.weight"] = np.full((96, 192), 0.01, np.float32)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"model.layers.3.{name}.weight"] = np.ones(96, np.float32)
    save_file({**tensors, **extra}, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def edited(folder, dest, **changes):
    """A copy of the checkpoint `folder` with `changes` merged into config.json."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


def test_logits_match_transformers_fp32(glm, model, tmp_path):
    """Reference parity over 72 tokens within 2e-5; and each mechanism bites: the same weights
    with the group limit off, without the routed scale, with RoPE on whole heads, or without
    the correction bias move the logits."""
    folder, ref = glm()
    c = model.config
    assert c.family == "glm4_moe" and not c.tie_word_embeddings
    assert c.moe.sparse_layers == (False, True, True) and c.attention.rotary_dim == 16
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0
    rope = {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 1.0}
    for i, change in enumerate(
        ({"topk_group": 2}, {"routed_scaling_factor": 1.0}, {"rope_parameters": rope})
    ):
        other = mlxlis.load(edited(folder, tmp_path / str(i), **change), "float32")
        assert np.abs(np.array(other.logits(ids)) - ours).max() > 1e-2, change
    unbiased = mlxlis.load(folder, "float32")
    for layer in unbiased.net.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias = mx.zeros((8,))
    assert np.abs(np.array(unbiased.logits(ids)) - ours).max() > 1e-2


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


def test_gguf_from_llama_cpp_converter_equals_the_folder(with_mtp, model, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (arch glm4moe: Q/K rows as they are, experts stacked,
    the correction bias as exp_probs_b, the group counts, the routed scale, a next-token layer
    counted in block_count) at f32: the GGUF loads with the folder's structure and gives the
    folder's logits (measured equal; bound 1e-6). Converted from the copy holding a
    next-token layer: its blk.3.* tensors (nextn.*) are skipped."""
    from gguf import GGUFReader

    path = llama_cpp_convert(with_mtp, tmp_path / "glm.gguf")
    assert any(t.name.startswith("blk.3.nextn.") for t in GGUFReader(str(path)).tensors)
    g, s = mlxlis.load(path, "float32"), model.config
    c = g.config
    assert c.family == "glm4_moe" and c.num_hidden_layers == 3 and not c.tie_word_embeddings
    assert (c.moe, c.family_config, c.attention) == (s.moe, s.family_config, s.attention)
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(g.logits(ids)) - np.array(model.logits(ids))).max() < 1e-6


def mlx_lm_folder(folder, dest):
    """A copy with the classic keys mlx-lm's glm4_moe requires."""
    return edited(folder, dest, rope_theta=THETA, partial_rotary_factor=0.5, rope_scaling=None)


def test_mlx_quantized_folder_matches_its_dequantized_weights(glm, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; its experts stacked as switch_mlp) loads as it
    is, and gives the logits of transformers on the weights dequantized from its files."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = glm()
    out = tmp_path / "q4"
    src = mlx_lm_folder(folder, tmp_path / "classic")
    mlx_lm_convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    dense = {k: torch.from_numpy(w) for k, w in dequantized_folder(out).items()}
    for i in (1, 2):  # transformers 5 keeps the experts fused: gate rows, then up rows
        p = f"model.layers.{i}.mlp."
        gate, up = (
            dense.pop(p + "switch_mlp.gate_proj.weight"),
            dense.pop(p + "switch_mlp.up_proj.weight"),
        )
        dense[p + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        dense[p + "experts.down_proj"] = dense.pop(p + "switch_mlp.down_proj.weight")
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict(dense)
    ids = trajectory(48, vocab=model.config.vocab_size)
    delta = np.abs(np.array(model.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads_and_inspect_says_it(model, glm, tmp_path):
    """`convert`'s folder: mlx-lm's glm4_moe gives our logits on it, and it reloads to the same
    config and bit-identical logits; `inspect` says the routing in words."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report

    from mlx_lm import load as mlx_lm_load

    ids = trajectory(48, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    out = convert(glm()[0], tmp_path / "out", dtype="float32")
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - theirs).max() < BOUND
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    a, s = again.config, model.config
    assert (a.moe, a.attention, a.rope) == (s.moe, s.attention, s.rope)
    assert a.own(type(s.family_config)).routing == s.family_config.routing
    text = format_report(model_report(model))
    assert "correction bias sways the choice" in text and "best 1 of 2 groups" in text
    assert "first 16 dims" in text and "drafts for --speculative mtp if the file has it" in text


def test_next_token_layers_are_skipped_at_load_and_read_as_the_drafter(with_mtp, model):
    """A checkpoint holding its next-token layer loads without it and gives the same logits;
    `--speculative mtp` reads it on first use
    (tests/test_speculative_nextn.py checks the drafter)."""
    from mlxlis.generation.mtp import mtp_head_of

    again = mlxlis.load(with_mtp, "float32")
    assert again.config.own(type(model.config.family_config)).mtp_layers == 1
    ids = trajectory(24, vocab=model.config.vocab_size)
    assert np.array_equal(np.array(again.logits(ids)), np.array(model.logits(ids)))
    head = mtp_head_of(again)  # read now; no shared_head.head in this copy: the target's
    assert "head" not in head.block.shared_head and "eh_proj" in head.block


def test_transformers_fused_expert_layout_loads_the_same(glm, model, tmp_path):
    """A checkpoint in transformers 5's in-memory layout (experts.gate_up_proj (E, 2·F, hidden),
    experts.down_proj (E, hidden, F), as its state_dict holds them) gives the same logits."""
    from safetensors.torch import save_file

    folder, ref = glm()
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
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3}, "n_group"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
        ({"routed_scaling_factor": "big"}, "routed_scaling_factor"),
        (
            {"rope_parameters": {"rope_theta": THETA, "partial_rotary_factor": 0.3}},
            "partial_rotary_factor",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(glm, tmp_path, change, field):
    """Groups that do not divide the experts, more groups used than there are, a negative
    dense count, a non-numeric scale, a rotary width of an odd count: an MlxlisError naming
    config.json and the field."""
    from mlxlis.errors import MlxlisError

    check_config_refused(glm()[0], tmp_path, change, MlxlisError, field)


def near_tie(ref, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A router input x (1, hidden; bfloat16 values) and a correction bias for `layer` that
    put two experts within 1e-5 of each other at the top-k boundary of the reference's own
    float32 scores, on the side where a bfloat16 copy of the router's weight and bias picks
    the other one: (x, bias, the float32 reference's chosen experts, sorted)."""
    gate = ref.model.layers[layer].mlp.gate
    k = gate.top_k
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _ in range(32):
            x = torch.randn(1, gate.hidden_dim, generator=g).bfloat16().float()
            s = torch.sigmoid(x @ gate.weight.T)[0]
            kept = gate.e_score_correction_bias.clone()
            order = torch.argsort(s + kept, descending=True).tolist()
            # a and b: k-th and (k+1)-th by biased score (kept only where rounding tells)
            a, b = order[k - 1], order[k]
            for delta in (1e-5, -1e-5):
                bias = kept.clone()
                bias[b] = (s[a] + bias[a]) - s[b] - delta  # b just behind a, or just ahead
                gate.e_score_correction_bias.copy_(bias)
                want = sorted(gate(x)[2][0].tolist())
                w32 = gate.weight.clone()
                gate.weight.copy_(w32.bfloat16().float())
                gate.e_score_correction_bias.copy_(bias.bfloat16().float())
                rounded = sorted(gate(x)[2][0].tolist())
                gate.weight.copy_(w32)
                gate.e_score_correction_bias.copy_(kept)
                if rounded != want:
                    return x, bias, want
    raise AssertionError("no near-tie that bfloat16 rounding breaks")


def test_router_keeps_float32_under_bfloat16_and_float16(glm, tmp_path):
    """transformers keeps GLM-4.5's router weight and correction bias in float32 whatever the
    model's dtype (_keep_in_fp32_modules_strict). On a near-tie built from the reference's own
    float32 scores (two experts 1e-5 apart at the top-k boundary, where a bfloat16 copy of the
    router picks the other), the bfloat16 and float16 loads of the folder, and of llama.cpp's
    f32 GGUF of it, choose the experts of the float32 reference, as transformers' own bfloat16
    model does."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder, ref = glm()
    x, bias, want = near_tie(ref)
    tied = tmp_path / "tied"
    shutil.copytree(folder, tied)
    tensors = load_file(tied / "model.safetensors")
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = bias.numpy()
    save_file(tensors, tied / "model.safetensors", metadata={"format": "pt"})
    theirs = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert sorted(theirs.model.layers[1].mlp.gate(x.bfloat16())[2][0].tolist()) == want
    gguf = llama_cpp_convert(tied, tmp_path / "tied.gguf")
    for source, dtype in ((tied, "bfloat16"), (tied, "float16"), (gguf, "bfloat16")):
        router = mlxlis.load(source, dtype).net.model.layers[1].mlp.gate
        inds, _ = router(mx.array(x.numpy()).astype(getattr(mx, dtype))[None])
        assert sorted(np.array(inds)[0, 0].tolist()) == want, (source, dtype)
        assert router.weight.dtype == router.e_score_correction_bias.dtype == mx.float32
