"""Gemma 4's vision (mlxlis/models/gemma4_vision.py) and its images in the language model,
against transformers.

What is proved here:
- preprocessing parity: Gemma4ImageProcessorPil on images made here (photograph-like RGB of
  several aspect ratios, RGBA, grayscale, a strip so thin one side rounds to 0) at Gemma 4's
  settings (16 px patches, kernel 3, 280 tokens) and the tiny model's gives exactly our patches,
  positions and soft-token counts;
- placeholder parity: `encode_chat` equals the template rendered with transformers' own
  Gemma4Processor.replace_image_token and tokenized by transformers;
- reference parity: the features (tower, pooling, standardisation, embedder, clipped linears)
  and the logits of every position of a two-image prompt, on a tiny random
  Gemma4ForConditionalGeneration with per-layer inputs and use_bidirectional_attention
  "vision" (sliding layers bidirectional over an image, full ones causal) — against the
  float64 reference, within twice the float32 reference's own distance to it (this tiny model
  amplifies rounding: transformers' float32 is 3.7e-4 from its float64) and 1e-5 for the
  text before the first image; without the image blocks the reference moves by > 1;
- use_bidirectional_attention null: the same weights with images attending causally, equal
  to the reference read that way;
- the core: chunks of 5 (the window's ring shorter than the prompt) and of 512 give
  transformers' greedy tokens, and first-token log-probabilities within 3e-4 of the one pass
  (self-consistency: the chunks and caches against the forward proved above);
- use_bidirectional_attention "all" (an encoder): the logits of every position equal
  transformers' (every position seeing every other); generating is refused naming the field;
  another value is a ConfigError.
"""

from __future__ import annotations

import json
import shutil

import mlxlis
from mlxlis.cache.prefix import PrefixCache
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.generation.core import Core, Request
from mlxlis.generation.steps import LocalSteps
from mlxlis.models.gemma4_vision import Processing

import numpy as np
import pytest
import torch
from PIL import Image
from seeing import G4_PROCESSOR, build_gemma4, gemma4_inputs
from test_gemma3_vision import photo


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-seeing")
    ref = build_gemma4(folder)
    return folder, ref, mlxlis.load(str(folder), dtype="float32")


def made() -> list[Image.Image]:
    rgba = photo(64, 40).convert("RGBA")
    rgba.putalpha(128)
    return [photo(300, 200), photo(50, 170), rgba, photo(33, 47).convert("L"), photo(400, 3)]


@pytest.mark.parametrize("kw", [{}, G4_PROCESSOR], ids=["gemma4", "tiny"])
def test_patches_equal_the_reference_processor(kw):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    ref = Gemma4ImageProcessorPil(**kw)
    ours = Processing.from_config(ref.to_dict(), "preprocessor_config.json")
    for image in made():
        want = ref(images=[image], return_tensors="np")
        patches, pos = ours.preprocess(image)
        n = len(patches)
        k = ours.pooling_kernel_size
        assert want["num_soft_tokens_per_image"][0] == n // (k * k), image.size
        assert np.array_equal(want["pixel_values"][0][:n], patches), image.size
        assert np.array_equal(want["image_position_ids"][0][:n], pos), image.size
        assert (want["image_position_ids"][0][n:] == -1).all()


def conversation(images: list[Image.Image]) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "image": images[0]},
                {"type": "text", "text": "what"},
                {"type": "image", "image": images[1]},
            ],
        }
    ]


@pytest.fixture(scope="module")
def two(seeing):
    folder, ref, model = seeing
    messages = conversation([photo(50, 40), photo(20, 64)])
    inputs = gemma4_inputs(folder, messages)
    with torch.no_grad():
        want32 = ref(**inputs).logits[0].numpy()
        ref64 = ref.double()
        doubled = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        want64 = ref64(**doubled).logits[0].numpy()
        feats = ref64.model.get_image_features(
            doubled["pixel_values"], doubled["image_position_ids"], return_dict=True
        ).pooler_output
        ref.float()
    return model.encode_chat(messages), inputs, want32, want64, feats


def test_placeholders_equal_the_processors(two):
    prompt, inputs, *_ = two
    assert prompt.ids == inputs["input_ids"][0].tolist()
    assert [im.tokens for im in prompt.images] == [63, 56]


def test_features_and_logits_equal_transformers(seeing, two):
    _, ref, model = seeing
    prompt, inputs, want32, want64, feats = two
    for image, want in zip(prompt.images, feats, strict=True):
        got = np.array(model.image_features(image))
        assert got.shape == tuple(want.shape)
        assert np.abs(got - want.numpy()).max() < 1e-4
    ours = np.array(model.logits(prompt.ids, images=prompt.images))
    floor = np.abs(want32 - want64).max()
    first = prompt.ids.index(4)
    assert np.abs(ours[:first] - want64[:first]).max() < 1e-5
    assert np.abs(ours - want64).max() < 2 * floor, (np.abs(ours - want64).max(), floor)
    kw = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        causal = ref(**kw).logits[0].numpy()
    assert np.abs(causal - want32).max() > 1.0  # the reference reads the blocks


@pytest.mark.parametrize("step", [5, 512])
def test_generation_from_images_equals_transformers(seeing, two, step):
    _, ref, model = seeing
    prompt, inputs, want32, *_ = two
    with torch.no_grad():
        greedy = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
    want_tokens = greedy[0, len(prompt.ids) :].tolist()
    # the one pass's logits equal transformers' (above); the core's chunks and caches must
    # give the same: self-consistency, bound as test_gemma4.py's chunked prefill
    one_pass = np.array(model.logits(prompt.ids, images=prompt.images)[-1])
    last = torch.log_softmax(torch.tensor(one_pass), -1).numpy()
    params = mlxlis.SamplingParams(temperature=0, max_tokens=4)
    spans = model.image_spans(prompt.ids, prompt.images)
    core = Core(model, LocalSteps(model, PrefixCache(0)), step)
    seq = core.start(Request(prompt.ids, params, top_logprobs=5, images=spans))
    events = []
    while not seq.done:
        events += [ev for _, ev in core.step([seq])]
    assert [e.token for e in events if e.token is not None] == want_tokens
    for token, logprob in events[0].top_logprobs:
        assert abs(logprob - last[token]) < 3e-4


def test_causal_images_without_bidirectional_attention(seeing, two, tmp_path):
    folder, ref, _ = seeing
    prompt, inputs, *_ = two
    causal = tmp_path / "causal"
    shutil.copytree(folder, causal)
    cfg = json.loads((causal / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = None
    (causal / "config.json").write_text(json.dumps(cfg))
    model = mlxlis.load(str(causal), dtype="float32")
    ref.config.text_config.use_bidirectional_attention = None
    try:
        with torch.no_grad():
            want = ref(**inputs).logits[0].numpy()
    finally:
        ref.config.text_config.use_bidirectional_attention = "vision"
    ours = np.array(model.logits(prompt.ids, images=prompt.images))
    assert np.abs(ours - want).max() < 2e-3

    cfg["text_config"]["use_bidirectional_attention"] = "both"
    (causal / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        mlxlis.load(str(causal), dtype="float32")
    assert e.value.field == "use_bidirectional_attention"


def test_an_encoder_reads_every_position_both_ways(seeing, two, tmp_path):
    """use_bidirectional_attention "all": every position sees every other (sliding layers
    within (window // 2) + 1 either side): the logits of the image prompt equal transformers'
    model loaded from the same config; generating from it is refused by name."""
    import transformers

    folder, _, _ = seeing
    prompt, inputs, *_ = two
    encoder = tmp_path / "encoder"
    shutil.copytree(folder, encoder)
    cfg = json.loads((encoder / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "all"
    (encoder / "config.json").write_text(json.dumps(cfg))
    ref = transformers.Gemma4ForConditionalGeneration.from_pretrained(encoder).eval()
    with torch.no_grad():
        want = ref(**inputs).logits[0].numpy()
    model = mlxlis.load(str(encoder), dtype="float32")
    ours = np.array(model.logits(prompt.ids, images=prompt.images))
    assert np.abs(ours - want).max() < 2e-3  # the tiny model's float32 floor (above)
    with pytest.raises(UnsupportedError) as e:
        list(mlxlis.generate(model, prompt, max_tokens=2))
    assert e.value.field == "use_bidirectional_attention"
