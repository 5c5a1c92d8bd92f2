"""DeepSeek V3 (`deepseek_v3`) against transformers, llama.cpp's converter, mlx-lm and itself.

Reference parity: tiny random `deepseek_v3` checkpoints written by transformers'
save_pretrained — 3 heads (odd), multi-head latent attention (kv_lora_rank 64, nope 32, rope
32, v 32) with q_lora_rank 64 and, in a second checkpoint, without it; YaRN RoPE (factor 4
over an original context of 32, mscale 1, mscale_all_dim 0.707: the attention factor on the
rope dims and the squared mscale on the softmax scale) on interleaved pairs; rms_norm_eps 1e-5
(the latent norms keep 1e-6); one dense layer then two MoE layers of 8 experts in 4 groups
with 2 used, top 3 renormalised and scaled by 2.5, a shared expert, a random correction bias of
spread 0.3 on the routers; an untied head — against its float32 forward over 72 tokens (past
the original context). Each mechanism is shown to bite (changed, the logits move).
The latent cache: it holds (1, 1, S, kv_lora_rank) latents and (1, 1, S, rope) keys, never
expanded keys/values. Self-consistency: chunked prefill ≡ decode ≡ full forward; batched
decode ≡ each alone; greedy n-gram speculation ≡ plain greedy, and in the serving engine with
batched verification; a rejection at each position rewinds exactly; a prefix reused from
memory and from the disk cache continues exactly; the 8-bit quantized latent cache stays near
the dense one. GGUF: the folder converted by llama.cpp's own convert_hf_to_gguf.py (deepseek2:
kv_b_proj split into k_b / v_b) gives the folder's logits. MLX-quantized: mlx-lm's 4-bit
conversion (kv_b_proj split into embed_q / unembed_out) against transformers on the weights
dequantized from that very folder. `convert` writes what mlx-lm's deepseek_v3 reads.
"""

from __future__ import annotations

import json
import shutil

import mlxlis
from mlxlis.cache import KVCache, KVFormat
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.steps import StepKind, forward, prefill
from mlxlis.models.footprint import footprint
from mlxlis.models.mla import join_kv_b

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    check_config_refused,
    check_speculation_and_engine,
    dequantized_folder,
    tiny_models,
    trajectory,
)
from llama_cpp_convert import convert as llama_cpp_convert

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
BASE = dict(
    kind="deepseek_v3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,  # llama.cpp's converter splits kv_b_proj by this count
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rope_parameters=YARN,
)
SPECS = {"q_lora": BASE, "no_q_lora": {**BASE, "q_lora_rank": None}}
BOUND = 1e-4  # float32 against transformers (the bound); measured below it


def with_bias(model) -> None:
    """A random correction bias on each router (a buffer randomize() leaves at zero)."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))


def build(folder, spec):
    return build_tiny(folder, spec, adjust=with_bias)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, build)


@pytest.fixture(scope="module")
def model(ds):
    return mlxlis.load(ds("q_lora")[0], "float32")


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


def edited(folder, dest, **changes):
    """A copy of the checkpoint `folder` with `changes` merged into config.json."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


@pytest.mark.parametrize("name", ["q_lora", "no_q_lora"])
def test_logits_match_transformers_fp32(ds, name, tmp_path):
    """Reference parity over 72 tokens within 1e-4, with and without q_lora_rank; and each
    mechanism bites: the same weights with the group limit off, without mscale_all_dim, with
    the routed scale 1 or with the correction bias zeroed move the logits."""
    folder, ref = ds(name)
    m = mlxlis.load(folder, "float32")
    c = m.config
    assert c.family == "deepseek_v3" and c.moe.sparse_layers == (False, True, True)
    assert (c.family_config.mla.q_lora_rank is None) == (name == "no_q_lora")
    ids = trajectory(72, vocab=c.vocab_size)
    ours, theirs = np.array(m.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < BOUND, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0
    if name == "no_q_lora":
        return
    changes = (
        {"topk_group": 4},
        {"routed_scaling_factor": 1.0},
        {"rope_parameters": {**YARN, "mscale_all_dim": 0.0}},
    )
    for i, change in enumerate(changes):
        other = mlxlis.load(edited(folder, tmp_path / str(i), **change), "float32")
        assert np.abs(np.array(other.logits(ids)) - ours).max() > 1e-2, change
    for layer in m.net.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias = mx.zeros((8,))
    assert np.abs(np.array(m.logits(ids)) - ours).max() > 1e-2


def test_latent_cache_chunks_decode_and_batches(model):
    """The cache holds the latent and the rope key only (the footprint counts those);
    self-consistency: a chunked prefill
    (9, 11) then token-by-token decode equals the full forward; two sequences at different
    offsets decoded together equal each alone."""
    ids = trajectory(48, vocab=model.config.vocab_size)
    caches = model.make_cache()
    model.net(mx.array([ids[:20]]), caches)
    assert all(isinstance(c, KVCache) for c in caches)
    assert caches[0].keys[..., :20, :].shape == (1, 1, 20, 64)  # the latent
    assert caches[0].values[..., :20, :].shape == (1, 1, 20, 32)  # the rope key
    # what the memory plan counts: 3 layers of float32 latent + rope key per token
    assert footprint(model).per_token == 3 * (64 + 32) * 4
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 35, 1e-4)


def test_speculation_and_engine_batches_give_the_lone_greedy_tokens(model):
    """Greedy n-gram speculation gives the plain greedy tokens (proposals verified, some
    rejected: the latent caches trimmed); 4 requests in the serving engine (two speculating,
    two plain, batched) each get their lone tokens."""
    check_speculation_and_engine(model)


def test_a_rejection_at_each_position_rewinds_exactly(model):
    """A verification of 1 + 5 tokens trimmed back to its first 1 + j: every latent cache
    holds what a verification of those 1 + j tokens gives, and so do the next step's logits
    (bound 1e-5: fewer rows take other matmul kernels)."""
    vocab = model.config.vocab_size
    prompt, step = trajectory(40, seed=7, vocab=vocab), trajectory(6, seed=8, vocab=vocab)
    k = len(step) - 1
    for j in range(k + 1):
        caches, ref = model.make_cache(), model.make_cache()
        prefill(model.net, prompt, caches)
        prefill(model.net, prompt, ref)
        forward(model.net, [caches], mx.array(step, mx.int32), StepKind.VERIFY)
        assert all(c.trim(k - j) == k - j for c in caches)
        forward(model.net, [ref], mx.array(step[: j + 1], mx.int32), StepKind.VERIFY)
        n = len(prompt) + j + 1
        for a, b in zip(caches, ref, strict=True):
            assert a.offset == b.offset == n
            assert np.abs(np.array(a.keys[..., :n, :]) - np.array(b.keys[..., :n, :])).max() < 1e-5
        after = mx.array([step[0]], mx.int32)
        got = forward(model.net, [caches], after, StepKind.DECODE)
        want = forward(model.net, [ref], after, StepKind.DECODE)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5, j


def test_a_prefix_reused_from_memory_and_from_disk_continues_exactly(model, tmp_path):
    """Turn 1 (60 tokens) kept by a prefix cache with a disk tier; turn 2 shares its first 50:
    the latent caches are trimmed there, from memory and, after a restart, from the file —
    the rest's logits bit for bit equal, and equal to a cold prefill up to the chunking's
    rounding (bound 1e-4)."""
    vocab = model.config.vocab_size
    one = trajectory(60, seed=1, vocab=vocab)
    two = one[:50] + trajectory(30, seed=2, vocab=vocab)
    warns: list[str] = []

    def tier():
        disk = DiskCache(tmp_path, 1 << 30, "fp", model.make_cache, warns.append)
        return PrefixCache(1 << 30, disk=disk)

    first = tier()
    caches = model.make_cache()
    mx.eval(model.net(mx.array([one]), cache=caches))
    first.put(one, caches)
    outs = []
    for cache in (first, tier()):  # the second: a restart, nothing in memory
        kept, reused = cache.take(two, None)
        assert reused == 50
        outs.append(np.array(model.net(mx.array([two[50:]]), cache=kept)[0, -1]))
    assert "read from disk" in cache.note and warns == []
    assert np.array_equal(outs[0], outs[1])
    cold = np.array(model.net(mx.array([two]), cache=model.make_cache())[0, -1])
    assert np.abs(outs[0] - cold).max() < 1e-4


def test_quantized_latent_cache_equals_the_round_trip_reference(model):
    """KV quantization on the latent and the rope key (8 bits, groups of 32, no dense tail):
    each layer's latent attention over 92 positions (chunks of 32, 32, 16, then 12 single
    tokens) on a quantized cache gives its output on a dense cache fed each chunk's
    quantize-dequantize round trip (test_kv_quant's reference; measured ≤ 3e-7, bound 2e-6),
    on the same inputs: at the model level a borderline value rounding the other way in a
    later layer's round trip (its input off by float rounding) moves the logits by ~1e-4.
    The quantization is not a no-op (dense caches move the output by over 1e-3); a group size
    dividing neither is refused naming the latent."""
    from mlxlis.cache import QArray
    from mlxlis.errors import MlxlisError

    from test_kv_quant import RoundTrip

    fmt = KVFormat(bits=8, group_size=32, tail=False)
    ids = trajectory(92, seed=4, vocab=model.config.vocab_size)
    x = model.net.embed(mx.array([ids]))
    for layer in model.net.model.layers:
        attn, h = layer.self_attn, layer.input_layernorm(x)
        quantized, ref, dense = model.make_cache(fmt)[0], KVCache(), KVCache()
        ref.store = RoundTrip(fmt)

        def feed(cache, attn=attn, h=h) -> np.ndarray:
            out, at = [], 0
            for n in (32, 32, 16, *[1] * 12):
                out.append(np.array(attn(h[:, at : at + n], "causal" if n > 1 else None, cache)))
                at += n
            return np.concatenate(out, axis=1)

        got, want, plain = feed(quantized), feed(ref), feed(dense)
        assert np.abs(got - want).max() < 2e-6
        assert np.abs(got - plain).max() > 1e-3
        assert isinstance(quantized.keys, QArray) and isinstance(quantized.values, QArray)
        x = layer(x, "causal", None)
    with pytest.raises(MlxlisError, match="kv_lora_rank"):
        model.make_cache(KVFormat(bits=8, group_size=128))


def test_quantized_kv_b_proj_absorbs_in_its_packed_form(ds):
    """A kv_b_proj quantized along kv_lora_rank (8 bits, groups of 32: an older llama.cpp
    file's attn_kv_b, or MLX's quantizer) is sliced into W_uk / W_uv rows in its packed form:
    the logits equal those of the same model whose kv_b_proj is the dequantized weight, taking
    the dense path transformers' parity proves (bound 1e-4)."""
    import mlx.nn as nn

    packed, dense = (mlxlis.load(ds("q_lora")[0], "float32") for _ in range(2))
    for a, b in zip(packed.net.model.layers, dense.net.model.layers, strict=True):
        q = nn.QuantizedLinear.from_linear(a.self_attn.kv_b_proj, group_size=32, bits=8)
        a.self_attn.kv_b_proj = q
        w = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8)
        b.self_attn.kv_b_proj.weight = w
    ids = trajectory(40, vocab=dense.config.vocab_size)
    got, want = np.array(packed.logits(ids)), np.array(dense.logits(ids))
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.extended  # `make test-all`: llama.cpp's converter takes ~20 s here
@pytest.mark.parametrize("name", ["q_lora", "no_q_lora"])
def test_gguf_from_llama_cpp_converter_equals_the_folder(ds, name, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (arch deepseek2: one KV head of key_length
    kv_lora_rank + rope, kv_b_proj split into k_b (n_heads, kv_lora_rank, nope) and v_b, the
    experts stacked, the correction bias as exp_probs_b, yarn_log_multiplier = 0.1 ·
    mscale_all_dim) at f32: the GGUF loads with the folder's structure and gives the folder's
    logits (bound 1e-5: the split up-projections multiply in another order). A GGUF states
    mscale_all_dim only (llama.cpp takes mscale equal to it, as the released checkpoints
    have it): the folder converted has mscale = mscale_all_dim. With q_lora_rank (attn_q_a,
    attn_q_a_norm, attn_q_b) and without (attn_q)."""
    folder = edited(ds(name)[0], tmp_path / "even", rope_parameters={**YARN, "mscale": 0.707})
    path = llama_cpp_convert(folder, tmp_path / "ds.gguf")
    g, src = mlxlis.load(path, "float32"), mlxlis.load(folder, "float32")
    c, s = g.config, src.config
    assert c.family == "deepseek_v3" and c.num_hidden_layers == 3 and c.rope == s.rope
    assert c.moe == s.moe and c.family_config.routing == s.family_config.routing
    gm, sm = c.family_config.mla, s.family_config.mla
    # the file keeps 0.1 · mscale_all_dim as a float32
    assert gm.split and not sm.split and abs(gm.scale / sm.scale - 1) < 1e-6
    ids = trajectory(72, vocab=s.vocab_size)
    assert np.abs(np.array(g.logits(ids)) - np.array(src.logits(ids))).max() < 1e-5


def mlx_lm_folder(folder, dest):
    """A copy with the classic keys mlx-lm's deepseek_v3 reads (rope_theta, rope_scaling)."""
    return edited(folder, dest, rope_theta=YARN["rope_theta"], rope_scaling=YARN)


def test_mlx_quantized_folder_matches_its_dequantized_weights(ds, tmp_path):
    """mlx-lm's own 4-bit conversion (group 32; kv_b_proj split into embed_q / unembed_out,
    experts stacked as switch_mlp) loads as it is, and gives the logits of transformers on the
    weights dequantized from its files, kv_b_proj joined again."""
    from mlx_lm import convert as mlx_lm_convert

    folder, ref = ds("q_lora")
    out = tmp_path / "q4"
    src = mlx_lm_folder(folder, tmp_path / "classic")
    mlx_lm_convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(out, "float32")
    assert model.format == "safetensors (MLX quantized)"
    dense = dequantized_folder(out)
    for i in range(3):
        p = f"model.layers.{i}."
        eq, uo = (dense.pop(p + f"self_attn.{k}.weight") for k in ("embed_q", "unembed_out"))
        dense[p + "self_attn.kv_b_proj.weight"] = np.array(join_kv_b(mx.array(eq), mx.array(uo)))
        if i:  # transformers 5 keeps the experts fused: gate rows, then up rows
            gate, up = (dense.pop(p + f"mlp.switch_mlp.{k}_proj.weight") for k in ("gate", "up"))
            dense[p + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            dense[p + "mlp.experts.down_proj"] = dense.pop(p + "mlp.switch_mlp.down_proj.weight")
    twin = ref.__class__(ref.config).eval()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in dense.items()})
    ids = trajectory(48, vocab=model.config.vocab_size)
    delta = np.abs(np.array(model.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < BOUND, f"max |Δ| = {delta}"


def test_convert_writes_what_mlx_lm_reads_and_inspect_says_it(model, ds, tmp_path):
    """`convert`'s folder: mlx-lm's deepseek_v3 gives our logits on it, and it reloads to the
    same config and bit-identical logits; `inspect` states MLA's KV bytes per token against
    the expanded cache."""
    from mlxlis.commands.convert import convert
    from mlxlis.commands.report import format_report, model_report

    from mlx_lm import load as mlx_lm_load

    ids = trajectory(48, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    out = convert(ds("q_lora")[0], tmp_path / "out", dtype="float32")
    theirs_model, _ = mlx_lm_load(str(out))
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(ours - theirs).max() < BOUND
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    a, s = again.config, model.config
    af, sf = a.family_config, s.family_config
    assert (a.moe, a.rope, af.mla, af.routing) == (s.moe, s.rope, sf.mla, sf.routing)
    text = format_report(model_report(model))
    # 16-bit: (64 + 32) · 2 held, 3 · (64 + 32) · 2 expanded
    assert "192 bytes per token and layer" in text and "against 576" in text
    assert "best 2 of 4 groups" in text


@pytest.mark.parametrize(
    "change, field",
    [
        ({"n_group": 3}, "n_group"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"qk_rope_head_dim": 31}, "qk_rope_head_dim"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"rope_parameters": {**YARN, "mscale_all_dim": "big"}}, "rope_parameters"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(ds, tmp_path, change, field):
    """Groups that do not divide the experts, another router, an odd rope width, no latent,
    a non-numeric mscale_all_dim: an MlxlisError naming config.json and the field."""
    from mlxlis.errors import MlxlisError

    check_config_refused(ds("q_lora")[0], tmp_path, change, MlxlisError, field)


def test_next_token_layers_are_skipped_at_load_and_read_as_the_drafter(ds, model, tmp_path):
    """A checkpoint holding a next-token layer (model.layers.3.*: a decoder layer's tensors,
    eh_proj, enorm, hnorm, shared_head.norm, as the released checkpoints do) loads without
    it and gives the same logits; `--speculative mtp` reads it on first use
    (tests/test_speculative_nextn.py checks the drafter)."""
    from mlxlis.generation.mtp import mtp_head_of

    from safetensors.numpy import load_file, save_file

    copy = edited(ds("q_lora")[0], tmp_path / "mtp", num_nextn_predict_layers=1)
    tensors = load_file(copy / "model.safetensors")
    extra = {k.replace("layers.2.", "layers.3."): v for k, v in tensors.items() if ".2." in k}
    extra["model.layers.3.eh_proj.weight"] = np.full((64, 128), 0.01, np.float32)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"model.layers.3.{name}.weight"] = np.ones(64, np.float32)
    save_file({**tensors, **extra}, copy / "model.safetensors", metadata={"format": "pt"})
    again = mlxlis.load(copy, "float32")
    assert again.config.family_config.mtp_layers == 1
    ids = trajectory(24, vocab=model.config.vocab_size)
    assert np.array_equal(np.array(again.logits(ids)), np.array(model.logits(ids)))
    head = mtp_head_of(again)  # read now; no shared_head.head in this copy: the target's
    assert "head" not in head.block.shared_head and "eh_proj" in head.block
