"""Gemma 3n hears, through every surface: a hub-shaped tiny folder (tokenizer, processor
settings, chat template) loaded by mlxlis.load against transformers' Gemma3nProcessor and
Gemma3nForConditionalGeneration (ids, logits, greedy generation); OpenAI chat's input_audio
and /v1/audio/transcriptions through a real server with the openai client against the
library; the CLI's --audio."""

from __future__ import annotations

from mlxlis.prompt.audio import AudioError

import numpy as np
import pytest
import torch
from test_audio import signal
from test_gemma3n_audio import build_wrapped

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'audio' %}<audio_soft_token>{% elif p.type == 'text' %}{{ p.text }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SPECIAL = {
    "image_token": "<image_soft_token>",
    "eoa_token": "<end_of_audio>",
    "audio_token": "<audio_soft_token>",
}


@pytest.fixture(scope="module")
def heard(tmp_path_factory):
    """A tiny Gemma 3n folder that hears, as a hub folder holds it: the wrapper's weights, a
    tokenizer whose last ids are the image soft token, <end_of_audio> and <audio_soft_token>
    (the vision and audio vocabularies' ranges, as on the hub), <start_of_audio> a text id,
    the feature extractor's preprocessor_config.json and a chat template writing the audio
    marker. Returns (folder, transformers model, Gemma3nProcessor)."""
    from conftest import train_tokenizer
    from transformers import (
        Gemma3nAudioFeatureExtractor,
        Gemma3nProcessor,
        PreTrainedTokenizerFast,
        SiglipImageProcessor,
    )

    folder = tmp_path_factory.mktemp("heard")
    train_tokenizer(folder, extra_special=("<start_of_audio>",))
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL.values())})
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    vocab = len(tok)
    assert ids["audio_token"] == vocab - 1 and ids["eoa_token"] == vocab - 2
    tok = PreTrainedTokenizerFast.from_pretrained(
        folder,
        # the image markers the processor also wants, unused here: two ChatML tokens
        extra_special_tokens={
            **SPECIAL,
            "boa_token": "<start_of_audio>",
            "boi_token": "<|im_start|>",
            "eoi_token": "<|endoftext|>",
        },
        additional_special_tokens=list(SPECIAL.values()),
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    with pytest.MonkeyPatch.context() as mp:
        ref, cfg = build_wrapped(folder, mp, vocab=vocab)
    extractor = Gemma3nAudioFeatureExtractor()
    extractor.save_pretrained(folder)
    processor = Gemma3nProcessor(
        feature_extractor=extractor,
        image_processor=SiglipImageProcessor(),
        tokenizer=tok,
        chat_template=TEMPLATE,
    )
    return folder, ref, processor


def test_folder_hears_as_transformers_does(heard):
    """Proves, through mlxlis.load on a hub-shaped folder: the audio tower is loaded (no longer
    skipped); encode_chat with an audio part (a 2.1 s stereo 44.1 kHz chirp + tone WAV, and the
    same as OpenAI's base64 input_audio) gives the ids Gemma3nProcessor gives for the same text
    (its audio expansion), and a clip past the processor's 30 s is refused naming its part
    (not cut); the logits after the audio equal Gemma3nForConditionalGeneration's
    on the processor's own features within 1e-4 (relative); greedy generation equals
    transformers' generate, prefilled in chunks."""
    import base64

    import mlxlis
    from mlxlis.generation.generate import generate

    from test_audio import encoded, reference_samples

    folder, ref, processor = heard
    model = mlxlis.load(folder, "float32")
    assert not any("audio" in n for n in model.skipped) and model.hearing is not None
    stereo = np.stack([signal("chirp", 44100, 2.1), signal("tone", 44100, 2.1)], axis=1)
    data = encoded(stereo, 44100)
    parts = [{"type": "text", "text": "what is said?"}, {"type": "audio", "audio": data}]
    messages = [{"role": "user", "content": parts}]
    prompt = model.encode_chat(messages)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = processor(text=text, audio=[reference_samples(data, 16000)], return_tensors="pt")
    assert prompt.ids == want["input_ids"][0].tolist()
    b64 = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode()}}
    again = model.encode_chat([{"role": "user", "content": [parts[0], b64]}])
    assert again.ids == prompt.ids and again.images[0].digest == prompt.images[0].digest
    long = [parts[0], {"type": "audio", "audio": encoded(signal("tone", 8000, 30.5), 8000)}]
    with pytest.raises(AudioError, match="at most 30 s") as e:
        model.encode_chat([{"role": "user", "content": long}])
    assert e.value.field == "messages[0].content[1]"
    with torch.no_grad():
        logits = ref(**want).logits[0].numpy()
    got = np.array(model.logits(prompt.ids, prompt.images))
    assert np.abs(got - logits).max() / np.abs(logits).max() < 1e-4
    with torch.no_grad():
        out = ref.generate(**want, max_new_tokens=8, do_sample=False)
    expected = out[0, len(prompt.ids) :].tolist()
    # prefilled in chunks of 64: the audio's run is never split (the core's image rule)
    events = generate(model, prompt, max_tokens=len(expected), temperature=0.0, prefill_step=64)
    assert [e.token for e in events if e.token is not None] == expected


@pytest.fixture(scope="module")
def served(heard, tmp_path_factory):
    """(the heard folder served by a real `mlxlis serve`, an openai client of it, the folder
    loaded by the library)."""
    import mlxlis

    import openai
    from serve_process import ServeProcess

    folder = heard[0]
    srv = ServeProcess(tmp_path_factory.mktemp("served"), "-m", str(folder))
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")
        yield srv, client, mlxlis.load(folder, "float32")
    finally:
        assert srv.stop() == 0, srv.log()


def library_transcript(model, file, ask: str) -> str:
    """The library's greedy reply to `file` and `ask`, as a transcription window's."""
    from mlxlis.generation.generate import generate
    from mlxlis.serve.transcriptions import WINDOW_TOKENS

    parts = [{"type": "audio", "audio": str(file)}, {"type": "text", "text": ask}]
    prompt = model.encode_chat([{"role": "user", "content": parts}])
    events = generate(model, prompt, temperature=0.0, max_tokens=WINDOW_TOKENS)
    return "".join(e.text for e in events if e.text).strip()


def test_server_chat_hears_input_audio(served):
    """Proves OpenAI chat's input_audio part (base64 + format), sent by the openai client to a
    real `mlxlis serve`, reaches the model through the one request builder: the greedy reply
    equals the library's for the same messages; bad base64 is a 400 naming its field."""
    import base64

    from mlxlis.generation.generate import generate

    import openai
    from test_audio import encoded

    srv, client, model = served
    data = encoded(signal("chirp", 16000, 1.3), 16000, "FLAC", "PCM_16")
    b64 = base64.b64encode(data).decode()
    text = {"type": "text", "text": "what is said?"}
    audio = {"type": "input_audio", "input_audio": {"data": b64, "format": "flac"}}
    prompt = model.encode_chat([{"role": "user", "content": [text, audio]}])
    events = list(generate(model, prompt, max_tokens=6, temperature=0.0))
    want = "".join(e.text for e in events if e.text)
    assert want  # a reply to compare
    reply = client.chat.completions.create(
        model=srv.model,
        messages=[{"role": "user", "content": [text, audio]}],
        max_tokens=6,
        temperature=0.0,
    )
    assert reply.choices[0].message.content == want
    broken = {"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": [text, broken]}]
        )
    assert e.value.body["param"] == "messages[0].content[1].input_audio.data"


def transcribe(served, path, **kw):
    srv, client, _ = served
    with open(path, "rb") as f:
        return client.audio.transcriptions.create(
            model=srv.model, file=f, language="en", temperature=0.0, **kw
        )


# a real server, every response format: make test-all (Voxtral's server test runs the endpoint
# in make test)
@pytest.mark.extended
def test_server_transcribes_as_the_library_does(served, tmp_path):
    """Proves `POST /v1/audio/transcriptions`, called by the openai client's
    `client.audio.transcriptions.create` on a real `mlxlis serve`, returns what the library
    generates (greedy) for the same file and Gemma's documented transcription prompt, in every
    response_format (json, text, verbose_json, srt, vtt: the same text, a cue spanning the
    clip); a `prompt` replaces the instruction; a file that is not audio is a 400 naming
    `file`."""
    from mlxlis.serve.transcriptions import INSTRUCTION

    import openai
    from test_audio import encoded

    srv, client, model = served
    path = tmp_path / "said.wav"
    path.write_bytes(encoded(signal("chirp", 16000, 2.5), 16000))
    want = library_transcript(model, path, INSTRUCTION.format(language="English"))
    assert want
    assert transcribe(served, path).text == want
    assert transcribe(served, path, response_format="text") == want
    verbose = transcribe(served, path, response_format="verbose_json")
    assert verbose.text == want and verbose.duration == 2.5
    srt = transcribe(served, path, response_format="srt")
    assert srt == f"1\n00:00:00,000 --> 00:00:02,500\n{want}\n"
    vtt = transcribe(served, path, response_format="vtt")
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> 00:00:02.500\n{want}\n"
    said = transcribe(served, path, prompt="Say what you hear.").text
    assert said == library_transcript(model, path, "Say what you hear.")
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model=srv.model, file=("x.wav", b"not audio"))
    assert e.value.body["param"] == "file"


@pytest.mark.extended
def test_server_transcribes_long_audio_window_by_window(served, tmp_path):
    """Proves 34 s of 8 kHz audio is transcribed as two windows (30 s and 4 s of its 16 kHz
    samples), each as the library transcribes that window alone, their replies joined and
    each a verbose_json segment with its times."""
    from mlxlis.serve.transcriptions import INSTRUCTION

    from test_audio import encoded, reference_samples

    model = served[2]
    path = tmp_path / "long.wav"
    path.write_bytes(encoded(signal("chirp", 8000, 34.0), 8000))
    at16 = reference_samples(path.read_bytes(), 16000)
    wants = []
    for k, window in enumerate((at16[:480_000], at16[480_000:])):
        (tmp_path / f"w{k}.wav").write_bytes(encoded(window, 16000))
        ask = INSTRUCTION.format(language="English")
        wants.append(library_transcript(model, tmp_path / f"w{k}.wav", ask))
    verbose = transcribe(served, path, response_format="verbose_json")
    got = [(x.start, x.end, x.text) for x in verbose.segments]
    assert got == [(0.0, 30.0, wants[0]), (30.0, 34.0, wants[1])]
    assert verbose.text == " ".join(wants)


@pytest.mark.extended  # two processes that load the model: the suite's budget
def test_cli_audio_flag_equals_transformers(heard, tmp_path):
    """Proves `mlxlis -m M --audio FILE "…"` prints transformers' greedy reply to the same
    chat (the processor's ids and features of the file's samples at 16 kHz), and a file that
    is not audio is refused naming the flag and file (exit 2)."""
    import subprocess
    import sys

    from mlxlis.tokenizer import Tokenizer

    from test_audio import encoded, reference_samples

    folder, ref, processor = heard
    path, bad = tmp_path / "said.ogg", tmp_path / "bad.wav"
    path.write_bytes(encoded(signal("chirp", 48000, 1.1), 48000, "OGG", "VORBIS"))
    bad.write_bytes(b"RIFF not really")
    parts = [{"type": "audio", "audio": "x"}, {"type": "text", "text": "what"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    samples = reference_samples(path.read_bytes(), 16000)
    inputs = processor(text=text, audio=[samples], return_tensors="pt")
    with torch.no_grad():
        greedy = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
    want = Tokenizer.from_folder(folder).decode(greedy[0, inputs["input_ids"].shape[1] :].tolist())
    cmd = [sys.executable, "-m", "mlxlis", "-m", str(folder), "--dtype", "float32"]
    cmd += ["--temp", "0", "--max-tokens", "4"]
    out = subprocess.run([*cmd, "--audio", str(path), "what"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    out = subprocess.run([*cmd, "--audio", str(bad), "what"], capture_output=True, text=True)
    assert out.returncode == 2 and f"--audio {bad}: not audio" in out.stderr, out.stderr


def test_server_translates_and_responses_hear(served, tmp_path):
    """Proves, on a real `mlxlis serve` through the openai client: `POST
    /v1/audio/translations` (`client.audio.translations.create`) returns the library's greedy
    reply to Google's speech-translation prompt for the file, cut after "English: " as the
    endpoint documents, in json and verbose_json (task "translate"); Responses' input_audio
    part (base64 + format) gives the library's greedy reply to the same message; bad base64
    in it and an input_audio part without its audio are 400s naming the Responses field."""
    import base64

    from mlxlis.generation.generate import generate
    from mlxlis.serve.transcriptions import TRANSLATION, translation

    import openai
    from test_audio import encoded

    srv, client, model = served
    path = tmp_path / "said.flac"
    path.write_bytes(encoded(signal("chirp", 16000, 1.7), 16000, "FLAC", "PCM_16"))
    ask = TRANSLATION.format(language="its spoken language")
    want = translation(library_transcript(model, path, ask))
    assert want and translation("hola\nEnglish: hello") == "hello"
    with open(path, "rb") as f:
        assert client.audio.translations.create(model=srv.model, file=f).text == want
    with open(path, "rb") as f:
        verbose = client.audio.translations.create(
            model=srv.model, file=f, response_format="verbose_json"
        )
    assert verbose.text == want and verbose.task == "translate" and verbose.duration == 1.7
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.translations.create(model=srv.model, file=("x.mp3", b"ID3 nothing"))
    assert e.value.body["param"] == "file"

    b64 = base64.b64encode(path.read_bytes()).decode()
    text = {"type": "text", "text": "what is said?"}
    audio = {"type": "input_audio", "input_audio": {"data": b64, "format": "flac"}}
    prompt = model.encode_chat([{"role": "user", "content": [text, audio]}])
    events = generate(model, prompt, max_tokens=6, temperature=0.0)
    said = "".join(e.text for e in events if e.text)
    assert said
    asked = [{"type": "input_text", "text": "what is said?"}, audio]
    reply = client.responses.create(
        model=srv.model,
        input=[{"role": "user", "content": asked}],
        max_output_tokens=6,
        temperature=0.0,
    )
    assert reply.output_text == said
    for part, field in (
        ({"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}, "data"),
        ({"type": "input_audio"}, "input_audio"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(
                model=srv.model, input=[{"role": "user", "content": [asked[0], part]}]
            )
        param = e.value.body["error"]["param"] if "error" in e.value.body else e.value.body["param"]
        assert param.startswith("input[0].content[1].input_audio") and param.endswith(field)


def test_chat_app_attaches_audio_to_the_next_message(heard, tmp_path):
    """The chat app's /audio: a file that is not audio is an error notification naming it; a
    clip is a note with its name and duration, shown in the user's bubble and sent in the
    next message, whose prompt is the processor's expansion for that message (its token
    count); the saved record names the clip and its duration. Real app, real ChatSession."""
    import asyncio

    import mlxlis

    from test_audio import encoded, reference_samples
    from test_tui import SIZE, bubbles, errors, record_notes, wait_for

    from tui.app import ChatApp
    from tui.engine import Options
    from tui.widgets import Note

    folder, _, processor = heard
    path, bad = tmp_path / "said.wav", tmp_path / "bad.wav"
    path.write_bytes(encoded(signal("tone", 44100, 2.3), 44100))
    bad.write_bytes(b"RIFF not really")
    sampling = mlxlis.SamplingParams(temperature=0.0, max_tokens=3)
    opts = Options(model=str(folder), sampling=sampling, dtype="float32")
    app = record_notes(ChatApp(opts, data_dir=tmp_path / "conversations"))
    parts = [{"type": "audio", "audio": "x"}, {"type": "text", "text": "what"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    samples = reference_samples(path.read_bytes(), 16000)
    want = processor(text=text, audio=[samples], return_tensors="np")["input_ids"][0]

    async def scenario(pilot):
        await wait_for(pilot, lambda: app.engine is not None or app.notes, 120, "model load")
        app.prompt_input.insert(f"/audio {bad}")
        await pilot.press("enter")
        await wait_for(pilot, lambda: errors(app), 10, "the refusal")
        assert f"/audio {bad}: not audio" in errors(app)[-1]
        app.prompt_input.clear()
        app.prompt_input.insert(f"/audio {path}")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.engine.attachments, 10, "the attachment")
        assert "[audio: said.wav, 2.3 s]" in app.query(Note)[-1].source
        app.prompt_input.insert("what")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 2 and not app.generating, 60)
        assert "[audio: said.wav, 2.3 s]" in bubbles(app, "user")[-1].text
        assert app.engine.session.last_prompt_tokens == len(want)
        assert not app.engine.attachments
        rec = app.engine.record("r")
        assert rec["turns"][0]["content"] == "[audio: said.wav, 2.3 s]\nwhat"

    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)

    asyncio.run(main())
