"""Whisper's log-mel features (mlxlis/prompt/whisper_features.py, what Voxtral's encoder
reads) against transformers' WhisperFeatureExtractor called as VoxtralProcessor calls it,
on signals made here."""

from __future__ import annotations

from mlxlis.errors import MlxlisError
from mlxlis.prompt.whisper_features import WhisperFeatures, slaney_filters

import numpy as np
import pytest
from test_audio import encoded, reference_samples, signal


def assert_rounding_close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal within float32 rounding: as powers (10 ** (4 x - 4), what the log is of) within
    2e-6 of the clip's peak (two FFTs' float32 rounding, each 201 terms), so the log-mels
    within 1e-4 where a bin is far below the peak."""
    assert got.dtype == np.float32 and got.shape == want.shape
    power_got, power_want = (10 ** (4 * a.astype(np.float64) - 4) for a in (got, want))
    # (plus the rounding of the float32 log itself, read back as a power)
    bound = 2e-6 * power_want.max() + 1e-6 * power_want
    assert (np.abs(power_got - power_want) <= bound).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def reference(samples: np.ndarray, **kw) -> np.ndarray:
    """transformers' features, padded to whole chunks and cut into them as
    VoxtralProcessor._retrieve_input_features does: (chunks, mel bins, frames)."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(**kw)
    out = fe(
        samples,
        sampling_rate=fe.sampling_rate,
        padding=True,
        truncation=False,
        pad_to_multiple_of=fe.n_samples,
        return_tensors="np",
    )["input_features"]
    return out.reshape(fe.feature_size, -1, fe.nb_max_frames).transpose(1, 0, 2)


def test_mel_filters_equal_transformers():
    """Proves the Slaney-scale, Slaney-normalised filter bank equals transformers'
    mel_filter_bank(norm="slaney", mel_scale="slaney") as WhisperFeatureExtractor builds it
    (80 and 128 bins)."""
    from transformers.audio_utils import mel_filter_bank

    for mels in (80, 128):
        want = mel_filter_bank(201, mels, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(slaney_filters(201, mels, 0.0, 8000.0, 16000), want, rtol=1e-12)


@pytest.mark.parametrize(
    "kind,rate,seconds",
    [("tone", 16000, 2.3), ("noise", 16000, 0.7), ("chirp", 44100, 1.9), ("silence", 16000, 1.0)],
)
def test_features_equal_transformers(kind, rate, seconds):
    """Proves the features equal WhisperFeatureExtractor's (128 bins, 1 s chunks so that a
    clip spans several) within float32 rounding, on tones, a chirp, noise and silence at
    16 kHz and 44.1 kHz resampled to 16 kHz (the samples the decoder gives): the chunk count,
    each chunk's frames, and the clip-wide floor. Measured: powers within 1.1e-6 of the
    peak, log-mels within 3.6e-5 (5.4e-5 on 30 s chunks: the quietest bins)."""
    samples = signal(kind, rate, seconds, 3)
    if rate != 16000:
        samples = reference_samples(encoded(samples, rate), 16000)
    ours = WhisperFeatures(feature_size=128, chunk_length=1)
    got = ours(samples)
    want = reference(samples, feature_size=128, chunk_length=1)
    assert got.shape == (max(1, -(-len(samples) // 16000)), 128, 100)
    assert_rounding_close(got, want)


def test_thirty_second_chunks_and_settings():
    """Proves Voxtral's shape (30 s chunks of 3000 frames, 128 bins: a 31 s clip is two
    chunks, the second mostly silence) equals transformers', and that settings the
    extractor cannot honour are refused by name."""
    samples = signal("chirp", 16000, 31.0)
    got = WhisperFeatures()(samples)
    want = reference(samples, feature_size=128)
    assert got.shape == (2, 128, 3000)
    assert_rounding_close(got, want)
    with pytest.raises(MlxlisError) as e:
        WhisperFeatures.from_config({"dither": 1e-4}, "preprocessor_config.json")
    assert e.value.field == "dither"
    with pytest.raises(MlxlisError) as e:
        WhisperFeatures.from_config({"hop_length": 0}, "preprocessor_config.json")
    assert e.value.field == "feature_size"
