"""A real multimodal checkpoint against transformers, when MLXLIS_VISION_MODEL names its folder
(none ships on the package registries the test machines reach: skipped otherwise).

What is proved: on two images made here (a photograph-like one and a screenshot-like one),
`encode_chat` gives transformers' AutoProcessor's input ids, and the log-probabilities of the
next token after the prompt equal AutoModelForImageTextToText's in float32 within 1e-3.
"""

from __future__ import annotations

import os

import mlxlis

import numpy as np
import pytest
from PIL import Image, ImageDraw
from test_gemma3_vision import photo

FOLDER = os.environ.get("MLXLIS_VISION_MODEL")
pytestmark = pytest.mark.skipif(
    not FOLDER, reason="MLXLIS_VISION_MODEL names no multimodal checkpoint folder"
)


def screenshot() -> Image.Image:
    image = Image.new("RGB", (640, 360), "white")
    draw = ImageDraw.Draw(image)
    for i in range(8):
        draw.rectangle((20, 20 + 40 * i, 600, 50 + 40 * i), outline="black")
        draw.text((30, 28 + 40 * i), f"row {i}: value {i * i}", fill="black")
    return image


def test_real_checkpoint_equals_transformers():
    import torch
    import transformers

    model = mlxlis.load(FOLDER, dtype="float32")
    assert model.vision is not None, model.describe()
    content = [
        {"type": "image", "image": photo(300, 200)},
        {"type": "image", "image": screenshot()},
        {"type": "text", "text": "What do these show?"},
    ]
    messages = [{"role": "user", "content": content}]
    prompt = model.encode_chat(messages)
    processor = transformers.AutoProcessor.from_pretrained(FOLDER)
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert prompt.ids == inputs["input_ids"][0].tolist()
    ref = transformers.AutoModelForImageTextToText.from_pretrained(FOLDER, dtype=torch.float32)
    with torch.no_grad():
        want = torch.log_softmax(ref(**inputs).logits[0, -1], -1).numpy()
    got = np.array(model.logits(prompt.ids, images=prompt.images)[-1])
    got = got - np.log(np.exp(got - got.max()).sum()) - got.max()
    assert np.abs(got - want).max() < 1e-3
