"""Images through the library and the generation core, on a tiny random multimodal Gemma 3
(tests/seeing.py) against transformers' Gemma3Processor and Gemma3ForConditionalGeneration.

What is proved here:
- reference parity, processing: `Model.encode_chat` on a conversation with two images (of
  other sizes and aspect ratios than the tower's, one RGBA) gives exactly the processor's
  input ids, pixel values and image-token positions (its token_type_ids);
- reference parity, fp32: `Model.logits(ids, images=)` equals the reference's logits
  (pixel_values and token_type_ids given, so image tokens see each other both ways) within
  1e-4 at every position; the same reference without the bidirectional blocks differs, so the
  comparison reads them;
- the core: generated from that prompt in prefill chunks of 5 (images moved whole into one
  chunk; the sliding window's ring shorter than the prompt) and of 512, the first token's
  log-probabilities equal the reference's and the greedy tokens equal transformers' generate;
- caches by content: a second chat turn about the same image reuses the caches past it; the
  same text about another image reuses nothing of the image (self-consistency: reuse counts);
- refusals: an image to a text-only model, a template that drops an image, a bad image, a
  prompt whose placeholders do not pair with its images — each an MlxlisError naming the part;
- the loader's tower keeps the last images' features (multimodal.CachedVision: call counts).
"""

from __future__ import annotations

import mlxlis
from mlxlis.cache.prefix import PrefixCache
from mlxlis.errors import MlxlisError
from mlxlis.generation.core import Core, Request
from mlxlis.generation.steps import LocalSteps

import numpy as np
import pytest
from PIL import Image
from seeing import IMAGE, build_gemma3, processor
from test_gemma3_vision import photo


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    """(folder, transformers model, mlxlis Model) of the tiny multimodal Gemma 3."""
    folder = tmp_path_factory.mktemp("gemma3-seeing")
    ref = build_gemma3(folder)
    return folder, ref, mlxlis.load(str(folder), dtype="float32")


def rgba(w: int, h: int) -> Image.Image:
    out = photo(w, h).convert("RGBA")
    out.putalpha(Image.fromarray(np.tile(np.arange(w, dtype=np.uint8) * (255 // w), (h, 1))))
    return out


def conversation(first: Image.Image, second: Image.Image) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "image": first},
                {"type": "text", "text": "what is it"},
            ],
        },
        {"role": "assistant", "content": "a cat"},
        {
            "role": "user",
            "content": [{"type": "image", "image": second}, {"type": "text", "text": "and this"}],
        },
    ]


@pytest.fixture(scope="module")
def two_images(seeing):
    """(prompt, messages, the reference's inputs) for a two-image conversation."""
    folder, _, model = seeing
    messages = conversation(photo(50, 40), rgba(20, 64))
    prompt = model.encode_chat(messages)
    theirs = processor(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    return prompt, messages, theirs


def test_encode_chat_equals_the_processor(two_images):
    prompt, _, theirs = two_images
    assert prompt.ids == theirs["input_ids"][0].tolist()
    pixels = theirs["pixel_values"].numpy()
    assert len(prompt.images) == 2 and pixels.shape == (2, 3, 32, 32)
    for ours, want in zip(prompt.images, pixels, strict=True):
        assert np.array_equal(ours.pixels, want)
    types = theirs["token_type_ids"][0].numpy()
    assert np.array_equal(np.flatnonzero(types), np.flatnonzero(np.array(prompt.ids) == IMAGE))


def reference_logits(ref, theirs, blocks: bool = True) -> np.ndarray:
    import torch

    kw = {"token_type_ids": theirs["token_type_ids"]} if blocks else {}
    with torch.no_grad():
        out = ref(input_ids=theirs["input_ids"], pixel_values=theirs["pixel_values"], **kw)
    return out.logits[0].numpy()


def test_logits_with_images_equal_transformers(seeing, two_images):
    _, ref, model = seeing
    prompt, _, theirs = two_images
    ours = np.array(model.logits(prompt.ids, images=prompt.images))
    want = reference_logits(ref, theirs)
    assert ours.shape == want.shape
    assert np.abs(ours - want).max() < 1e-4
    causal_only = reference_logits(ref, theirs, blocks=False)
    assert np.abs(causal_only - want).max() > 1e-2  # the blocks change the reference


@pytest.mark.parametrize("step", [5, 512])
def test_generation_from_images_equals_transformers(seeing, two_images, step):
    import torch

    _, ref, model = seeing
    prompt, _, theirs = two_images
    with torch.no_grad():
        greedy = ref.generate(**theirs, max_new_tokens=6, do_sample=False)
    want_tokens = greedy[0, len(prompt.ids) :].tolist()
    last = torch.log_softmax(torch.tensor(reference_logits(ref, theirs)[-1]), -1).numpy()
    params = mlxlis.SamplingParams(temperature=0, max_tokens=6)
    req = Request(
        prompt.ids, params, top_logprobs=5, images=model.image_spans(prompt.ids, prompt.images)
    )
    core = Core(model, LocalSteps(model, PrefixCache(0)), step)
    seq, events = core.start(req), []
    while not seq.done:
        events += [ev for _, ev in core.step([seq])]
    tokens = [e.token for e in events if e.token is not None]
    assert tokens == want_tokens
    first = events[0]
    assert abs(first.logprob - last[first.token]) < 1e-4
    for token, logprob in first.top_logprobs:
        assert abs(logprob - last[token]) < 1e-4


def test_chat_reuses_the_caches_past_the_same_image_only(seeing):
    _, _, model = seeing
    cat, dog = photo(50, 40), photo(40, 50)
    ask = [{"type": "text", "text": "hello"}, {"type": "image", "image": cat}]
    session = mlxlis.ChatSession(model, sampling=mlxlis.SamplingParams(temperature=0, max_tokens=3))
    list(session.send(ask))
    image_end = session.model.encode_chat(session.messages[:1]).ids.index(IMAGE) + 4
    list(session.send("and now"))
    assert session.last_reused_tokens > image_end  # the image not read again

    core = Core(model, LocalSteps(model, PrefixCache(1 << 30)))
    used = []
    for image in (cat, dog, cat):
        parts = [{"type": "image", "image": image}, {"type": "text", "text": "tell"}]
        p = model.encode_chat([{"role": "user", "content": parts}])
        params = mlxlis.SamplingParams(temperature=0, max_tokens=2)
        after = p.ids.index(IMAGE) + 6  # past the image (a ring returns to its snapshots)
        spans = model.image_spans(p.ids, p.images)
        req = Request(p.ids, params, images=spans, snapshot_at=(after,))
        seq = core.start(req)
        used.append(seq.usage.cached_tokens)
        while not seq.done:
            core.step([seq])
    start = p.ids.index(IMAGE)
    assert used[1] <= start  # another image: nothing of it reused
    assert used[2] == start + 6  # the first image again: reused past it


def test_images_refused_clearly(seeing, tiny, tmp_path):
    _, _, model = seeing
    text_only = mlxlis.load(str(tiny("llama")[0]), dtype="float32", chat_template="chatml")
    part = [{"role": "user", "content": [{"type": "image", "image": photo(8, 8)}]}]
    with pytest.raises(MlxlisError) as e:
        text_only.encode_chat(part)
    assert e.value.field == "messages[0].content[0]" and "text-only" in str(e.value)
    system = [{"type": "text", "text": "be brief"}, {"type": "image", "image": photo(8, 8)}]
    with pytest.raises(MlxlisError) as e:  # Gemma's template reads a system's first text only
        model.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        )
    assert e.value.field == "messages" and "image markers" in str(e.value)
    bad = [{"type": "text", "text": "a"}, {"type": "image", "image": b"not an image"}]
    with pytest.raises(MlxlisError) as e:
        model.encode_chat([{"role": "user", "content": bad}])
    assert e.value.field == "messages[0].content[1]"
    prompt = model.encode_chat(conversation(photo(9, 9), photo(9, 9)))
    with pytest.raises(MlxlisError) as e:
        model.logits(prompt.ids, images=prompt.images[:1])
    assert e.value.field == "images" and "2 image placeholder runs for 1" in str(e.value)


def test_chat_app_attaches_an_image_to_the_next_message(seeing, tmp_path):
    """The chat app's /image: a bad path is an error notification naming it; an image is an
    attachment note with the image drawn (half-block cells of its pixels), shown in the
    user's bubble and sent first in the next message, which
    reaches the model (the prompt's token count is the processor's for that message); the
    saved record names it. Real app, real ChatSession, the tiny multimodal Gemma 3."""
    import asyncio

    from test_tui import SIZE, bubbles, errors, record_notes, wait_for

    from tui.app import ChatApp
    from tui.engine import Options
    from tui.widgets import Thumbnail

    folder, _, _ = seeing
    path = tmp_path / "cat.png"
    photo(50, 40).save(path)
    sampling = mlxlis.SamplingParams(temperature=0.0, max_tokens=3)
    opts = Options(model=str(folder), sampling=sampling, dtype="float32")
    app = record_notes(ChatApp(opts, data_dir=tmp_path / "conversations"))
    parts = [{"type": "image", "image": Image.open(path)}, {"type": "text", "text": "what"}]
    want = processor(folder).apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=True
    )

    async def scenario(pilot):
        await wait_for(pilot, lambda: app.engine is not None or app.notes, 120, "model load")
        app.prompt_input.insert(f"/image {tmp_path / 'missing.png'}")
        await pilot.press("enter")
        await wait_for(pilot, lambda: errors(app), 10, "the refusal")
        assert "no such file" in errors(app)[-1]
        app.prompt_input.clear()
        app.prompt_input.insert(f"/image {path}")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.engine.attachments, 10, "the attachment")
        assert app.engine.attachments[0].size == (50, 40)
        (thumb,) = app.query(Thumbnail)  # the image drawn: 2 pixels a cell, upper over lower
        lines = thumb.cells(Image.open(path), 32).split("\n")
        assert len(lines) == round(40 * 32 / 50 / 2) and all(len(x) == 32 for x in lines)
        small = Image.open(path).convert("RGB").resize((32, 2 * len(lines)), Image.BILINEAR)
        span = lines[3].spans[5].style
        assert span.color.triplet == small.getpixel((5, 6))
        assert span.bgcolor.triplet == small.getpixel((5, 7))
        preview = app.engine.preview("what")  # F2: the attached image's placeholders expanded
        assert preview.count("<image_soft_token>") == 4 and preview.count("<start_of_image>") == 1
        app.prompt_input.insert("what")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 2 and not app.generating, 60)
        assert "[image: cat.png, 50 x 40]" in bubbles(app, "user")[-1].text
        assert app.engine.session.last_prompt_tokens == len(want[0])
        assert not app.engine.attachments  # sent with that message only
        rec = app.engine.record("r")
        assert rec["turns"][0]["content"] == "[image: cat.png, 50 x 40]\nwhat"

    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)

    asyncio.run(main())


def test_one_shot_command_takes_images(seeing, tmp_path):
    """`mlxlis -m MODEL --image FILE "…"` (a real process): greedy, its reply is transformers'
    greedy generation on the same message (the image first, as --image puts it); a file that
    is not an image exits 2 naming the flag; `inspect --json` says how the model sees."""
    import json
    import subprocess
    import sys

    from mlxlis.tokenizer import Tokenizer

    import torch

    folder, ref, _ = seeing
    path, bad = tmp_path / "cat.png", tmp_path / "bad.png"
    photo(50, 40).save(path)
    bad.write_bytes(b"not a png")
    parts = [{"type": "image", "image": Image.open(path)}, {"type": "text", "text": "what"}]
    inputs = processor(folder).apply_chat_template(
        [{"role": "user", "content": parts}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        greedy = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
    want = Tokenizer.from_folder(folder).decode(greedy[0, inputs["input_ids"].shape[1] :].tolist())
    cmd = [sys.executable, "-m", "mlxlis", "-m", str(folder), "--dtype", "float32"]
    cmd += ["--temp", "0", "--max-tokens", "4"]
    out = subprocess.run([*cmd, "--image", str(path), "what"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    out = subprocess.run([*cmd, "--image", str(bad), "what"], capture_output=True, text=True)
    assert out.returncode == 2 and f"--image {bad}: not an image" in out.stderr, out.stderr
    inspect = [sys.executable, "-m", "mlxlis", "inspect", str(folder), "--json"]
    report = json.loads(subprocess.run(inspect, capture_output=True, text=True).stdout)
    assert report["vision"] == "SigLIP 32 px, 4 tokens per image"  # how it sees, in words


def test_pan_and_scan_equals_the_processor(seeing, tmp_path):
    """With do_pan_and_scan in the processor's settings, a wide and a tall image are each
    read whole and in crops along their long side: ids (Gemma3Processor's "Here is the
    original image … and here are some crops …"), pixels and logits equal transformers'."""
    import json
    import shutil

    import torch

    folder, ref, _ = seeing
    scan = tmp_path / "scan"
    shutil.copytree(folder, scan)
    settings = json.loads((scan / "preprocessor_config.json").read_text())
    settings.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    (scan / "preprocessor_config.json").write_text(json.dumps(settings))
    model = mlxlis.load(str(scan), dtype="float32")
    parts = [
        {"type": "image", "image": photo(90, 30)},
        {"type": "text", "text": "and"},
        {"type": "image", "image": photo(30, 100)},
    ]
    messages = [{"role": "user", "content": parts}]
    prompt = model.encode_chat(messages)
    theirs = processor(scan).apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=8,
    )
    assert prompt.ids == theirs["input_ids"][0].tolist()
    pixels = theirs["pixel_values"].numpy()
    assert len(prompt.images) == len(pixels) == 2 + 3 + 3  # each whole, then its crops
    assert all(np.array_equal(a.pixels, b) for a, b in zip(prompt.images, pixels, strict=True))
    assert prompt.sources == (0, 0, 0, 0, 1, 1, 1, 1)
    with torch.no_grad():
        want = ref(**theirs).logits[0].numpy()
    assert np.abs(np.array(model.logits(prompt.ids, images=prompt.images)) - want).max() < 1e-4


def test_a_loaded_tower_keeps_the_last_images_features(seeing):
    """The loader's tower (multimodal.CachedVision) runs an image through the tower once while
    it is among the last FEATURES_KEPT asked for, and again once it fell out (self-consistency:
    call counts and the same features)."""
    from mlxlis.models.multimodal import FEATURES_KEPT, CachedVision, PromptImage

    import mlx.core as mx

    class Counting:
        def __init__(self):
            self.calls = 0

        def features(self, image):
            self.calls += 1
            return mx.full((image.tokens, 4), float(image.pixels[0, 0]))

    _, _, model = seeing
    assert isinstance(model.vision, CachedVision)
    tower = Counting()
    kept = CachedVision(tower)
    images = [PromptImage.of(np.full((2, 2), k), (2, 2), 3) for k in range(FEATURES_KEPT + 1)]
    first = kept.features(images[0])
    for image in images[1:FEATURES_KEPT]:
        kept.features(image)
    assert kept.features(images[0]) is first and tower.calls == FEATURES_KEPT
    kept.features(images[FEATURES_KEPT])  # images[1], the oldest now, falls out
    kept.features(images[1])
    assert tower.calls == FEATURES_KEPT + 2
