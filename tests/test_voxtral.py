"""Voxtral hears: a tiny random VoxtralForConditionalGeneration (transformers 5.25) saved as a
hub folder with WhisperFeatureExtractor's settings, loaded by mlxlis.load, against
transformers: the tower's soft tokens, the logits after a clip, greedy generation, the
transcription request's layout (mistral_common's, as VoxtralProcessor builds it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_audio import encoded, reference_samples, signal

SPECIAL = ("<s>", "[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]", "[TRANSCRIBE]")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'audio' %}[AUDIO]{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)


SPECS = {  # 2 s chunks: a tower of 100 positions, 25 soft tokens a chunk
    "voxtral": {
        "audio_config": {
            "hidden_size": 16,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_source_positions": 100,
        },
        "text_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 1024,
        },
        "chunk_length": 2,
    }
}
SPECS["text"] = {k: v for k, v in SPECS["voxtral"].items() if k != "chunk_length"}


def build(folder, spec: dict):
    """A hub-shaped Voxtral folder (weights, a tokenizer with Mistral's specials and a
    template writing [AUDIO] once per clip, preprocessor_config.json where `spec` says the
    chunks); returns the model."""
    from conftest import randomize, train_tokenizer
    from transformers import (
        PreTrainedTokenizerFast,
        VoxtralConfig,
        VoxtralForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    vocab = train_tokenizer(folder, 400, extra_special=(*SPECIAL, "</s>"))
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    tok.bos_token, tok.eos_token, tok.chat_template = "<s>", "</s>", TEMPLATE
    tok.save_pretrained(folder)
    text = {
        **spec["text_config"],
        "vocab_size": vocab,
        "bos_token_id": tok.convert_tokens_to_ids("<s>"),
        "eos_token_id": tok.convert_tokens_to_ids("</s>"),
    }
    cfg = VoxtralConfig(
        audio_config=spec["audio_config"],
        text_config=text,
        audio_token_id=tok.convert_tokens_to_ids("[AUDIO]"),
    )
    torch.manual_seed(0)
    ref = VoxtralForConditionalGeneration(cfg).eval()
    randomize(ref, 1)
    ref.save_pretrained(folder)
    if "chunk_length" in spec:  # without it, a text-only folder (the fingerprint's)
        extractor = WhisperFeatureExtractor(feature_size=128, chunk_length=spec["chunk_length"])
        extractor.save_pretrained(folder)
    return ref


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    """(folder, transformers model, tokenizer, ids of the specials)."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("voxtral")
    ref = build(folder, SPECS["voxtral"])
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    return folder, ref, tok, {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}


def reference_features(samples: np.ndarray) -> torch.Tensor:
    """(chunks, 128, 200) as VoxtralProcessor._retrieve_input_features makes them."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, chunk_length=2)
    out = fe(
        samples,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        pad_to_multiple_of=fe.n_samples,
        return_tensors="pt",
    )["input_features"]
    return out.reshape(128, -1, fe.nb_max_frames).transpose(0, 1)


def test_voxtral_hears_as_transformers_does(voxtral):
    """Proves, through mlxlis.load: the tower (Whisper encoder + projector) is loaded, not
    skipped (inspect's report says so); a 4.7 s stereo 44.1 kHz clip becomes 3 chunks of 25
    soft tokens, and the soft tokens equal transformers' get_audio_features on the
    processor's features within 1e-4 (relative); encode_chat expands the template's [AUDIO]
    into [BEGIN_AUDIO] and a run of 75 [AUDIO]; the logits of that prompt equal
    VoxtralForConditionalGeneration's within 1e-4 (relative, float32); greedy generation
    prefilled in chunks of 16 equals transformers' generate; the transcription request is
    mistral_common's layout. Measured: soft tokens within 1.5e-6, logits within 1.3e-6
    (relative to the largest)."""
    import mlxlis
    from mlxlis.commands.report import model_report
    from mlxlis.generation.generate import generate

    folder, ref, tok, ids = voxtral
    model = mlxlis.load(folder, "float32")
    assert not any("audio_tower" in n for n in model.skipped) and model.hearing is not None
    report = model_report(model)  # what `mlxlis inspect` says of it
    assert report["family"] == "voxtral" and report["audio"].startswith("Whisper encoder, 2")
    stereo = np.stack([signal("chirp", 44100, 4.7), signal("tone", 44100, 4.7)], axis=1)
    data = encoded(stereo, 44100)
    feats = reference_features(reference_samples(data, 16000))
    assert feats.shape == (3, 128, 200)
    parts = [{"type": "audio", "audio": data}, {"type": "text", "text": "what is said?"}]
    prompt = model.encode_chat([{"role": "user", "content": parts}])
    (clip,) = prompt.images
    assert clip.tokens == 75
    with torch.no_grad():
        want = ref.get_audio_features(feats).pooler_output.numpy()
    got = np.array(model.hearing.features(clip))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    text = "<s>[INST][BEGIN_AUDIO]" + "[AUDIO]" * 75 + "what is said?[/INST]"
    assert prompt.ids == tok(text, add_special_tokens=False)["input_ids"]
    inputs = {"input_ids": torch.tensor([prompt.ids]), "input_features": feats}
    with torch.no_grad():
        logits = ref(**inputs).logits[0].numpy()
        out = ref.generate(**inputs, max_new_tokens=8, do_sample=False)
    mine = np.array(model.logits(prompt.ids, prompt.images))
    assert np.abs(mine - logits).max() / np.abs(logits).max() < 1e-4
    expected = out[0, len(prompt.ids) :].tolist()
    events = generate(model, prompt, max_tokens=len(expected), temperature=0.0, prefill_step=16)
    assert [e.token for e in events if e.token is not None] == expected
    request = model.hearing.transcription(clip, "en")
    lang = tok("lang:en", add_special_tokens=False)["input_ids"]
    head = [ids["<s>"], ids["[INST]"], ids["[BEGIN_AUDIO]"], *[ids["[AUDIO]"]] * 75]
    assert request == [*head, ids["[/INST]"], *lang, ids["[TRANSCRIBE]"]]


def test_server_transcribes_with_voxtrals_own_request(voxtral, tmp_path):
    """Proves `POST /v1/audio/transcriptions` on a real `mlxlis serve` of the Voxtral folder,
    called by the openai client, returns the library's greedy continuation of mistral_common's
    transcription request for the file ("lang:en" given) in json and srt; and that what
    Voxtral cannot do is refused naming the field, in OpenAI's error shape: a translation
    (`model`), a `prompt`, a language that is not an ISO-639-1 code."""
    import mlxlis
    from mlxlis.generation.generate import generate
    from mlxlis.models.multimodal import Prompt
    from mlxlis.serve.transcriptions import WINDOW_TOKENS

    import openai
    from serve_process import ServeProcess

    folder = voxtral[0]
    path = tmp_path / "said.flac"
    path.write_bytes(encoded(signal("chirp", 16000, 3.1), 16000, "FLAC", "PCM_16"))
    model = mlxlis.load(folder, "float32")
    clip = model.hearing.prepare_audio(str(path), "file", "said.flac")
    prompt = Prompt(model.hearing.transcription(clip, "en"), (clip,))
    events = generate(model, prompt, temperature=0.0, max_tokens=WINDOW_TOKENS)
    want = "".join(e.text for e in events if e.text).strip()
    assert want
    (tmp_path / "served").mkdir()
    srv = ServeProcess(tmp_path / "served", "-m", str(folder))
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")

        def ask(kind: str = "transcriptions", **kw):
            with open(path, "rb") as f:
                return getattr(client.audio, kind).create(model=srv.model, file=f, **kw)

        assert ask(language="en", temperature=0.0).text == want
        srt = ask(language="en", response_format="srt")
        assert srt == f"1\n00:00:00,000 --> 00:00:03,100\n{want}\n"
        for kind, kw, field in (
            ("translations", {}, "model"),
            ("transcriptions", {"prompt": "Say it."}, "prompt"),
            ("transcriptions", {"language": "english"}, "language"),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                ask(kind, **kw)
            assert e.value.body["param"] == field, e.value.body
    finally:
        assert srv.stop() == 0, srv.log()


def test_voxtral_settings_it_cannot_honour_are_refused(voxtral, tmp_path):
    """Proves a Voxtral folder whose tower or projector cannot be built as configured is
    refused by mlxlis.load with a ConfigError naming config.json (or the extractor's file)
    and the field: heads that do not divide the width, an activation mlxlis lacks, a text
    decoder that is not Llama's, states that do not regroup, and an extractor whose chunks
    are not the encoder's input."""
    import json
    import shutil

    import mlxlis
    from mlxlis.errors import ConfigError, UnsupportedError

    from conftest import check_config_refused

    folder = voxtral[0]
    audio = json.loads((folder / "config.json").read_text())["audio_config"]
    text = json.loads((folder / "config.json").read_text())["text_config"]
    for k, (change, error, field) in enumerate(
        (
            ({"num_attention_heads": 3}, ConfigError, "num_attention_heads"),
            ({"activation_function": "swish"}, ConfigError, "activation_function"),
            ({"intermediate_size": 48}, ConfigError, "audio_config.intermediate_size"),
        )
    ):
        change = {"audio_config": {**audio, **change}}
        check_config_refused(folder, tmp_path / str(k), change, error, field)
    act = {"projector_hidden_act": "tanh"}
    check_config_refused(folder, tmp_path / "a", act, ConfigError, "projector_hidden_act")
    change = {"text_config": {**text, "model_type": "qwen2"}}
    check_config_refused(folder, tmp_path / "t", change, UnsupportedError, "text_config.model_type")
    bad = tmp_path / "chunks"
    shutil.copytree(folder, bad)
    pre = json.loads((bad / "preprocessor_config.json").read_text())
    (bad / "preprocessor_config.json").write_text(json.dumps({**pre, "chunk_length": 3}))
    with pytest.raises(ConfigError) as e:
        mlxlis.load(bad, "float32")
    assert e.value.field == "chunk_length" and "preprocessor_config.json" in str(e.value)
