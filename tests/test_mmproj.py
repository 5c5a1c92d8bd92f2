"""llama.cpp's mmproj GGUF files (mlxlis/models/mmproj.py) for Gemma 3, Gemma 4 and Qwen3.5.

Each file is written here as llama.cpp's converter writes one (conversion/gemma.py,
conversion/qwen3vl.py, MmprojModel in conversion/base.py): the names from gguf-py's own
TensorNameMap for MODEL_ARCH.MMPROJ after the converter's renames, its metadata keys, its data
changes (Gemma 3's soft_emb_norm + 1, Gemma 4's patch embedding as a conv weight and its clamp
scalars as (1,), Qwen's Conv3d split into two frames), its dtypes (2-D weights F16, norms,
biases and position tables F32, Gemma 3's projection F16 always) — written independently of
mlxlis' reading of them. The tiny models' weights are float16 values, so the F16 tensors hold
them exactly.

What is proved here:
- each family's mmproj gives the features of transformers' own model of that folder (within
  1e-4; the folder's features already equal transformers', test_*_vision.py) on images of
  other sizes;
- a Gemma 3 text GGUF with its mmproj beside it (found by name) sees: its logits with images
  equal transformers' within 1e-4; `mmproj=False` loads it text only;
- the old converter script's Gemma 3 files (ffn_up / ffn_down swapped) are read as clip.cpp
  reads them; a projector of another family, of another width or a non-mmproj file is refused
  naming the file and field.
"""

from __future__ import annotations

from pathlib import Path

import mlxlis
from mlxlis.errors import MlxlisError
from mlxlis.models import PROJECTORS
from mlxlis.models.mmproj import load_mmproj

import gguf
import numpy as np
import pytest
import seeing as s
import torch
from seeing import build_gemma3, build_gemma4, build_qwen3_5, gemma4_inputs, qwen3_5_inputs
from test_gemma3_vision import photo

F16 = gguf.LlamaFileType.MOSTLY_F16


def vision_state(ref) -> dict[str, np.ndarray]:
    """transformers' vision tensors, buffers included, float32 numpy."""
    return {n: t.detach().float().numpy() for n, t in ref.state_dict().items()}


def writer(path: Path, cfg, text_hidden: int, mean, std, d: int, f: int, layers: int, heads: int):
    """MmprojModel.set_gguf_parameters: the keys every mmproj file has."""
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type("mmproj")
    w.add_file_type(F16)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", text_hidden)
    w.add_uint32("clip.vision.image_size", cfg["image_size"])
    w.add_uint32("clip.vision.patch_size", cfg["patch_size"])
    w.add_uint32("clip.vision.embedding_length", d)
    w.add_uint32("clip.vision.feed_forward_length", f)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.attention.head_count", heads)
    w.add_array("clip.vision.image_mean", [float(x) for x in mean])
    w.add_array("clip.vision.image_std", [float(x) for x in std])
    return w


def put(w, name: str, data: np.ndarray, force: str | None = None) -> None:
    """The converter's dtype rules: 1-D tensors, norms and position tables F32, other 2-D+
    weights in the outtype (F16), unless forced."""
    f32 = data.ndim <= 1 or name.endswith("_norm.weight") or name.startswith("v.position_embd")
    kind = force or ("F32" if f32 or not name.endswith(".weight") else "F16")
    w.add_tensor(name, data.astype(np.float32 if kind == "F32" else np.float16))


def finish(w) -> None:
    w.add_uint32("general.quantization_version", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MAP = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 8)


def mapped(name: str) -> str:
    stem, part = name.rsplit(".", 1)
    got = MAP.get_name(stem)
    assert got is not None, name
    return f"{got}.{part}"


def write_gemma3(path: Path, ref, legacy: bool = False) -> None:
    """Gemma3VisionModel: hub names (vision_tower.vision_model.*), the SigLIP head dropped,
    `_weight` -> `.weight`, soft_emb_norm + 1, the projection F16, `.embeddings.` F32. `legacy`:
    the old script's file, fc1 / fc2 written as ffn_down / ffn_up."""
    c = ref.config.vision_config
    proc = {"image_size": c.image_size, "patch_size": c.patch_size}
    w = writer(
        path,
        proc,
        ref.config.text_config.hidden_size,
        [0.5] * 3,
        [0.5] * 3,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
    )
    w.add_string("clip.projector_type", "gemma3")
    w.add_float32("clip.vision.attention.layer_norm_epsilon", c.layer_norm_eps)
    w.add_bool("clip.use_gelu", True)
    per_side = int(ref.config.mm_tokens_per_image**0.5)  # the processor's image_seq_length
    scale = (c.image_size // c.patch_size) // per_side
    if scale > 0 and scale != 4:  # written only when it is not clip.cpp's default
        w.add_uint32("clip.vision.projector.scale_factor", scale)
    for name, data in vision_state(ref).items():
        name = name.removeprefix("model.")
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
            continue
        name = name.replace("_weight", ".weight")
        if "soft_emb_norm" in name:
            data = data + 1
        if legacy:
            name = name.replace(".mlp.fc1.", ".mlp.SWAP.").replace(".mlp.fc2.", ".mlp.fc1.")
            name = name.replace(".mlp.SWAP.", ".mlp.fc2.")
        out = mapped(name)
        force = "F16" if "input_projection" in out else ("F32" if ".embeddings." in name else None)
        put(w, out, data, force)
    finish(w)


def write_gemma4(path: Path, ref) -> None:
    """Gemma4VisionAudioModel: the encoder renamed vision_model.model.*, `.linear` dropped,
    the clamp scalars as (1,), the patch embedding as (D, 3, p, p); kernel 2 written as
    clip.vision.projector.scale_factor (clip.cpp assumes 3 otherwise)."""
    c = ref.config.vision_config
    w = writer(
        path,
        {"image_size": 224, "patch_size": c.patch_size},
        ref.config.text_config.hidden_size,
        [0.0] * 3,
        [1.0] * 3,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
    )
    w.add_string("clip.vision.projector_type", "gemma4v")
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.projector.scale_factor", c.pooling_kernel_size)
    for name, data in vision_state(ref).items():
        if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        if data.ndim == 0:
            data = data.reshape(1)
        name = name.replace("model.vision_tower.encoder.", "vision_model.model.")
        name = name.replace(".linear.weight", ".weight")
        if name.endswith("position_embedding_table"):
            name += ".weight"
        if name.endswith("patch_embedder.input_proj.weight"):
            d, k = data.shape
            p = int((k // 3) ** 0.5)
            data = data.reshape(d, p, p, 3).transpose(0, 3, 1, 2)
        stem, part = name.rsplit(".", 1)
        if part in ("std_bias", "std_scale"):
            put(w, MAP.get_name(name), data)
            continue
        got = MAP.get_name(stem)
        assert got is not None, name
        put(w, f"{got}.{part}", data, "F32" if "position_embd" in got else None)
    finish(w)


def write_qwen3_5(path: Path, ref) -> None:
    """Qwen3VLVisionModel: model.visual.* -> visual.*, the merger's fc1 / fc2 as mm.0 / mm.2
    and its norm as v.post_ln, the Conv3d split into .weight / .weight.1."""
    c = ref.config.vision_config
    size = int(c.num_position_embeddings**0.5 * c.patch_size)
    w = writer(
        path,
        {"image_size": size, "patch_size": c.patch_size},
        ref.config.text_config.hidden_size,
        [0.5] * 3,
        [0.5] * 3,
        c.hidden_size,
        c.intermediate_size,
        c.depth,
        c.num_heads,
    )
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", c.spatial_merge_size)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.is_deepstack_layers", [False] * c.depth)
    own = {"visual.merger.linear_fc1": "mm.0", "visual.merger.linear_fc2": "mm.2"}
    own["visual.merger.norm"] = "v.post_ln"
    for name, data in vision_state(ref).items():
        if not name.startswith("model.visual."):
            continue
        name = name.replace("model.visual.", "visual.")
        stem, part = name.rsplit(".", 1)
        if stem == "visual.patch_embed.proj" and part == "weight":
            put(w, "v.patch_embd.weight", data[:, :, 0])
            put(w, "v.patch_embd.weight.1", data[:, :, 1])
            continue
        got = own.get(stem) or MAP.get_name(stem)
        assert got is not None, name
        put(w, f"{got}.{part}", data)
    finish(w)


def features_equal(model, vision, images) -> None:
    """The mmproj's tower gives the folder's features for the folder's pixels (a budget such
    as Gemma 4's max_soft_tokens is the processor's, which the file does not store)."""
    for image in images:
        want = model.vision.prepare(image, "x")
        got = np.array(vision.features(want))
        ref = np.array(model.image_features(want))
        assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-4


IMAGES = [photo(50, 40), photo(23, 70)]


def test_gemma3_mmproj_beside_its_text_gguf(tmp_path):
    from test_gguf_tiny import write_gemma_gguf
    from transformers import Gemma3ForCausalLM

    folder = tmp_path / "hf"
    # as a Gemma 3 GGUF holds it: llama.cpp's layer pattern (5 sliding per full: all 3 slide
    # here) and scale (1/√head_dim)
    ref = build_gemma3(
        folder, exact16=True, layer_types=["sliding_attention"] * 3, query_pre_attn_scalar=24
    )
    model = mlxlis.load(str(folder), dtype="float32")
    text = Gemma3ForCausalLM(ref.config.text_config).eval()
    text.model.load_state_dict(ref.model.language_model.state_dict())
    text.lm_head.weight = text.model.embed_tokens.weight
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gemma_gguf(gguf_dir / "tiny-F32.gguf", text, folder, "gemma3")
    write_gemma3(gguf_dir / "mmproj-tiny-F16.gguf", ref)
    seeing = mlxlis.load(str(gguf_dir / "tiny-F32.gguf"), dtype="float32", chat_template="gemma")
    assert seeing.vision is not None, seeing.describe()
    features_equal(model, seeing.vision, IMAGES)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "what"}],
        }
    ]
    prompt = seeing.encode_chat(messages)
    # the GGUF's vocabulary is the folder's, its BOS the config's (the tokenizer is not what
    # this test is about): the same ids after it
    assert prompt.ids[1:] == model.encode_chat(messages).ids[1:]
    ids = torch.tensor([prompt.ids])
    pixels = torch.tensor(np.stack([im.pixels for im in prompt.images]))
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == s.IMAGE).long())
        want = want.logits[0].numpy()
    got = np.array(seeing.logits(prompt.ids, images=prompt.images))
    assert np.abs(got - want).max() < 1e-4
    text_only = mlxlis.load(str(gguf_dir / "tiny-F32.gguf"), dtype="float32", mmproj=False)
    assert text_only.vision is None

    legacy = tmp_path / "legacy-mmproj.gguf"
    write_gemma3(legacy, ref, legacy=True)
    features_equal(
        model, load_mmproj(legacy, model.config, model.tokenizer, {}, mx_f32(), PROJECTORS), IMAGES
    )


def mx_f32():
    import mlx.core as mx

    return mx.float32


def test_gemma4_mmproj_gives_the_folders_features(tmp_path):
    folder = tmp_path / "hf"
    ref = build_gemma4(folder, exact16=True)
    model = mlxlis.load(str(folder), dtype="float32")
    path = tmp_path / "mmproj-g4.gguf"
    write_gemma4(path, ref)
    meta = {"tokenizer.ggml.padding_token_id": 1}
    vision = load_mmproj(path, model.config, model.tokenizer, meta, mx_f32(), PROJECTORS)
    features_equal(model, vision, IMAGES)
    assert vision.fill_id == model.vision.fill_id
    inputs = gemma4_inputs(
        folder, [{"role": "user", "content": [{"type": "image", "image": IMAGES[1]}]}]
    )
    assert inputs["input_ids"].shape[1] > 0


def test_qwen3_5_mmproj_gives_the_folders_features(tmp_path):
    folder = tmp_path / "hf"
    ref = build_qwen3_5(folder, exact16=True)
    model = mlxlis.load(str(folder), dtype="float32")
    path = tmp_path / "mmproj-q.gguf"
    write_qwen3_5(path, ref)
    meta = {"general.architecture": "qwen35", "qwen35.rope.dimension_sections": [3, 3, 2, 0]}
    vision = load_mmproj(path, model.config, model.tokenizer, meta, mx_f32(), PROJECTORS)
    features_equal(model, vision, IMAGES)
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "a"}],
        }
    ]
    prompt = model.encode_chat(msgs)
    spans = model.image_spans(prompt.ids, prompt.images)
    assert np.array_equal(
        np.array(vision.positions(spans, 0, len(prompt.ids))),
        np.array(model.vision.positions(spans, 0, len(prompt.ids))),
    )
    assert qwen3_5_inputs(folder, msgs)["input_ids"][0].tolist() == prompt.ids

    # refusals: another family's projector, another width, not an mmproj
    other = tmp_path / "mmproj-g3.gguf"
    write_gemma3(other, build_gemma3(tmp_path / "g3"))
    with pytest.raises(MlxlisError) as e:
        load_mmproj(other, model.config, model.tokenizer, meta, mx_f32(), PROJECTORS)
    assert e.value.field == "clip.projector_type" and str(other) in str(e.value)
    narrow = model.config.with_(hidden_size=model.config.hidden_size * 2)
    with pytest.raises(MlxlisError) as e:
        load_mmproj(path, narrow, model.tokenizer, meta, mx_f32(), PROJECTORS)
    assert e.value.field == "clip.vision.projection_dim"
