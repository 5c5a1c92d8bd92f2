"""Whisper's log-mel features (transformers' WhisperFeatureExtractor, as Voxtral's processor
calls it) in numpy.

The clip is padded with silence to a whole number of chunks (`chunk_length` seconds each, at
least one), framed as torch.stft frames it (centred: reflect-padded by half an FFT, a periodic
Hann window), its power spectrum taken through Slaney-normalised Slaney-scale mel filters,
log10 of it floored at 1e-10 and at 8 below the whole clip's maximum, then scaled as
(x + 4) / 4. The features of all chunks are made at once (the floor is the clip's, not each
chunk's), then cut into the chunks the encoder reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlxlis.errors import MlxlisError

import numpy as np


def slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Hz -> Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    high = hz >= 1000.0
    mel[high] = 15.0 + np.log(hz[high] / 1000.0) * (27.0 / math.log(6.4))
    return mel


def slaney_hz(mel: np.ndarray) -> np.ndarray:
    """Slaney's mel scale -> Hz (slaney_mel's inverse)."""
    hz = 200.0 * mel / 3.0
    high = mel >= 15.0
    hz[high] = 1000.0 * np.exp(math.log(6.4) / 27.0 * (mel[high] - 15.0))
    return hz


def slaney_filters(n_freqs: int, n_mels: int, f_min: float, f_max: float, rate: int):
    """(n_freqs, n_mels) float64 triangular filters on Slaney's scale, each scaled to unit
    area (librosa's norm="slaney")."""
    freqs = np.linspace(0.0, rate / 2, n_freqs)  # each FFT bin's frequency
    edges = slaney_hz(
        np.linspace(slaney_mel(np.array([f_min]))[0], slaney_mel(np.array([f_max]))[0], n_mels + 2)
    )
    widths = np.diff(edges)  # (n_mels + 1,)
    offsets = edges[None, :] - freqs[:, None]  # (n_freqs, n_mels + 2)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    return bank * (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))


@dataclass(frozen=True)
class WhisperFeatures:
    """WhisperFeatureExtractor's settings (preprocessor_config.json's names)."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: str) -> WhisperFeatures:
        if cfg.get("dither", 0.0):  # random noise the reference adds: not reproducible
            raise MlxlisError("dithering is not supported", path=path, field="dither")
        known = {k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None}
        try:
            out = cls(**known)
            ints = (
                out.feature_size,
                out.sampling_rate,
                out.hop_length,
                out.chunk_length,
                out.n_fft,
            )
            if any(int(v) != v or v <= 0 for v in ints):
                raise ValueError
        except (TypeError, ValueError):
            raise MlxlisError(
                "expected positive whole numbers", path=path, field="feature_size"
            ) from None
        if out.n_fft > out.chunk_length * out.sampling_rate:
            raise MlxlisError("an FFT longer than a chunk", path=path, field="n_fft")
        return out

    @property
    def chunk_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // self.hop_length

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """One mono waveform at `sampling_rate` -> (chunks, feature_size, chunk_frames) float32
        log-mels (see the module docstring)."""
        x = np.asarray(samples, np.float32)
        size = self.chunk_samples
        padded = max(1, -(-len(x) // size)) * size
        x = np.concatenate([x, np.full(padded - len(x), self.padding_value, np.float32)])
        half = self.n_fft // 2
        x = np.pad(x, (half, half), mode="reflect")  # torch.stft's center=True
        frames = np.lib.stride_tricks.sliding_window_view(x, self.n_fft)[:: self.hop_length]
        frames = frames[: padded // self.hop_length]  # (F, n_fft): the last stft frame dropped
        k = np.arange(self.n_fft, dtype=np.float64)
        hann = (0.5 - 0.5 * np.cos(2 * np.pi * k / self.n_fft)).astype(np.float32)  # periodic
        # a float32 FFT, as torch.stft computes it
        power = np.abs(np.fft.rfft(frames * hann, axis=-1)) ** 2  # (F, bins)
        bank = slaney_filters(
            self.n_fft // 2 + 1, self.feature_size, 0.0, 8000.0, self.sampling_rate
        ).astype(np.float32)
        logmel = np.log10(np.maximum(power @ bank, np.float32(1e-10)))  # (F, mels)
        logmel = np.maximum(logmel, logmel.max() - 8.0)
        logmel = (logmel + 4.0) / 4.0
        chunks = logmel.reshape(-1, self.chunk_frames, self.feature_size)  # (C, frames, mels)
        return np.ascontiguousarray(chunks.transpose(0, 2, 1), np.float32)  # (C, mels, frames)
