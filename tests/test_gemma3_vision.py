"""Gemma 3's vision (mlxlis/models/gemma3_vision.py) and the image preprocessing
(mlxlis/prompt/images.py), against transformers.

What is proved here:
- reference parity, fp32: a tiny random Gemma3ForConditionalGeneration's vision tower (its last
  hidden state) and its projected image embeddings (get_image_features) equal ours within
  1e-4 (measured ≤ 1e-6), on two patch grids pooled by 2 and by 3;
- preprocessing parity: Gemma3ImageProcessorPil (transformers' own, Pillow backend) on images
  made here — a photograph-like RGB, RGBA with transparency, grayscale, a palette image with
  a transparent colour, an EXIF-rotated JPEG opened as transformers' load_image opens it —
  gives exactly our pixel arrays, at Gemma 3's settings and at a small size with other
  mean, std and resampling;
- bad images are an ImageError naming the field: not an image, truncated, over Pillow's
  decompression-bomb threshold, absurdly wide, a file that is not there.
"""

from __future__ import annotations

import io

from mlxlis.models.gemma3_vision import load_gemma3_vision
from mlxlis.prompt import images
from mlxlis.prompt.images import ImageError, ImageProcessing, open_image

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

TEXT = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=24,
    vocab_size=300,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
)


def vision(image_size: int) -> dict:
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
        layer_norm_eps=1e-6,
    )


@pytest.fixture(scope="module", params=[(32, 4), (48, 4)], ids=["grid4-pool2", "grid6-pool3"])
def tiny(request, tmp_path_factory):
    """(folder, transformers model) of a tiny Gemma 3 with (image size, image tokens)."""
    import torch
    import transformers

    size, tokens = request.param
    cfg = transformers.Gemma3Config(
        text_config=TEXT, vision_config=vision(size), mm_tokens_per_image=tokens
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # the init leaves norms and projections at 0 or 1
            p.copy_(torch.randn_like(p) * 0.2)
    folder = tmp_path_factory.mktemp("gemma3v")
    model.save_pretrained(folder)
    return folder, model, size


def test_features_and_embeddings_match_transformers(tiny):
    import torch

    folder, model, size = tiny
    ours = load_gemma3_vision(folder)
    pixels = np.random.default_rng(0).uniform(-1, 1, (2, 3, size, size)).astype(np.float32)
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels), return_dict=True)
    hidden = ours.vision_tower(mx.array(pixels))
    embedded = ours(mx.array(pixels))
    want_hidden = out.last_hidden_state.numpy()
    want = out.pooler_output.numpy()
    assert hidden.shape == want_hidden.shape and embedded.shape == want.shape == (2, 4, 48)
    assert np.abs(np.array(hidden) - want_hidden).max() < 1e-4
    assert np.abs(np.array(embedded) - want).max() < 1e-4


def photo(w: int, h: int) -> Image.Image:
    """Gradients and noise, as a photograph's pixels vary."""
    rng = np.random.default_rng(w * h)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))


def made_images(tmp_path) -> dict[str, Image.Image]:
    rgba = photo(64, 90).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(64, dtype=np.uint8) * 4, (90, 1))))
    pal = photo(40, 30).convert("P", palette=Image.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    jpeg = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to view
    photo(120, 70).save(jpeg, exif=exif)
    from transformers.image_utils import load_image

    return {
        "rgb": photo(300, 200),
        "rgba": rgba,
        "gray": photo(50, 70).convert("L"),
        "palette": pal,
        "exif": (load_image(str(jpeg)), open_image(jpeg)),
    }


IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


@pytest.mark.parametrize(("side", "kw"), [(896, {}), (64, IMAGENET)], ids=["gemma3", "imagenet"])
def test_pixels_equal_the_reference_processor(side, kw, tmp_path):
    """At Gemma 3's settings (896 px, bilinear, mean = std = 0.5), and at 64 px with
    ImageNet's mean and std and bicubic resampling (so that each setting is read)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    kw = {**kw, "resample": 3} if kw else kw
    ref = Gemma3ImageProcessorPil(size={"height": side, "width": side}, **kw)
    cfg = ImageProcessing.from_config(ref.to_dict(), "preprocessor_config.json")
    for name, image in made_images(tmp_path).items():
        theirs_in, ours_in = image if isinstance(image, tuple) else (image, image)
        want = ref(images=theirs_in, return_tensors="np")["pixel_values"][0]
        got = cfg.preprocess(ours_in)
        assert got.shape == want.shape == (3, side, side), name
        assert np.array_equal(got, want), (name, float(np.abs(got - want).max()))
    assert ours_in.size == (70, 120)  # upright: the EXIF rotation applied


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    photo(w, h).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images_are_refused_naming_the_field(tmp_path, monkeypatch):
    cases = {
        "not an image": b"hello, not an image",
        "broken": png(64, 64)[:300],
        "no such file": tmp_path / "missing.png",
    }
    for why, source in cases.items():
        with pytest.raises(ImageError) as e:
            open_image(source, "messages[0].content[1]")
        assert e.value.field == "messages[0].content[1]" and why.split()[0] in str(e.value), why
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the bomb threshold, met cheaply
    with pytest.raises(ImageError, match="too many pixels"):
        open_image(png(40, 30), "image")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1 << 30)
    monkeypatch.setattr(images, "MAX_SIDE", 100)
    with pytest.raises(ImageError, match="at most 100 a side"):
        open_image(png(200, 10), "image")
