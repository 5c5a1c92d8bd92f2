"""Converter conventions (mlxlis.models.conventions, declared per family) and the families'
GGUF name tables (`Family.gguf.block`).

Reference parity: the un-permute against llama.cpp's own `permute` formula (copied below from
convert_hf_to_gguf.py), on dense rows and on MLX-quantized rows; and, on the full load path, a
tiny llama GGUF written here with gguf-py's GGUFWriter the way llama.cpp's converter writes one
(Q/K permuted, F32 or Q8_0 blocks) against transformers' logits for the original model. The
name tables are checked against every tensor of the real models and against the model's own
parameter names; bad files must fail naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import mlxlis
import mlxlis.runtime.device
from mlxlis.errors import MissingTensorError, UnexpectedTensorError
from mlxlis.loading import catalog
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.models import REGISTRY, build_model, conventions, family
from mlxlis.models import from_gguf as gguf_model
from mlxlis.models.config import MLPConfig, ModelConfig, NormConfig, RopeConfig
from mlxlis.models.conventions import unpermute_rows
from mlxlis.models.from_gguf import SPECIAL
from mlxlis.models.gguf_config import config_from_gguf

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, build_tiny, trajectory
from mlx.utils import tree_flatten

REAL = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py, LlamaModel.permute (the reference, verbatim up to numpy)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def undo(name: str, arr: mx.array, cfg: ModelConfig, part: str) -> mx.array:
    return family(cfg.family).undo(name, arr, cfg, part)


def module_name(fam: str, gguf_name: str) -> str | None:
    return family(fam).gguf.module_name(gguf_name)


def permuted_by_llama_cpp(fam: str) -> bool:
    """llama.cpp's converter permutes Q/K for its LlamaModel's architectures: `llama`, and
    `mistral3` and `smollm3` (Ministral3Model and SmolLM3Model subclass it), `granitehybrid`
    (GraniteHybridModel sets undo_permute)."""
    archs = ("llama", "mistral3", "smollm3", "granitehybrid")
    return any(a in archs for a in REGISTRY[fam].gguf.archs)


def norms_plus_one_in_gguf(fam: str) -> bool:
    """llama.cpp's Gemma 1/2/3 converters add 1 to every norm weight; its Qwen3-Next and
    Qwen3.5 converters (Qwen3NextModel) to every norm but DeltaNet's gated one (not in
    GEMMA_NORMS below)."""
    archs = ("gemma", "gemma2", "gemma3", "qwen35", "qwen35moe", "qwen3next")
    return any(a in archs for a in REGISTRY[fam].gguf.archs)


def qwen35_layout(fam: str) -> bool:
    """llama.cpp's Qwen3.5 converter also reorders value heads, stores −exp(A_log), squeezes
    conv1d: a convention set of its own (test_qwen3_5_gguf.py checks it against a file)."""
    return any(a in ("qwen35", "qwen35moe") for a in REGISTRY[fam].gguf.archs)


def config(family: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(
        family=family,
        vocab_size=64,
        hidden_size=heads * head_dim,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope=RopeConfig(theta=10000.0),
        norms=NormConfig(1e-6),
        mlp=MLPConfig(64),
    )


# --- un-permute ---


@pytest.mark.parametrize(
    "n_heads,head_dim", [(1, 8), (2, 8), (3, 64), (4, 16), (9, 64), (14, 64), (32, 4)]
)
def test_unpermute_inverts_llama_cpp_permute(n_heads: int, head_dim: int):
    """Reference parity: unpermute_rows(permute(w)) == w exactly, for weights and 1-D biases."""
    rng = np.random.default_rng(n_heads * head_dim)
    for shape in ((n_heads * head_dim, 48), (n_heads * head_dim,)):
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = llama_cpp_permute(w, n_heads, None)
        assert not np.array_equal(permuted, w) or head_dim == 2  # the permute does move rows
        got = np.array(unpermute_rows(mx.array(permuted), n_heads))
        assert np.array_equal(got, w)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_unpermute_commutes_with_dequantize(bits: int):
    """Rows are independent in MLX's quantized layout: un-permuting the packed codes, scales
    and biases and then dequantizing equals dequantizing and then un-permuting."""
    n_heads, head_dim = 6, 16
    w = mx.array(
        np.random.default_rng(bits).standard_normal((n_heads * head_dim, 128)), dtype=mx.float32
    )
    q = mx.quantize(w, group_size=32, bits=bits)
    kw = dict(group_size=32, bits=bits)
    after = mx.dequantize(*(unpermute_rows(a, n_heads) for a in q), **kw)
    before = unpermute_rows(mx.dequantize(*q, **kw), n_heads)
    assert mx.array_equal(after, before).item()


def test_undo_unpermutes_q_with_heads_and_k_with_kv_heads():
    """Through the CONVENTIONS table: Q un-permuted with n_heads, K with n_kv_heads (llama.cpp
    permutes K with n_head_kv), V and O untouched; on each part of a quantized tensor."""
    cfg = config("llama", heads=8, kv_heads=2, head_dim=16)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((128, 32)).astype(np.float32)
    k = rng.standard_normal((32, 32)).astype(np.float32)
    fq = llama_cpp_permute(q, 8, 8)
    fk = llama_cpp_permute(k, 8, 2)
    for part in ("weight", "scales", "biases", "bias"):
        got_q = undo(f"model.layers.0.self_attn.q_proj.{part}", mx.array(fq), cfg, part)
        got_k = undo(f"model.layers.0.self_attn.k_proj.{part}", mx.array(fk), cfg, part)
        assert np.array_equal(np.array(got_q), q) and np.array_equal(np.array(got_k), k)
    for name in ("self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight"):
        got = undo(f"model.layers.0.{name}", mx.array(fq), cfg, "weight")
        assert np.array_equal(np.array(got), fq)
    for fam in REGISTRY:  # llama.cpp permutes llama only
        got = undo(
            "model.layers.0.self_attn.q_proj.weight",
            mx.array(fq),
            config(fam, heads=8, kv_heads=2),
            "weight",
        )
        assert np.array_equal(np.array(got), q if permuted_by_llama_cpp(fam) else fq), fam


# --- Gemma norms ---

GEMMA_NORMS = [
    "model.norm.weight",
    "model.layers.3.input_layernorm.weight",
    "model.layers.3.post_attention_layernorm.weight",
    "model.layers.3.pre_feedforward_layernorm.weight",
    "model.layers.3.post_feedforward_layernorm.weight",
    "model.layers.3.self_attn.q_norm.weight",
    "model.layers.3.self_attn.k_norm.weight",
]
NOT_NORMS = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.3.self_attn.q_proj.weight",
    "model.layers.3.self_attn.q_proj.bias",
    "model.layers.3.mlp.down_proj.weight",
    "model.layers.3.self_attn.o_proj.weight",
]


@pytest.mark.parametrize("fam", list(REGISTRY))
def test_gemma_norm_minus_one_exactly_where_it_belongs(fam: str):
    """llama.cpp adds 1 to every Gemma *norm.weight (q/k norms included): the loader subtracts
    it from each of them for gemma/gemma2/gemma3, from nothing else, and never for the others."""
    cfg = config(fam)
    w = mx.array(np.linspace(-2, 3, 16, dtype=np.float32))
    gemma = norms_plus_one_in_gguf(fam)
    for name in GEMMA_NORMS:
        got = undo(name, w, cfg, "weight")
        assert mx.array_equal(got, w - 1 if gemma else w).item(), name
    for name in NOT_NORMS:
        if permuted_by_llama_cpp(fam) and "q_proj" in name:
            continue  # un-permuted, tested above
        assert mx.array_equal(undo(name, w, cfg, "weight"), w).item(), name


def test_every_family_declares_exactly_llama_cpps_conventions():
    """Each family's GGUF conventions are what llama.cpp's converter did to its architecture:
    the Q/K un-permute for llama, the norm offset for Gemma 1/2/3, Qwen3.5's and Qwen3-Next's
    own sets, LFM2's squeezed conv kernel, Granite 4.0's and Nemotron-H's Mamba-2 reshapes and
    Q/K permute, nothing for the rest (Voxtral has no architecture of its own: llama.cpp
    writes its text as `llama`, whose conventions those GGUFs get)."""
    for fam, spec in REGISTRY.items():
        if fam == "voxtral":
            assert spec.gguf.archs == () and spec.gguf.conventions == (), fam
            continue
        if qwen35_layout(fam):
            assert spec.gguf.conventions == conventions.QWEN35_GGUF, fam
            continue
        if "qwen3next" in spec.gguf.archs:  # Qwen3.5's set without its value-head reorder
            assert spec.gguf.conventions == conventions.QWEN3NEXT_GGUF, fam
            continue
        if "lfm2" in spec.gguf.archs:  # Lfm2Model.modify_tensors squeezes the conv kernel
            from mlxlis.models.lfm2 import CONV_UNSQUEEZED

            assert spec.gguf.conventions == (CONV_UNSQUEEZED,), fam
            continue
        if "granitehybrid" in spec.gguf.archs:  # Mamba2Model's A, D, conv and norm reshapes
            from mlxlis.models import mamba2  # GraniteHybridModel: + Llama's Q/K permute

            want = (*mamba2.GGUF_CONVENTIONS, conventions.UNPERMUTE_Q, conventions.UNPERMUTE_K)
            assert spec.gguf.conventions == want, fam
            continue
        if "nemotron_h" in spec.gguf.archs:  # NemotronHModel: the same, its attention `mixer`
            from mlxlis.models import mamba2

            q, k = conventions.MIXER_UNPERMUTE_Q, conventions.MIXER_UNPERMUTE_K
            assert spec.gguf.conventions == (*mamba2.GGUF_CONVENTIONS, q, k), fam
            continue
        want = []
        if permuted_by_llama_cpp(fam):
            want += ["UNPERMUTE_Q", "UNPERMUTE_K"]
        if norms_plus_one_in_gguf(fam):
            want += ["NORM_MINUS_ONE"]
        names = {
            id(getattr(conventions, n)): n for n in ("UNPERMUTE_Q", "UNPERMUTE_K", "NORM_MINUS_ONE")
        }
        assert [names[id(x)] for x in spec.gguf.conventions] == want, fam


# --- name tables ---


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_every_tensor_of_the_real_models_maps(name: str):
    """Each GGUF tensor has a row (or is SPECIAL) and the mapped names are exactly the names of
    the family model's parameters (tied: no lm_head)."""
    if not catalog.is_pulled(name):
        pytest.skip(f"{name} not pulled (make models)")
    with read_gguf(catalog.model_path(name)) as f:
        shapes = {n: t.shape for n, t in f.tensors.items()}
        cfg = config_from_gguf(f.metadata, shapes, str(f.path))
        mapped = {n: module_name(cfg.family, n) for n in f.tensors if n not in SPECIAL}
    assert all(mapped.values()), [n for n, m in mapped.items() if m is None]
    params = {k for k, _ in tree_flatten(build_model(cfg).parameters())}
    assert set(mapped.values()) == params


def test_name_tables():
    assert module_name("llama", "blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    k_norm = module_name("gemma3", "blk.0.attn_k_norm.weight")
    assert k_norm == "model.layers.0.self_attn.k_norm.weight"
    ffn_norm = module_name("gemma2", "blk.1.ffn_norm.weight")
    assert ffn_norm == "model.layers.1.pre_feedforward_layernorm.weight"
    # llama.cpp's minimax-m2: the router's correction bias, the stacked experts
    bias = module_name("minimax_m2", "blk.1.exp_probs_b.bias")
    assert bias == "model.layers.1.block_sparse_moe.e_score_correction_bias"
    gate = module_name("minimax_m2", "blk.1.ffn_gate_exps.weight")
    assert gate == "model.layers.1.block_sparse_moe.switch_mlp.gate_proj.weight"
    assert module_name("llama", "blk.0.attn_q_norm.weight") is None  # no such llama module
    assert module_name("llama", "blk.0.nonsense.weight") is None


def test_deepseek2_split_up_projections_map_to_the_latent_attention():
    """llama.cpp's deepseek2 writes kv_b_proj split (attn_k_b: W_uk transposed per head,
    attn_v_b: W_uv per head), the layouts of mlx-lm's embed_q / unembed_out, which the
    latent attention binds as they are (no convention to undo); an older file's whole
    attn_kv_b binds to kv_b_proj."""
    at = "model.layers.2.self_attn."
    assert module_name("deepseek_v3", "blk.2.attn_k_b.weight") == at + "embed_q.weight"
    assert module_name("deepseek_v3", "blk.2.attn_v_b.weight") == at + "unembed_out.weight"
    assert module_name("deepseek_v3", "blk.2.attn_kv_b.weight") == at + "kv_b_proj.weight"
    assert module_name("deepseek_v3", "blk.2.attn_kv_a_mqa.weight") == (
        at + "kv_a_proj_with_mqa.weight"
    )
    assert module_name("deepseek_v3", "blk.2.exp_probs_b.bias") == (
        "model.layers.2.mlp.gate.e_score_correction_bias"
    )
    assert REGISTRY["deepseek_v3"].gguf.conventions == ()


def test_deepseek_v4_reads_deepseeks_own_names_and_no_gguf():
    """transformers 5.25 saves DeepSeek V4 under DeepSeek's own names: the head `head` (ours
    lm_head), the next-token layers `mtp.*` dropped, the rest as they are (the per-expert w1,
    w3, w2 stacked at load: test_deepseek_v4's parity binds them); llama.cpp converts no V4,
    so no GGUF architecture and no convention."""
    spec = REGISTRY["deepseek_v4"]
    assert spec.hf.name("head.weight") == "lm_head.weight"
    assert spec.hf.name("mtp.0.attn.wkv.weight") is None
    at = "model.layers.3.attn.compressor.indexer.compressor.ape"
    assert spec.hf.name(at) == at
    assert spec.gguf.archs == () and spec.gguf.conventions == ()


# --- a synthetic llama GGUF, written as llama.cpp's converter writes it ---

TINY_LLAMA = dict(
    kind="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    """HF tensor name -> llama.cpp's, written out here independently of gguf_names.TABLES."""
    stem, part = hf.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{part}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{BLOCK[rest]}.{part}"


def write_llama_gguf(
    path: Path,
    ref,
    folder: Path,
    qtype: str = "F32",
    drop: tuple = (),
    extra: tuple = (),
    rope_freqs: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Write `ref` (a transformers llama) as a GGUF; returns the HF state dict the file holds
    (the original weights, or their Q8_0 round trip)."""
    cfg = ref.config
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # llama.cpp omits output.weight when tied
    w = gguf.GGUFWriter(str(path), "llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    add_gguf_sizes(w, cfg)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    add_bpe_tokenizer(w, folder, cfg)
    held = {}
    for hf, t in sd.items():
        if hf in drop:
            continue
        if qtype == "Q8_0" and t.ndim == 2:
            data = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)  # rows independent
            held[hf] = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
            raw_dtype = gguf.GGMLQuantizationType.Q8_0
        else:
            data, held[hf], raw_dtype = t, t, None
        if hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif hf.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(hf), data, raw_dtype=raw_dtype)
    for name in extra:
        w.add_tensor(name, np.zeros((4, 32), np.float32))
    if rope_freqs is not None:  # Llama 3 scaling as llama.cpp stores it: one factor per pair
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def tiny_llamas(tmp_path_factory):
    """untied and tied tiny llamas built by transformers (+ their tokenizer folders)."""
    out = {}
    for tied in (False, True):
        folder = tmp_path_factory.mktemp(f"llama_tied{tied}")
        out[tied] = (folder, build_tiny(folder, {**TINY_LLAMA, "tie_word_embeddings": tied}))
    return out


@pytest.mark.parametrize("qtype,tied", [("F32", False), ("Q8_0", True), ("Q8_0", False)])
def test_synthetic_llama_gguf_matches_transformers(tiny_llamas, tmp_path, qtype, tied):
    """Reference parity on the whole GGUF path, the independent test of the un-permute: a tiny
    llama written with Q/K permuted as llama.cpp does (F32, or Q8_0 blocks kept quantized) loads
    and gives transformers' logits for the model holding the same weights (fp32, 40 tokens)."""
    folder, ref = tiny_llamas[tied]
    path = tmp_path / f"tiny-{qtype}.gguf"
    held = write_llama_gguf(path, ref, folder, qtype)
    model = mlxlis.load(path, "float32", dequantize=False)
    assert model.config.tie_word_embeddings == tied
    assert ("lm_head" in model.net) != tied
    if qtype == "Q8_0":
        assert "8-bit" in mlxlis.models.model._quant_summary(model.net)
    ref = ref.__class__(ref.config).eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()}, strict=not tied)
    if tied:
        ref.tie_weights()
    ids = trajectory(40, vocab=model.config.vocab_size)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].numpy()
    ours = np.array(model.logits(ids))
    delta = np.abs(ours - theirs).max()
    assert delta < 1e-4 * max(1.0, np.abs(theirs).max()), f"max |Δ| = {delta}"
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_unknown_tensor_is_refused_by_name(tiny_llamas, tmp_path):
    folder, ref = tiny_llamas[False]
    path = tmp_path / "extra.gguf"
    write_llama_gguf(path, ref, folder, extra=("blk.0.attn_mystery.weight",))
    with pytest.raises(UnexpectedTensorError) as info:
        mlxlis.load(path, "float32")
    assert info.value.field == "blk.0.attn_mystery.weight"
    assert "blk.0.attn_mystery.weight" in str(info.value) and str(path) in str(info.value)


def test_missing_tensor_is_refused_by_module_name(tiny_llamas, tmp_path):
    folder, ref = tiny_llamas[False]
    path = tmp_path / "missing.gguf"
    write_llama_gguf(path, ref, folder, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(MissingTensorError) as info:
        mlxlis.load(path, "float32")
    assert info.value.field == "model.layers.1.mlp.up_proj.weight"
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value)


def kinds(model) -> dict[str, str]:
    return {
        name: type(m).__name__
        for name, m in model.net.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding))
    }


def test_default_is_dense_matmuls_on_cpu_quantized_elsewhere(tiny_llamas, tmp_path, monkeypatch):
    """dequantize=None (the default) on the CPU without mlxlis's kernels (runtime/kernels not
    built): every matmul weight is dense (MLX's CPU quantized matmul is ~15x slower at prompt
    processing) but an untied embedding, a row lookup, stays quantized; tied, it is the head
    and goes dense. With the kernels: every block stays quantized, their layers the kernels'.
    Quantized when the dense weights would not fit comfortably, and on Metal / CUDA. False and
    True force either way. (Loaded in the HF layout.)"""
    from mlxlis.models.quantized import QuantizedLinear
    from mlxlis.runtime import kernels

    monkeypatch.setattr(mlxlis.runtime.device, "device_name", lambda: "cpu")
    for tied in (False, True):
        folder, ref = tiny_llamas[tied]
        path = tmp_path / f"q8-{tied}.gguf"
        write_llama_gguf(path, ref, folder, "Q8_0")
        if kernels.load() is not None:
            model = mlxlis.load(path, "float32")
            assert set(kinds(model).values()) == {"QuantizedLinear", "QuantizedEmbedding"}
            assert isinstance(model.net.model.layers[0].self_attn.q_proj, QuantizedLinear)
        with monkeypatch.context() as m:
            m.setattr(kernels, "load", lambda build=True: None)
            got = kinds(mlxlis.load(path, "float32"))
        embed = got.pop("model.embed_tokens")
        assert embed == ("Embedding" if tied else "QuantizedEmbedding")
        assert set(got.values()) == {"Linear"}
        forced = kinds(mlxlis.load(path, "float32", dequantize=False))
        assert set(forced.values()) <= {"QuantizedLinear", "QuantizedEmbedding"}
        dense = kinds(mlxlis.load(path, "float32", dequantize=True))
        assert set(dense.values()) == {"Linear", "Embedding"}
    monkeypatch.setattr(gguf_model, "available_memory", lambda: 10_000)  # too little to spare
    assert set(kinds(mlxlis.load(path, "float32")).values()) == {
        "QuantizedLinear",
        "QuantizedEmbedding",
    }
    monkeypatch.undo()
    # the products to run on a GPU (the loader asks the device's kind; the CPU runs them here)
    monkeypatch.setattr(mlxlis.runtime.device, "on_cpu", lambda device=None: False)
    assert set(kinds(mlxlis.load(path, "float32")).values()) == {
        "QuantizedLinear",
        "QuantizedEmbedding",
    }


def test_loads_from_several_threads(tiny_llamas, tmp_path):
    """MLX streams belong to a thread: loads on two successive worker threads (as the TUI's
    loader does) and on the main thread all work and agree."""
    import threading

    folder, ref = tiny_llamas[False]
    path = tmp_path / "threads.gguf"
    write_llama_gguf(path, ref, folder, "Q8_0")
    ids = trajectory(8, vocab=400)
    got: list = []

    def load() -> None:
        try:
            got.append(np.array(mlxlis.load(path, "float32", dequantize=False).logits(ids)))
        except Exception as e:  # surfaced below
            got.append(e)

    for _ in range(2):
        t = threading.Thread(target=load)
        t.start()
        t.join()
    load()
    assert all(isinstance(g, np.ndarray) for g in got), got
    assert all(np.array_equal(g, got[0]) for g in got)


def test_convert_refuses_rope_freqs(tiny_llamas, tmp_path):
    """A GGUF carrying rope_freqs (RoPE frequencies config.json cannot express) is refused by
    convert rather than written without them; nothing is left behind."""
    from mlxlis.commands.convert import convert
    from mlxlis.errors import UnsupportedError

    folder, ref = tiny_llamas[False]
    head_dim = ref.config.hidden_size // ref.config.num_attention_heads
    path = tmp_path / "freqs.gguf"
    write_llama_gguf(path, ref, folder, rope_freqs=np.linspace(1, 8, head_dim // 2))
    with pytest.raises(UnsupportedError, match="rope_freqs"):
        convert(path, tmp_path / "out", dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["freqs.gguf"]
