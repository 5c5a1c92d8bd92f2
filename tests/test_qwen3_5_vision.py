"""Qwen3.5's vision (mlxlis/models/qwen3_5_vision.py) and its images in the hybrid language
model, against transformers.

What is proved here:
- preprocessing parity: Qwen2VLImageProcessorPil (transformers' own, Pillow backend) on images
  made here — several sizes and aspect ratios (so several patch grids), RGBA, grayscale, one
  over the pixel budget and one under it — gives exactly our patch rows and grids;
- placeholder parity: `encode_chat` equals the template rendered with transformers' own
  Qwen3VLProcessor.replace_image_token and tokenized by transformers;
- reference parity, fp32, on a tiny random Qwen3_5ForConditionalGeneration (Gated DeltaNet
  layers, a gated full-attention layer with partial, interleaved M-RoPE): the features of two
  images of different grids, and the logits of every position of a prompt holding both,
  within 1e-4 (measured ≤ 1e-6);
- the core: prefill chunks of 5 and 512, then decoding (positions continuing from the images'
  M-RoPE shift), give transformers' generate's greedy tokens and first log-probabilities;
- a second request sharing the first's image reuses its caches past it and still equals the
  reference (the shift restored with the caches).
"""

from __future__ import annotations

import mlxlis
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core, Request
from mlxlis.generation.steps import LocalSteps
from mlxlis.models.qwen3_5_vision import Processing

import numpy as np
import pytest
import torch
from PIL import Image
from seeing import Q_IMAGE, Q_PROCESSOR, build_qwen3_5, qwen3_5_inputs
from test_gemma3_vision import photo


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35-seeing")
    ref = build_qwen3_5(folder)
    return folder, ref, mlxlis.load(str(folder), dtype="float32")


def test_patches_equal_the_reference_processor():
    from transformers import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(**Q_PROCESSOR)
    ours = Processing.from_config(ref.to_dict(), "preprocessor_config.json")
    rgba = photo(90, 60).convert("RGBA")
    rgba.putalpha(100)
    for image in (photo(70, 50), photo(300, 200), photo(33, 250), rgba, photo(40, 41).convert("L")):
        want = ref(images=[image], return_tensors="np")
        patches, rows, cols = ours.preprocess(image)
        assert want["image_grid_thw"][0].tolist() == [1, rows, cols], image.size
        assert np.array_equal(want["pixel_values"], patches), image.size


def messages(first: Image.Image, second: Image.Image, tail: str = "same?") -> list[dict]:
    parts = [
        {"type": "text", "text": "A:"},
        {"type": "image", "image": first},
        {"type": "text", "text": "B:"},
        {"type": "image", "image": second},
        {"type": "text", "text": tail},
    ]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def two(seeing):
    folder, ref, model = seeing
    msgs = messages(photo(70, 50), photo(60, 130))
    inputs = qwen3_5_inputs(folder, msgs)
    with torch.no_grad():
        want = ref(**inputs).logits[0].numpy()
    return msgs, model.encode_chat(msgs), inputs, want


def test_placeholders_and_features_equal_transformers(seeing, two, monkeypatch):
    from mlxlis.models import qwen3_5_vision

    monkeypatch.setattr(qwen3_5_vision, "QUERY_BLOCK", 48)  # the ViT's attention in blocks
    _, ref, model = seeing
    _, prompt, inputs, _ = two
    assert prompt.ids == inputs["input_ids"][0].tolist()
    assert [im.tokens for im in prompt.images] == [
        int(g.prod()) // 4 for g in inputs["image_grid_thw"]
    ]
    with torch.no_grad():
        feats = ref.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True
        ).pooler_output
    for image, want in zip(prompt.images, feats, strict=True):
        got = np.array(model.vision.tower.features(image))  # not the kept features
        assert got.shape == tuple(want.shape)
        assert np.abs(got - want.numpy()).max() < 1e-4


def test_logits_with_images_equal_transformers(seeing, two):
    _, _, model = seeing
    _, prompt, _, want = two
    got = np.array(model.logits(prompt.ids, images=prompt.images))
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("step", [5, 512])
def test_generation_from_images_equals_transformers(seeing, two, step):
    _, ref, model = seeing
    _, prompt, inputs, want = two
    with torch.no_grad():
        greedy = ref.generate(**inputs, max_new_tokens=6, do_sample=False)
    want_tokens = greedy[0, len(prompt.ids) :].tolist()
    last = torch.log_softmax(torch.tensor(want[-1]), -1).numpy()
    params = mlxlis.SamplingParams(temperature=0, max_tokens=6)
    spans = model.image_spans(prompt.ids, prompt.images)
    core = Core(model, LocalSteps(model, PrefixCache(0)), step)
    seq = core.start(Request(prompt.ids, params, top_logprobs=5, images=spans))
    events = []
    while not seq.done:
        events += [ev for _, ev in core.step([seq])]
    assert [e.token for e in events if e.token is not None] == want_tokens
    for token, logprob in events[0].top_logprobs:
        assert abs(logprob - last[token]) < 1e-4


def test_reused_caches_keep_the_images_shift(seeing, two):
    folder, ref, model = seeing
    msgs, prompt, *_ = two
    core = Core(model, LocalSteps(model, PrefixCache(1 << 30)))
    params = mlxlis.SamplingParams(temperature=0, max_tokens=1)
    spans = model.image_spans(prompt.ids, prompt.images)
    mark = spans[-1].end + 2  # past both images: where a recurrent state can return to
    seq = core.start(Request(prompt.ids, params, images=spans, snapshot_at=(mark,)))
    while not seq.done:
        core.step([seq])
    longer = messages(msgs[0]["content"][1]["image"], msgs[0]["content"][3]["image"], "same? no")
    again = model.encode_chat(longer)
    spans = model.image_spans(again.ids, again.images)
    seq = core.start(Request(again.ids, params, top_logprobs=5, images=spans))
    assert seq.usage.cached_tokens == mark  # both images reused, not read again
    events = []
    while not seq.done:
        events += [ev for _, ev in core.step([seq])]
    inputs = qwen3_5_inputs(folder, longer)
    with torch.no_grad():
        last = torch.log_softmax(ref(**inputs).logits[0, -1], -1).numpy()
    for token, logprob in events[0].top_logprobs:
        assert abs(logprob - last[token]) < 1e-4
    assert Q_IMAGE in again.ids


def test_batched_decoding_keeps_each_rows_positions(seeing, two):
    """The image request decodes in one batch beside a text-only one (each row's RoPE from
    its own cache's offset and shift): its greedy tokens are still transformers'."""
    _, ref, model = seeing
    _, prompt, inputs, _ = two
    with torch.no_grad():
        greedy = ref.generate(**inputs, max_new_tokens=6, do_sample=False)
    params = mlxlis.SamplingParams(temperature=0, max_tokens=6)
    core = Core(model, LocalSteps(model, PrefixCache(0)))
    spans = model.image_spans(prompt.ids, prompt.images)
    seeing_seq = core.start(Request(prompt.ids, params, images=spans))
    text_seq = core.start(Request(model.tokenizer.encode("hello there, how are you"), params))
    tokens = []
    while not seeing_seq.done:
        tokens += [ev.token for s, ev in core.step([seeing_seq, text_seq]) if s is seeing_seq]
    assert [t for t in tokens if t is not None] == greedy[0, len(prompt.ids) :].tolist()
