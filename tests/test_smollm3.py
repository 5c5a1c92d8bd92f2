"""SmolLM3 against transformers, mlx-lm, llama.cpp's file layout, its chat template and itself.

Reference parity: tiny random `smollm3` checkpoints written by transformers' save_pretrained
against its float32 forward over 72 tokens: "smol" (NoPE on every 4th layer, transformers'
default θ 2e6) and "window" (NoPE every 3rd layer, use_sliding_window with a window of 16 on
the NoPE layers, as transformers places it). mlx-lm's smollm3 on the same weights ("smol") and
on what `convert` writes. GGUF: the weights written with gguf-py as
llama.cpp's SmolLM3Model (a LlamaModel) writes them, Q/K rows permuted, against transformers on
the weights gguf-py dequantizes from the very file (llama.cpp's graph fixes NoPE on every 4th
layer, which "smol" has). The template: SmolLM3's own (llama.cpp's copy), rendered by jinja2
itself, with reasoning switched by the session and by "/no_think" in the system message, and
the reply split accordingly. Self-consistency: cached decode and batches past the window.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlxlis
from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter, join

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import (
    add_bpe_tokenizer,
    add_gguf_sizes,
    build_tiny,
    check_batched_decode,
    check_cached_decode,
    llama_cpp_reference,
    tiny_models,
    trajectory,
)
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_conventions import llama_cpp_permute

COMMON = dict(
    kind="smollm3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
SPECS = {
    "smol": dict(**COMMON),
    "window": dict(use_sliding_window=True, sliding_window=16, no_rope_layer_interval=3, **COMMON),
}
TEMPLATE = "templates/HuggingFaceTB-SmolLM3-3B.jinja"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    return tiny_models(tmp_path_factory, SPECS, lambda f, s: build_tiny(f, s, pad_token_id=1))


def reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_fp32(smol, name):
    """Reference parity over 72 tokens within 2e-5 (measured 1.7e-6 smol, 1.3e-6 window): the
    NoPE layers from no_rope_layer_interval, the window on them only, θ's default."""
    folder, ref = smol(name)
    model = mlxlis.load(folder, "float32")
    cfg = model.config
    assert cfg.family == "smollm3" and cfg.rope.theta == ref.config.rope_parameters["rope_theta"]
    assert cfg.attention.no_rope_layers == tuple(not r for r in ref.config.no_rope_layers)
    ids = trajectory(72, vocab=cfg.vocab_size)
    ours, theirs = np.array(model.logits(ids)), reference_logits(ref, ids)
    delta = np.abs(ours - theirs).max()
    assert delta < 2e-5, f"max |Δ| = {delta}"
    assert np.abs(theirs).max() > 1.0


@pytest.mark.parametrize("name", list(SPECS))
def test_derived_layers_as_transformers_derives_them(smol, name, tmp_path):
    """transformers' save_pretrained writes no_rope_layers and layer_types out; a config without
    them (the interval and use_sliding_window alone) gives transformers' logits the same
    (bound 2e-5): the NoPE layers and the window placed as its SmolLM3Config places them."""
    folder, ref = smol(name)
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["no_rope_layers"], cfg["layer_types"]
    (bare / "config.json").write_text(json.dumps(cfg))
    ids = trajectory(72, vocab=400)
    ours = np.array(mlxlis.load(bare, "float32").logits(ids))
    assert np.abs(ours - reference_logits(ref, ids)).max() < 2e-5


def test_window_follows_layer_types_as_transformers_eager(smol, tmp_path):
    """With use_sliding_window false but layer_types naming sliding layers and a window set,
    transformers' eager attention still slides (its mask comes from layer_types): so does
    mlxlis (bound 2e-5 against transformers run on that very config)."""
    import transformers

    folder, ref = smol("window")
    off = tmp_path / "off"
    shutil.copytree(folder, off)
    cfg = json.loads((off / "config.json").read_text())
    cfg["use_sliding_window"] = False
    (off / "config.json").write_text(json.dumps(cfg))
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        off, attn_implementation="eager"
    )
    ids = trajectory(40, vocab=400)
    ours = np.array(mlxlis.load(off, "float32").logits(ids))
    assert np.abs(ours - reference_logits(theirs_model.eval(), ids)).max() < 2e-5


def test_cached_decode_and_batches_equal_the_full_forward(smol):
    """Self-consistency past the window (16): token-by-token decode after a chunked prefill
    equals the full forward; two sequences at different offsets batched equal each alone."""
    model = mlxlis.load(smol("window")[0], "float32")
    ids = trajectory(44, vocab=model.config.vocab_size)
    full = np.array(model.logits(ids))
    check_cached_decode(model, ids, full, 1e-4)
    check_batched_decode(model, ids, 35, 1e-4)


def test_mlx_lm_and_the_convert_round_trip(smol, tmp_path):
    """mlx-lm's smollm3 on the same weights (a copy stating θ the classic way, which it reads)
    and on what `convert` writes: the same logits within 2e-5; the converted folder reloads
    bit for bit to the same config."""
    from mlxlis.commands.convert import convert

    from mlx_lm import load as mlx_lm_load

    folder, _ = smol("smol")
    ids = trajectory(72, vocab=400)
    src = mlxlis.load(folder, "float32")
    ours = np.array(src.logits(ids))
    out = convert(folder, tmp_path / "out", dtype="float32")
    classic = tmp_path / "classic"  # mlx-lm reads θ from the classic key only (else 1e4)
    shutil.copytree(folder, classic)
    cfg = json.loads((classic / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (classic / "config.json").write_text(json.dumps(cfg))
    for source in (classic, out):
        theirs_model, _ = mlx_lm_load(str(source))
        theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
        assert np.abs(ours - theirs).max() < 2e-5, source
    again = mlxlis.load(out, "float32")
    assert np.array_equal(np.array(again.logits(ids)), ours)
    assert again.config == src.config.with_(
        source=again.config.source,
        special=replace(src.config.special, eos=again.config.special.eos),
    )


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0])
def test_gguf_matches_transformers_on_the_files_weights(smol, tmp_path, qtype):
    """Reference parity on the GGUF path: LlamaModel's names and keys, Q/K permuted (undone),
    NoPE every 4th layer as llama.cpp's graph has it; transformers on the file's weights, 72
    tokens, float32, bound 5e-5."""
    folder, ref = smol("smol")
    cfg = ref.config
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "smollm3")
    add_gguf_sizes(w, cfg)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    add_bpe_tokenizer(w, folder, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.SMOLLM3, cfg.num_hidden_layers)
    held = {}
    for hf, t in ref.state_dict().items():
        if hf == "lm_head.weight":
            continue  # tied: llama.cpp omits output.weight
        a = t.detach().float().numpy()
        stem, part = hf.rsplit(".", 1)
        q = qtype if a.ndim > 1 else gguf.GGMLQuantizationType.F32
        data = a if q == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(a, q)
        held[hf] = a if data is a else gguf.quants.dequantize(data, q).reshape(a.shape)
        heads = cfg.num_attention_heads
        if stem.endswith("q_proj"):
            data = llama_cpp_permute(data, heads, heads)
        elif stem.endswith("k_proj"):
            data = llama_cpp_permute(data, heads, cfg.num_key_value_heads)
        w.add_tensor(f"{names.get_name(stem)}.{part}", data, raw_dtype=None if data is a else q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    twin = ref.__class__(cfg).eval()
    twin.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()}, strict=False
    )
    twin.tie_weights()
    model = mlxlis.load(path, "float32", dequantize=False)
    assert model.config.family == "smollm3"
    assert model.config.attention.no_rope_layers == (False, False, False, True, False, False)
    ids = trajectory(72, vocab=model.config.vocab_size)
    delta = np.abs(np.array(model.logits(ids)) - reference_logits(twin, ids)).max()
    assert delta < 5e-5, f"max |Δ| = {delta}"


def official(template: str, messages: list[dict], **variables) -> str:
    """The template rendered by jinja2 itself, as transformers' apply_chat_template sets it up."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, **variables
    )


def split(prompt: str, model, pieces: list[str]) -> tuple[str, str]:
    s = ReasoningSplitter.for_prompt(model.tokenizer, prompt)
    segments = [seg for p in pieces for seg in s.feed(p)] + s.flush()
    return join(segments, REASONING), join(segments, ANSWER)


def test_think_switch_of_its_own_template(smol):
    """SmolLM3's template: the session's thinking setting reaches it as enable_thinking (the
    prompt equals jinja2's own rendering either way); off, or "/no_think" in the system
    message, the prompt ends in an empty think block and the reply is all answer; on, the
    reply's <think>…</think> is the reasoning."""
    template_path = llama_cpp_reference(TEMPLATE)
    template = template_path.read_text()
    model = mlxlis.load(smol("smol")[0], "float32", chat_template=str(template_path))
    assert model.supports_thinking
    session = mlxlis.ChatSession(model, thinking=False)
    msgs = [{"role": "user", "content": "Hi"}]
    off = session.prompt_preview("Hi")
    assert off == official(template, msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    assert split(off, model, ["Hello", " there."]) == ("", "Hello there.")
    session.thinking = True
    on = session.prompt_preview("Hi")
    assert on == official(template, msgs, enable_thinking=True) and on.endswith("assistant\n")
    assert split(on, model, ["<think>\nHm", "m.\n</think>\n", "Hello."]) == ("Hmm.", "Hello.")
    system = [{"role": "system", "content": "Be brief. /no_think"}, *msgs]
    flagged = model.render_chat(system)
    assert flagged == official(template, system) and "Reasoning Mode: /no_think" in flagged
    assert split(flagged, model, ["Hello."]) == ("", "Hello.")
