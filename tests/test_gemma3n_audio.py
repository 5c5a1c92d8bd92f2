"""Gemma 3n's audio tower and embedder against transformers' Gemma3nAudioEncoder and
Gemma3nMultimodalEmbedder (tiny random configs built here, every weight perturbed from its
initial value), on log-mels of audio made in the test, in float32."""

from __future__ import annotations

from mlxlis.models.gemma3n_audio import AudioConfig, Gemma3nAudio
from mlxlis.prompt.audio import Gemma3nAudioFeatures

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_audio import signal

TINY = dict(
    hidden_size=32,
    input_feat_size=128,
    conf_num_attention_heads=4,
    conf_num_hidden_layers=2,
    conf_attention_chunk_size=4,
    conf_attention_context_left=6,
    conf_attention_context_right=0,
    conf_attention_logit_cap=5.0,
    conf_reduction_factor=4,
    sscp_conv_channel_size=[8, 4],
    vocab_size=8,
    vocab_offset=500,
)
SPECS = {
    "causal": TINY,
    "lookahead": {**TINY, "conf_attention_context_right": 3, "conf_attention_chunk_size": 5},
}


def reference(spec: dict, seed: int = 0):
    """transformers' encoder and embedder with every parameter moved off its init."""
    from transformers import Gemma3nAudioConfig, Gemma3nTextConfig
    from transformers.models.gemma3n.modeling_gemma3n import (
        Gemma3nAudioEncoder,
        Gemma3nMultimodalEmbedder,
    )

    torch.manual_seed(seed)
    cfg = Gemma3nAudioConfig(**spec)
    text = Gemma3nTextConfig(hidden_size=48, vocab_size=512)
    enc, emb = Gemma3nAudioEncoder(cfg).eval(), Gemma3nMultimodalEmbedder(cfg, text).eval()
    with torch.no_grad():
        for p in [*enc.parameters(), *emb.parameters()]:
            p.add_(0.3 * torch.randn_like(p))
    return cfg, enc, emb


def ours(cfg, enc, emb) -> Gemma3nAudio:
    net = Gemma3nAudio(AudioConfig.from_hf(cfg.to_dict(), "config.json"), 48, pad_id=511)
    weights = {f"audio_tower.{k}": v for k, v in enc.state_dict().items()}
    weights |= {f"embed_audio.{k}": v for k, v in emb.state_dict().items()}
    weights = {k: mx.array(v.numpy()) for k, v in weights.items() if "inv_timescales" not in k}
    net.load_weights(list(Gemma3nAudio.sanitize(weights).items()), strict=True)
    return net


@pytest.mark.parametrize("name", SPECS)
def test_tower_and_embedder_match_transformers(name):
    """Proves the subsampling convolutions, the cumulative group norm, the chunked local
    attention (its relative positions, softcap, left / right context and padding keys), the
    light convolution, the reduction and the soft-token embedder equal transformers' within
    1e-4 on a batch of a 2.3 s chirp and a 0.9 s tone (the second padded by the extractor,
    so masked frames are exercised); the validity mask is the reference's."""
    from transformers import Gemma3nAudioFeatureExtractor

    cfg, enc, emb = reference(SPECS[name])
    waves = [signal("chirp", 16000, 2.3), signal("tone", 16000, 0.9)]
    feats = Gemma3nAudioFeatureExtractor()(waves, return_tensors="np")
    mels, valid = feats["input_features"], feats["input_features_mask"]
    with torch.no_grad():
        out = enc(torch.from_numpy(mels), ~torch.from_numpy(valid))
        want = out.last_hidden_state.numpy()
        want_soft = emb(inputs_embeds=out.last_hidden_state).numpy()
    net = ours(cfg, enc, emb)
    h, keep = net.audio_tower(mx.array(mels), mx.array(valid))
    np.testing.assert_array_equal(np.array(keep), ~out.audio_mel_mask.numpy())
    assert not np.array(keep)[1].all()  # the tone's window is partly padding
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.array(h), want, rtol=0, atol=1e-4 * scale)
    soft = np.array(net.embed_audio.soft(h))
    np.testing.assert_allclose(soft[np.array(keep)], want_soft[np.array(keep)], rtol=0, atol=1e-4)
    with torch.no_grad():
        hard = emb(input_ids=torch.tensor([[502, 507]])).numpy()
    np.testing.assert_allclose(
        np.array(net.embed_audio.hard(mx.array([[502, 507]]))), hard, rtol=0, atol=1e-5
    )


def test_features_of_our_extractor_through_the_tower():
    """Proves the tower output on mlxlis' own features (one window) equals the reference's on
    transformers' features of the same samples."""
    from transformers import Gemma3nAudioFeatureExtractor

    cfg, enc, emb = reference(TINY, seed=1)
    wave = signal("noise", 16000, 1.7)
    mels, valid = Gemma3nAudioFeatures()(wave)
    ref = Gemma3nAudioFeatureExtractor()(wave, return_tensors="pt")
    with torch.no_grad():
        want = enc(ref["input_features"], ~ref["input_features_mask"]).last_hidden_state.numpy()
    h, _ = ours(cfg, enc, emb).audio_tower(mx.array(mels)[None], mx.array(valid)[None])
    np.testing.assert_allclose(np.array(h), want, rtol=0, atol=1e-4 * np.abs(want).max())


def build_wrapped(folder, monkeypatch, seed: int = 0, vocab: int | None = None):
    """A tiny random Gemma3nForConditionalGeneration written by transformers: a gemma3n text
    model (4 AltUp streams, KV sharing, per-layer inputs), the tiny audio tower, and the text
    vocabulary's last ids the vision and audio ranges as on the hub (the vision tower, a timm
    network, left empty: nothing here reads images). Returns (model, config)."""
    import transformers.models.gemma3n.modeling_gemma3n as modeling
    from conftest import randomize, train_tokenizer
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    if vocab is None:  # the ids of the three audio tokens: the last two and a text id
        vocab = train_tokenizer(folder)
    real = modeling.AutoModel.from_config

    def towers(config, **kw):
        if config.model_type == "gemma3n_vision":
            return torch.nn.Module()
        return real(config, **kw)

    monkeypatch.setattr(modeling.AutoModel, "from_config", towers)
    text = dict(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab - 3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        intermediate_size=96,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        altup_num_inputs=4,
        activation_sparsity_pattern=[0.9, 0.0, 0.0, 0.0],
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    cfg = Gemma3nConfig(
        text_config=text,
        audio_config={**TINY, "vocab_size": 2, "vocab_offset": vocab - 2},
        vision_config={"vocab_size": 1, "vocab_offset": vocab - 3},
        boa_token_id=3,
        eoa_token_id=vocab - 2,
        audio_token_id=vocab - 1,
    )
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3nForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model, cfg


def test_logits_after_audio_match_transformers(tmp_path, monkeypatch):
    """Proves the whole path in float32: transformers' Gemma3nForConditionalGeneration on ids
    holding boa + 188 audio placeholders + eoa (the processor's expansion) and a 2.1 s chirp's
    features, against mlxlis' text model with the audio soft tokens (padded to 188 with the
    audio vocabulary's last embedding) and the eoa token's audio-vocabulary embedding put in
    place: every position's logits within 1e-4 (relative to their scale)."""
    import mlxlis
    from mlxlis.models.gemma3n_audio import load_gemma3n_audio
    from mlxlis.models.multimodal import Inserts

    from transformers import Gemma3nAudioFeatureExtractor

    ref, cfg = build_wrapped(tmp_path, monkeypatch)
    wave = signal("chirp", 16000, 2.1)
    feats = Gemma3nAudioFeatureExtractor()(wave, return_tensors="pt")
    run = [cfg.boa_token_id] + [cfg.audio_token_id] * 188 + [cfg.eoa_token_id]
    ids = [0, 17, 40, 9, 33] + run + [60, 12, 77, 3]
    with torch.no_grad():
        want = (
            ref(
                input_ids=torch.tensor([ids]),
                input_features=feats["input_features"],
                input_features_mask=feats["input_features_mask"],
            )
            .logits[0]
            .numpy()
        )
    model = mlxlis.load(tmp_path, "float32")
    audio = load_gemma3n_audio(tmp_path, mx.float32)
    mels, valid = Gemma3nAudioFeatures()(wave)
    soft = audio(mx.array(mels)[None], mx.array(valid)[None])[0]  # (188, hidden)
    eoa = audio.embed_audio.hard(mx.array([cfg.eoa_token_id]))
    start = ids.index(cfg.audio_token_id)
    inserts = Inserts([(start, mx.concatenate([soft, eoa]))], fill=0, bidirectional=False)
    got = np.array(model.net(mx.array([ids]), inserts=inserts)[0])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err


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
    (its audio expansion); the logits after the audio equal Gemma3nForConditionalGeneration's
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
