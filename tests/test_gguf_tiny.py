"""Tiny GGUF files written the way llama.cpp's converter writes them, against transformers.

Reference parity on the whole GGUF load path for what only a GGUF carries: a Llama with Llama 3
RoPE scaling stored as llama.cpp stores it (no scaling metadata, a `rope_freqs.weight` tensor of
per-frequency factors), and Gemma 1 / 2 / 3 files as llama.cpp's Gemma converters write them
(arch names gemma / gemma2 / gemma3, llama.cpp tensor names, +1 on every *norm.weight, the
metadata keys each converter writes and nothing more, tied embeddings). Each file is built
from a tiny random transformers model with gguf-py's GGUFWriter and loaded by `mlxlis.load`
in float32; its logits along one fixed trajectory are compared with transformers' float32
logits for the original model. The sequences are longer than what they must exercise: the
Llama 3 trajectory passes original_max_position_embeddings (64), the Gemma 2 / 3 trajectories
are 3 × the sliding window (16), so a wrong factor, layer pattern or local RoPE base shows.

What the converter does is written here from convert_hf_to_gguf.py (LlamaModel.
generate_extra_tensors, GemmaModel / Gemma2Model / Gemma3Model.set_gguf_parameters and
modify_tensors), independently of mlxlis' own tables; the HF -> GGUF names are also checked
against gguf-py's TensorNameMap, the converter's own table. The converter writes a
SentencePiece vocabulary for Gemma; a byte-level BPE one ("gpt2") from the tiny folder stands in
here, since the tokenizer is not what these tests are about.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlxlis

import gguf
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, build_tiny, trajectory
from test_conventions import write_llama_gguf

# --- Llama 3 RoPE scaling as llama.cpp stores it: rope_freqs.weight ---


def llama_cpp_rope_factors(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors for rope_type "llama3": one
    factor per inverse frequency; llama.cpp divides each frequency by its factor."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


LLAMA3_N = 100  # > original_max_position_embeddings (64): the scaled frequencies matter
LLAMA3_BOUND = 3e-5  # measured max |Δ| 1.9e-6 (|logit| ≤ 3.2); without rope_freqs 0.66


def logits_delta(model, ref, ids: list[int]) -> tuple[float, np.ndarray, np.ndarray]:
    """(max |Δ|, ours, theirs): mlxlis' float32 logits against transformers' (fp32, no grad)."""
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
    ours = np.array(model.logits(ids))
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max()), ours, theirs


def test_llama3_rope_freqs_gguf_matches_transformers(tiny, tmp_path):
    """Reference parity of the GGUF `rope_freqs` convention: a tiny Llama with Llama 3 RoPE
    scaling (θ 5e5, factor 8, low 1, high 4, original context 64), written as llama.cpp's
    converter writes it (no rope.scaling.* metadata, a rope_freqs.weight F32 tensor of
    llama.cpp's per-frequency factors, here 1 / smoothed / 8 across the 8 frequencies), loads
    and gives transformers' float32 logits at 100 tokens within 3e-5 (measured 1.9e-6). Pins
    that mlxlis multiplies each wavelength by its factor (llama.cpp divides the frequency);
    without the tensor the logits are far off, so the factors are what the test checks."""
    folder, ref = tiny("llama3_tied")
    cfg = ref.config
    scaling = cfg.rope_parameters
    assert scaling["rope_type"] == "llama3"
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    factors = llama_cpp_rope_factors(scaling["rope_theta"], head_dim, scaling)
    assert factors[0] == 1 and factors[-1] == scaling["factor"]  # all three branches taken
    assert any(1 < f < scaling["factor"] for f in factors), factors

    path = tmp_path / "llama3.gguf"
    write_llama_gguf(path, ref, folder, rope_freqs=factors)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    stored = tensors["rope_freqs.weight"]
    assert stored.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.asarray(stored.data).reshape(-1), factors)
    assert not [k for k in reader.fields if ".rope.scaling." in k]  # llama.cpp writes none
    assert "output.weight" not in tensors  # tied

    model = mlxlis.load(path, "float32")
    assert model.config.rope.type == "default"  # the scaling comes from the tensor alone
    ids = trajectory(LLAMA3_N, vocab=model.config.vocab_size)
    delta, ours, theirs = logits_delta(model, ref, ids)
    assert delta < LLAMA3_BOUND, f"max |Δ| = {delta}"
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()

    bare = tmp_path / "llama3-no-rope-freqs.gguf"  # control: the factors do move the logits
    write_llama_gguf(bare, ref, folder)
    unscaled, _, _ = logits_delta(mlxlis.load(bare, "float32"), ref, ids)
    assert unscaled > 100 * LLAMA3_BOUND, unscaled


# --- Gemma 1 / 2 / 3, written as llama.cpp's Gemma converters write them ---

WINDOW = 16
GEMMA_N = 48  # 3 × the window: every sliding layer clips
GEMMA3_LAYERS = 7  # llama.cpp's Gemma 3: 5 sliding, 1 global, then sliding again
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    pad_token_id=0,
)
# Each config holds what llama.cpp assumes for that arch: GELU (tanh), queries scaled by
# head_dim^-0.5 (query_pre_attn_scalar = head_dim, as for every size but the 27B), RoPE base
# 10 000 where the converter writes none (gemma, gemma2) and for Gemma 3's sliding layers.
GEMMA_SPECS = {
    "gemma": dict(
        COMMON,
        kind="gemma",
        num_hidden_layers=2,
        num_key_value_heads=1,
        hidden_act="gelu_pytorch_tanh",
        rope_theta=10000.0,
    ),
    # sliding first, then alternating; both softcaps biting
    "gemma2": dict(
        COMMON,
        kind="gemma2",
        num_hidden_layers=4,
        num_key_value_heads=2,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rope_theta=10000.0,
    ),
    # q/k norms; global θ 1e6 with linear scaling (written to the GGUF), local θ 10 000
    "gemma3": dict(
        COMMON,
        kind="gemma3",
        num_hidden_layers=GEMMA3_LAYERS,
        num_key_value_heads=2,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(GEMMA3_LAYERS)
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
GEMMAS = list(GEMMA_SPECS)
# max |Δ| of mlxlis' float32 logits against transformers' (48 tokens): measured 4.4e-6 (gemma,
# |logit| ≤ 7.7), 4.7e-6 (gemma2, ≤ 2.9), 2.9e-5 (gemma3, ≤ 5.4); bounds ~13x above
GEMMA_BOUNDS = {"gemma": 6e-5, "gemma2": 6e-5, "gemma3": 4e-4}

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gemma_gguf_name(arch: str, hf: str) -> str:
    """HF tensor name -> llama.cpp's, written out here independently of mlxlis' gguf_names.
    Gemma 1 has no sandwich norms: its post_attention_layernorm is the pre-FFN norm."""
    stem, part = hf.rsplit(".", 1)
    if stem in _TOP:
        return f"{_TOP[stem]}.{part}"
    _, _, i, rest = stem.split(".", 3)
    name = "ffn_norm" if arch == "gemma" and rest == "post_attention_layernorm" else _BLOCK[rest]
    return f"blk.{i}.{name}.{part}"


def write_gemma_gguf(path: Path, ref, folder: Path, arch: str) -> None:
    """Write transformers Gemma model `ref` as llama.cpp's Gemma converters do (F32): the keys
    of GemmaModel / Gemma2Model / Gemma3Model.set_gguf_parameters, lm_head skipped (tied),
    `data + 1` for every tensor whose HF name ends in norm.weight, no Q/K permute."""
    cfg = ref.config
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_sizes(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])  # the global layers'; local is hard-coded
        w.add_sliding_window(cfg.sliding_window)
        if full["rope_type"] == "linear":  # llama.cpp applies it to the global layers only
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    add_bpe_tokenizer(w, folder, cfg)
    for hf, t in ref.state_dict().items():
        if hf == "lm_head.weight":  # llama.cpp skips it: tied to token_embd
            continue
        data = t.detach().float().numpy()
        if hf.endswith("norm.weight"):
            data = data + 1  # Gemma's x̂·(1 + w) stored as x̂·w'
        w.add_tensor(gemma_gguf_name(arch, hf), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """tiny_gemma(arch) -> (folder, transformers model, GGUF path); built once per module."""
    built: dict[str, tuple[Path, object, Path]] = {}

    def get(arch: str):
        if arch not in built:
            folder = tmp_path_factory.mktemp(arch)
            ref = build_tiny(folder, GEMMA_SPECS[arch])
            path = folder / f"{arch}.gguf"
            write_gemma_gguf(path, ref, folder, arch)
            built[arch] = (folder, ref, path)
        return built[arch]

    return get


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_names_match_the_converters_table(tiny_gemma, arch):
    """The HF -> GGUF names written here equal those of gguf-py's TensorNameMap for the arch
    (the table convert_hf_to_gguf.py maps with), for every tensor of the model; the file has
    exactly those tensors (no output.weight: tied) and llama.cpp's arch name."""
    _, ref, path = tiny_gemma(arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], ref.config.num_hidden_layers)
    hf_names = [n for n in ref.state_dict() if n != "lm_head.weight"]
    for hf in hf_names:
        stem, part = hf.rsplit(".", 1)
        assert gemma_gguf_name(arch, hf) == f"{names.get_name(stem)}.{part}", hf
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == {gemma_gguf_name(arch, n) for n in hf_names}
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch


@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_gguf_matches_transformers(tiny_gemma, arch):
    """Reference parity of a llama.cpp-style Gemma GGUF: loads and gives transformers' float32
    logits for the original model at 48 tokens (3 × the sliding window of 16). Pins the GGUF
    conventions and config fields mlxlis must undo or assume: −1 on every *norm.weight
    (input, post-attention, pre/post-FFN, final, Gemma 3's q_norm/k_norm), llama.cpp's tensor
    names, tied head; gemma2: sliding on even layers (0, 2: sliding first), both softcaps;
    gemma3: 5 sliding then 1 global layer, local RoPE base 10 000 (hard-coded by llama.cpp),
    global base and linear scaling from rope.freq_base / rope.scaling.*. Measured max |Δ| and
    bounds in GEMMA_BOUNDS."""
    _, ref, path = tiny_gemma(arch)
    model = mlxlis.load(path, "float32")
    cfg, theirs = model.config, ref.config
    assert cfg.family == arch and cfg.tie_word_embeddings
    if arch != "gemma":  # the layer pattern and window llama.cpp assumes are transformers'
        assert list(cfg.layer_types) == list(theirs.layer_types)
        assert cfg.attention.sliding_window == theirs.sliding_window == WINDOW
    if arch == "gemma3":
        local = theirs.rope_parameters["sliding_attention"]["rope_theta"]
        assert cfg.attention.rope_local.theta == local == 10000.0
        assert (cfg.rope.theta, cfg.rope.type, cfg.rope.factor) == (1e6, "linear", 4.0)
    ids = trajectory(GEMMA_N, vocab=cfg.vocab_size)
    delta, ours, reference = logits_delta(model, ref, ids)
    assert np.abs(reference).max() > 1.0  # the logits are not trivially flat
    assert delta < GEMMA_BOUNDS[arch], f"{arch}: max |Δ| = {delta}"
