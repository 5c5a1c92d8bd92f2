"""Audio in: decoding (soundfile), mono mixing, resampling (soxr) and Gemma 3n's log-mel
features against transformers' Gemma3nAudioFeatureExtractor, on signals made here."""

from __future__ import annotations

import io

from mlxlis.prompt import audio
from mlxlis.prompt.audio import AudioError, Gemma3nAudioFeatures, load_audio

import numpy as np
import pytest
import soundfile as sf
import soxr

RATES = (8000, 16000, 44100, 48000)


def signal(kind: str, rate: int, seconds: float, seed: int = 0) -> np.ndarray:
    """A test signal in [-1, 1]: a 440 Hz tone, a 100 Hz -> 3.5 kHz chirp, silence, noise."""
    t = np.arange(int(rate * seconds)) / rate
    if kind == "tone":
        x = 0.5 * np.sin(2 * np.pi * 440 * t)
    elif kind == "chirp":
        x = 0.6 * np.sin(2 * np.pi * (100 * t + (3400 / (2 * seconds)) * t**2))
    elif kind == "silence":
        x = np.zeros_like(t)
    else:
        x = np.random.default_rng(seed).uniform(-0.4, 0.4, len(t))
    return x.astype(np.float32)


def encoded(x: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def reference_samples(data: bytes, rate: int) -> np.ndarray:
    """libsndfile's whole-file read, the channels' mean, soxr's one-shot resampler."""
    x, file_rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = x.mean(axis=1)
    return soxr.resample(mono, file_rate, rate) if file_rate != rate else mono


CODECS = [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")]


@pytest.mark.parametrize("fmt,subtype", CODECS)
def test_formats_decode_mix_and_resample_as_the_libraries_do(fmt, subtype):
    """Proves each container decodes to what libsndfile reads in one go, stereo mixed to the
    channels' mean and 44.1 kHz brought to 16 kHz as soxr does (length and samples); a
    resampled 440 Hz tone keeps its frequency."""
    rate = 44100
    stereo = np.stack([signal("tone", rate, 1.5), signal("chirp", rate, 1.5)], axis=1)
    data = encoded(stereo, rate, fmt, subtype)
    got = load_audio(data, 16000)
    want = reference_samples(data, 16000)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    tone = load_audio(encoded(signal("tone", rate, 1.0), rate, fmt, subtype), 16000)
    peak = np.argmax(np.abs(np.fft.rfft(tone))) * 16000 / len(tone)
    assert abs(peak - 440) <= 2


def test_windows_cover_the_samples_in_order():
    """Proves the 30 s windows of long audio are consecutive and lose no sample."""
    x = signal("noise", 16000, 65.3, 2)
    parts = audio.windows(x, 480_000)
    assert [len(p) for p in parts] == [480_000, 480_000, len(x) - 960_000]
    np.testing.assert_array_equal(np.concatenate(parts), x)


def _reference_extractor(**kw):
    from transformers import Gemma3nAudioFeatureExtractor

    return Gemma3nAudioFeatureExtractor(**kw)


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("channels", [1, 2])
def test_features_equal_transformers(rate, channels):
    """Proves the numpy log-mels and their frame mask equal Gemma3nAudioFeatureExtractor's
    (default settings) to float32 rounding, on tones, chirps, silence and noise decoded from
    WAV at each rate, mono and stereo, and resampled to 16 kHz."""
    ours, ref = Gemma3nAudioFeatures(), _reference_extractor()
    for i, kind in enumerate(("tone", "chirp", "silence", "noise")):
        cols = [signal(kind, rate, 0.77 + 0.1 * i, seed=c) for c in range(channels)]
        if channels == 2:
            cols[1] = signal("tone", rate, 0.77 + 0.1 * i)
        data = encoded(np.stack(cols, axis=1), rate)
        x = load_audio(data, 16000)
        np.testing.assert_allclose(x, reference_samples(data, 16000), rtol=0, atol=1e-6)
        feats, mask = ours(x)
        out = ref(x, return_tensors="np")
        want, want_mask = out["input_features"][0], out["input_features_mask"][0]
        assert feats.shape == want.shape and feats.dtype == np.float32
        np.testing.assert_allclose(feats, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(mask, want_mask)


def test_features_with_normalisation_and_long_audio_equal_transformers():
    """Proves per-bin mean / stddev, input scaling, the non-HTK preemphasis and the 30 s
    truncation as the reference applies them; and the config reader takes the reference's
    own saved settings."""
    rng = np.random.default_rng(3)
    kw = {
        "per_bin_mean": rng.normal(size=128).tolist(),
        "per_bin_stddev": rng.uniform(0.5, 2, 128).tolist(),
        "input_scale_factor": 2.0,
        "preemphasis_htk_flavor": False,
    }
    ref = _reference_extractor(**kw)
    ours = Gemma3nAudioFeatures.from_config(ref.to_dict(), "preprocessor_config.json")
    x = signal("chirp", 16000, 31.0)
    feats, mask = ours(x)
    out = ref(x, return_tensors="np")
    np.testing.assert_allclose(feats, out["input_features"][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(mask, out["input_features_mask"][0])
    assert feats.shape[0] == (480_000 - 513) // 160 + 1  # 30 s kept of 31 (513-sample frames)


def test_mel_filters_equal_transformers():
    """Proves the mel bank equals create_fb_matrix's bin for bin (no bin shifted)."""
    from transformers.models.gemma3n.feature_extraction_gemma3n import create_fb_matrix

    want = create_fb_matrix(513, 125.0, 7600.0, 128, 16000, 1024)
    np.testing.assert_array_equal(audio.mel_filters(513, 125.0, 7600.0, 128, 16000, 1024), want)


def test_bad_audio_is_refused_by_name(tmp_path):
    """Proves not-audio, truncated WAV and MP3, zero-length audio, a missing file, audio longer
    than the bound, and rates / channels out of range are each refused with an AudioError
    naming the part."""
    x = signal("tone", 16000, 1.0)
    cases = {
        b"hello, this is text": "not audio",
        encoded(x, 16000, "WAV", "PCM_16")[:16000]: "truncated",
        encoded(x, 16000, "MP3", "MPEG_LAYER_III")[:1152]: "truncated",
        encoded(x[:0], 16000): "zero-length",
        encoded(x[:100], 500): "sample rate of 500",
        encoded(np.zeros((10, 65), np.float32), 16000): "65 channels",
        str(tmp_path / "absent.wav"): "no such file",
    }
    for data, words in cases.items():
        with pytest.raises(AudioError, match=words) as e:
            load_audio(data, 16000, field="messages[0].content[1]")
        assert e.value.field == "messages[0].content[1]"
    long = tmp_path / "long.wav"
    sf.write(long, np.zeros(8000 * 11, np.float32), 1000)  # 88 s at 1 kHz
    bound = audio.MAX_SECONDS
    try:
        audio.MAX_SECONDS = 60
        with pytest.raises(AudioError, match="at most 60 s"):
            load_audio(str(long), 16000)
    finally:
        audio.MAX_SECONDS = bound


def test_chat_app_audio_refused_where_it_cannot_be_heard(tiny, tmp_path):
    """The chat app's /audio on a model that hears nothing is an MlxlisError naming the
    command and file and the model, said before the file is read; in raw completion it is
    refused naming /audio; nothing is attached either way."""
    import mlxlis
    from mlxlis.errors import MlxlisError

    from tui.engine import Engine, Options

    folder, _ = tiny("llama")
    model = mlxlis.load(folder, "float32")
    path = tmp_path / "said.wav"  # never read: the refusal comes first
    for raw, field, said in ((False, f"/audio {path}", "takes no audio"), (True, "/audio", "raw")):
        engine = Engine(model, Options(model=str(folder), no_chat=raw))
        with pytest.raises(MlxlisError) as e:
            engine.attach_audio(str(path))
        assert e.value.field == field and said in e.value.message
        assert not engine.attachments
