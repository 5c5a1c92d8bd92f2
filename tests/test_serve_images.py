"""Images through the server's APIs: a real `mlxlis serve` process on the tiny multimodal
Gemma 3 (tests/seeing.py), driven by the official `openai`, `anthropic` and `ollama` clients.

What is proved here:
- reference parity through each surface: an OpenAI data-URL image, an Anthropic base64 image
  block and Ollama `images` reach the model — the prompt's token count is transformers'
  Gemma3Processor's for the same conversation, and the first token's log-probability (OpenAI,
  Ollama) equals transformers' Gemma3ForConditionalGeneration's on the processor's inputs;
  Anthropic's greedy reply equals the reference's greedy generation;
- batching mixes requests with and without images: sent at once, the image request's
  log-probabilities still equal the reference's;
- bad images are 400s naming the part in each API's own shape: not an image, broken base64,
  a truncated PNG, an http URL without --allow-image-urls, more images than the context holds;
- an image URL is fetched (real HTTP, a local server) within the size limit; a missing or
  oversized one, a redirect to another scheme and a malformed URL are refused naming the field.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
from concurrent.futures import ThreadPoolExecutor

from mlxlis.serve import images as image_urls
from mlxlis.serve.openai_format import APIError

import anthropic
import numpy as np
import ollama
import openai
import pytest
from PIL import Image
from seeing import build_gemma3, processor
from serve_process import ServeProcess
from test_gemma3_vision import photo

MODEL = "seeing"
CONTEXT = 96


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


CAT = png(photo(50, 40))
CAT64 = base64.b64encode(CAT).decode()


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    """(served process, transformers model, folder)."""
    tmp = tmp_path_factory.mktemp("serve-seeing")
    folder = tmp / MODEL
    ref = build_gemma3(folder)
    srv = ServeProcess(tmp, "-m", str(folder), "--dtype", "float32", "--max-context", str(CONTEXT))
    yield srv, ref, folder
    assert srv.stop() == 0, srv.log()


def reference(ref, folder, parts: list[dict]):
    """(prompt ids, log-probabilities of the first token, greedy ids) of transformers on one
    user turn of `parts` (images as PIL images)."""
    import torch

    messages = [{"role": "user", "content": parts}]
    inputs = processor(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = ref(**inputs).logits[0, -1]
        greedy = ref.generate(**inputs, max_new_tokens=3, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, torch.log_softmax(logits, -1).numpy(), greedy[0, len(ids) :].tolist()


CAT_PARTS = [
    {"type": "image", "image": Image.open(io.BytesIO(CAT))},
    {"type": "text", "text": "what is it"},
]


@pytest.fixture(scope="module")
def cat_reference(seeing):
    srv, ref, folder = seeing
    return reference(ref, folder, CAT_PARTS)


def openai_cat(client):
    url = "data:image/png;base64," + CAT64
    return client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "what is it"},
                ],
            }
        ],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )


def test_openai_image_reaches_the_model(seeing, cat_reference):
    srv = seeing[0]
    ids, logprobs, _ = cat_reference
    client = srv.client()
    with ThreadPoolExecutor(3) as pool:  # two text requests decode beside the image one
        text = [
            pool.submit(
                client.chat.completions.create,
                model=MODEL,
                messages=[{"role": "user", "content": "hello there"}],
                max_tokens=8,
            )
            for _ in range(2)
        ]
        reply = openai_cat(client)
        assert all(t.result().choices[0].finish_reason for t in text)
    assert reply.usage.prompt_tokens == len(ids)
    tops = reply.choices[0].logprobs.content[0].top_logprobs
    assert_top(seeing[2], [(t.token, t.logprob) for t in tops], logprobs)


def assert_top(folder, got: list[tuple[str, float]], logprobs: np.ndarray) -> None:
    """The served top tokens (text, log-probability) are the reference's top ones."""
    from mlxlis.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    want = [(tok.decode([int(i)]), float(logprobs[i])) for i in np.argsort(-logprobs)[: len(got)]]
    assert [t for t, _ in got] == [t for t, _ in want], (got, want)
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) < 1e-4


def test_anthropic_image_block_reaches_the_model(seeing, cat_reference):
    srv, _, folder = seeing
    ids, _, greedy = cat_reference
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.port}", api_key="x")
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": CAT64},
    }
    messages = [{"role": "user", "content": [block, {"type": "text", "text": "what is it"}]}]
    count = client.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens == len(ids)
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=messages)  # --temp 0
    from mlxlis.tokenizer import Tokenizer

    want = Tokenizer.from_folder(folder).decode(greedy)
    assert reply.content[0].text == want
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == len(ids)


def test_ollama_images_reach_the_model(seeing, tmp_path):
    srv, ref, folder = seeing
    image = photo(30, 60)
    path = tmp_path / "tall.png"
    image.save(path)
    ids, logprobs, _ = reference(
        ref,
        folder,
        [{"type": "image", "image": Image.open(path)}, {"type": "text", "text": "and this"}],
    )
    client = ollama.Client(host=f"http://127.0.0.1:{srv.port}", timeout=120)
    out = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "and this", "images": [str(path)]}],
        options={"temperature": 0, "num_predict": 1},
        logprobs=True,
        top_logprobs=3,
    )
    assert out.prompt_eval_count == len(ids)
    assert_top(folder, [(t.token, t.logprob) for t in out.logprobs[0].top_logprobs], logprobs)


def test_bad_images_are_400s_naming_the_part(seeing):
    srv = seeing[0]
    client = srv.client()
    broken = base64.b64encode(CAT[:200]).decode()
    cases = [
        (
            "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
            "messages[0].content[1]",
        ),
        ("data:image/png;base64," + broken, "messages[0].content[1]"),
        ("data:image/png;base64,@@@", "messages[0].content[1].image_url.url"),
        ("http://127.0.0.1:9/cat.png", "messages[0].content[1].image_url.url"),  # no flag
    ]
    for url, param in cases:
        parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=1
            )
        assert e.value.body["param"] == param, (url, e.value.body)
    many = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + CAT64}}] * 12
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": many}], max_tokens=1
        )
    assert e.value.body["param"].startswith("messages[0].content[")
    assert e.value.body["code"] == "context_length_exceeded"
    tiny = "data:image/png;base64," + base64.b64encode(png(photo(2, 2))).decode()
    flood = [{"type": "image_url", "image_url": {"url": tiny}}] * 17
    with pytest.raises(openai.BadRequestError) as e:  # refused before any is read
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": flood}], max_tokens=1
        )
    assert e.value.body["param"] == "messages[0].content[16]"

    a = anthropic.Anthropic(base_url=f"http://127.0.0.1:{srv.port}", api_key="x")
    for source, param in [
        (
            {"type": "base64", "media_type": "image/png", "data": "@@"},
            "messages[0].content[1].source.data",
        ),
        ({"type": "base64", "media_type": "image/png", "data": broken}, "messages[0].content[1]"),
    ]:
        blocks = [{"type": "text", "text": "see"}, {"type": "image", "source": source}]
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(
                model=MODEL, max_tokens=1, messages=[{"role": "user", "content": blocks}]
            )
        assert e.value.body["error"]["message"].startswith(param + ":"), e.value.body

    o = ollama.Client(host=f"http://127.0.0.1:{srv.port}", timeout=120)
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model=MODEL, messages=[{"role": "user", "content": "x", "images": [broken]}])
    assert e.value.status_code == 400 and e.value.error.startswith("messages[0].images[0]:")


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/elsewhere.png":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/cat.png")
            self.end_headers()
            return
        if self.path != "/cat.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(CAT)))
        self.end_headers()
        self.wfile.write(CAT)

    def log_message(self, *args):
        pass


def test_image_urls_are_fetched_within_limits(monkeypatch):
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{host.server_address[1]}"
    try:
        url = image_urls.fetch(f"{base}/cat.png", "p")
        assert url.startswith("data:image/png;base64,")
        assert image_urls.image_bytes(url, "p") == CAT
        with pytest.raises(APIError) as e:
            image_urls.fetch(f"{base}/missing.png", "messages[0].content[0].image_url.url")
        assert e.value.param == "messages[0].content[0].image_url.url" and "404" in e.value.message
        for bad in (f"{base}/elsewhere.png", "http://127.0.0.1:abc/x.png"):  # ftp, no port
            with pytest.raises(APIError) as e:
                image_urls.fetch(bad, "p")
            assert e.value.status == 400 and e.value.param == "p", bad
        monkeypatch.setattr(image_urls, "MAX_IMAGE_BYTES", 100)
        with pytest.raises(APIError, match="over"):
            image_urls.fetch(f"{base}/cat.png", "p")
    finally:
        host.shutdown()


def test_responses_input_image_reaches_the_model(seeing, cat_reference):
    """The Responses API's input_image (a data URL): the prompt is the processor's length and
    the greedy reply the reference's; a file_id image is refused naming its field."""
    srv, _, folder = seeing
    ids, _, greedy = cat_reference
    from mlxlis.tokenizer import Tokenizer

    client = srv.client()
    url = "data:image/png;base64," + CAT64
    content = [
        {"type": "input_image", "image_url": url},
        {"type": "input_text", "text": "what is it"},
    ]
    reply = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=3
    )
    assert reply.usage.input_tokens == len(ids)
    assert reply.output_text == Tokenizer.from_folder(folder).decode(greedy)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
        )
    assert e.value.body["param"] == "input[0].content[0].image_url", e.value.body
