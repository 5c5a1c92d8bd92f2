"""Audio in: decoded safely, mono-mixed and resampled to the model's rate, then turned into
the log-mel features its tower reads (Gemma 3n's USM extractor).

`load_audio(source, rate, field)`: a path or bytes -> float32 mono samples at `rate`. The file
is read by libsndfile (`soundfile`: WAV, FLAC, OGG, MP3 …); its header is checked before the
samples are decoded (sample rate, channel count and duration within the bounds below), then
they are decoded, no more than the header states (a file decoding to fewer is truncated).
Channels are mixed to their mean, and the rate converted with `soxr` (its high-quality
setting). Every failure is an AudioError naming
`field`.

`Gemma3nAudioFeatures`: transformers' Gemma3nAudioFeatureExtractor in numpy (preemphasised
Hann frames, a magnitude FFT, an HTK mel bank, log, per-bin normalisation), step by step in the
reference's dtypes so the features agree with it to float32 rounding. `windows` cuts long audio
into the extractor's 30 s windows.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import MlxlisError

import numpy as np

MAX_SECONDS = 3 * 3600  # longer audio is refused (three hours)
MIN_RATE, MAX_RATE = 1000, 768_000  # sample rates in Hz a file may state
MAX_CHANNELS = 64


class AudioError(MlxlisError):
    """Audio that cannot be used: not audio, truncated, empty, too long, out of range."""


def _open(source: str | Path | bytes, field: str) -> Any:
    import soundfile as sf

    data: Any = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    if not isinstance(data, io.BytesIO) and not Path(data).is_file():
        raise AudioError(f"no such file: {source}", field=field)
    try:
        return sf.SoundFile(data)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(f"not audio libsndfile can read ({e})"[:300], field=field) from None


def _info(f: Any) -> list[str]:
    return [line.strip() for line in str(getattr(f, "extra_info", "")).splitlines()]


def _check_header(rate: int, channels: int, frames: int, field: str) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(
            f"a sample rate of {rate} Hz: expected {MIN_RATE} to {MAX_RATE}", field=field
        )
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{channels} channels: expected 1 to {MAX_CHANNELS}", field=field)
    if frames > MAX_SECONDS * rate:
        raise AudioError(f"{frames / rate:.0f} s of audio: at most {MAX_SECONDS} s", field=field)


def decode(source: str | Path | bytes, field: str = "audio") -> tuple[np.ndarray, int]:
    """The file's samples as float32 (frames, channels) and its sample rate."""
    import soundfile as sf

    with _open(source, field) as f:
        rate, channels, stated = int(f.samplerate), int(f.channels), int(f.frames)
        _check_header(rate, channels, stated, field)
        # libsndfile reads a WAV cut short as far as it goes and says so only here
        if any(line.startswith("data") and "should be" in line for line in _info(f)):
            raise AudioError("truncated: less data than its header says", field=field)
        try:
            # one read of at most the header's frame count (libsndfile's MP3 reader loses
            # its place when read in blocks)
            samples = f.read(dtype="float32", always_2d=True)  # (frames, channels)
        except (sf.LibsndfileError, RuntimeError, MemoryError) as e:
            raise AudioError(f"broken audio: {e}"[:300], field=field) from None
    total = len(samples)
    if total == 0:
        raise AudioError("no samples (zero-length audio)", field=field)
    if total < stated:  # an MP3's Xing header counts frames the stream no longer has
        raise AudioError(f"truncated: {total} of {stated} frames decoded", field=field)
    if not np.isfinite(samples).all():
        raise AudioError("samples that are not finite numbers", field=field)
    return samples, rate


def to_mono(samples: np.ndarray) -> np.ndarray:
    """(frames, channels) -> (frames,): the channels' mean."""
    return samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]


def resample(mono: np.ndarray, rate: int, to: int) -> np.ndarray:
    """`mono` from `rate` to `to` Hz (soxr, high quality); as it is when the rates agree."""
    if rate == to:
        return mono
    import soxr

    return soxr.resample(mono, rate, to, quality="HQ").astype(np.float32)


def part_source(part: Any, field: str) -> Any:
    """What a chat content part holds as audio: {"type": "audio", "audio" | "path": PATH |
    bytes | a prepared clip}, or OpenAI's {"type": "input_audio", "input_audio": {"data":
    base64, "format"}} decoded to bytes (the format is the file's own to say); None for
    another part. An AudioError naming `field` for one without its audio."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_audio":
        inner = part.get("input_audio")
        data = inner.get("data") if isinstance(inner, dict) else None
        if not isinstance(data, str):
            raise AudioError("an input_audio part needs its base64 data", field=field)
        try:
            return base64.b64decode(data, validate=True)
        except (ValueError, binascii.Error):
            raise AudioError("input_audio data is not base64", field=field) from None
    if kind != "audio":
        return None
    source = part.get("audio", part.get("path"))
    if source is None:
        raise AudioError("an audio part needs its audio", field=field)
    return source


def load_audio(source: str | Path | bytes, rate: int, field: str = "audio") -> np.ndarray:
    """float32 mono samples at `rate` Hz (see the module docstring)."""
    samples, file_rate = decode(source, field)
    return resample(to_mono(samples), file_rate, rate)


def windows(samples: np.ndarray, size: int) -> list[np.ndarray]:
    """`samples` cut into consecutive windows of `size` (the last one shorter), none dropped."""
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def mel_filters(n_freqs: int, f_min: float, f_max: float, n_mels: int, rate: int, fft: int):
    """(n_freqs, n_mels) triangular HTK-mel filters, unnormalised (torchaudio's
    melscale_fbanks as transformers writes it in numpy: bin centres in float32, edges in
    float64)."""
    freqs = np.arange(n_freqs, dtype=np.float32) * (rate / fft)  # each FFT bin's frequency

    def mel(f: float) -> float:
        return 2595.0 * math.log10(1.0 + f / 700.0)

    edges = 700.0 * (10 ** (np.linspace(mel(f_min), mel(f_max), n_mels + 2) / 2595.0) - 1.0)
    widths = np.diff(edges)  # (n_mels + 1,)
    offsets = edges[None, :] - freqs[:, None]  # (n_freqs, n_mels + 2)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1, np.float32), np.minimum(rising, falling))


@dataclass(frozen=True)
class Gemma3nAudioFeatures:
    """Gemma3nAudioFeatureExtractor's settings (preprocessor_config.json's names)."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 32.0
    hop_length_ms: float = 10.0
    min_frequency: float = 125.0
    max_frequency: float = 7600.0
    preemphasis: float = 0.97
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = True
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-5
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    padding_value: float = 0.0
    max_samples: int = 480_000  # the processor's window: 30 s at 16 kHz
    pad_to_multiple_of: int = 128

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: str) -> Gemma3nAudioFeatures:
        if cfg.get("dither", 0.0):  # random noise the reference adds: not reproducible
            raise MlxlisError("dithering is not supported", path=path, field="dither")
        known = {k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg and cfg[k] is not None}
        try:
            for k in ("per_bin_mean", "per_bin_stddev"):
                if k in known:
                    known[k] = tuple(np.asarray(known[k], np.float64).reshape(-1).tolist())
            if "mel_floor" in known:
                known["mel_floor"] = float(known["mel_floor"])
            out = cls(**known)
            int(out.feature_size), float(out.mel_floor), float(out.preemphasis)
        except (TypeError, ValueError, OverflowError):
            raise MlxlisError(
                "expected numeric feature extractor settings", path=path, field="feature_size"
            ) from None
        for k in ("per_bin_mean", "per_bin_stddev"):
            v = getattr(out, k)
            if v is not None and len(v) != out.feature_size:
                raise MlxlisError(f"expected {out.feature_size} values", path=path, field=k)
        if not 0 < out.frame_length_ms * out.sampling_rate <= 1e8 or out.hop_length_ms <= 0:
            raise MlxlisError("a frame or hop out of range", path=path, field="hop_length_ms")
        return out

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return n * 2 if self.fft_overdrive else n

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One mono waveform at `sampling_rate` -> (frames, feature_size) float32 log-mels and
        the (frames,) mask of frames that hold audio (False on the padding): the first
        `max_samples`, zero-padded to a multiple of `pad_to_multiple_of`."""
        x = np.asarray(samples, np.float32)[: self.max_samples]
        n, m = len(x), self.pad_to_multiple_of
        padded = -(-n // m) * m
        valid = np.zeros(padded, np.int32)
        valid[:n] = 1
        x = np.concatenate([x, np.full(padded - n, self.padding_value, np.float32)])
        if self.input_scale_factor != 1.0:
            x = x * self.input_scale_factor
        size, hop = self.frame_length + 1, self.hop_length  # one sample more for preemphasis
        count = max(0, (padded - size) // hop + 1)
        framed = np.lib.stride_tricks.sliding_window_view(x, size)[::hop][:count]  # (F, size)
        a = self.preemphasis
        if a > 0 and self.preemphasis_htk_flavor:
            first = framed[:, :1] * (1.0 - a)  # HTK: the frame's first sample scaled alone
            frames = np.concatenate([first, framed[:, 1:-1] - a * framed[:, :-2]], axis=1)
        elif a > 0:
            frames = framed[:, 1:] - a * framed[:, :-1]
        else:
            frames = framed[:, :-1]
        k = np.arange(self.frame_length, dtype=np.float32)
        hann = (0.5 * (1 - np.cos(2 * np.pi * k / self.frame_length))).astype(np.float32)
        spectrum = np.abs(np.fft.rfft(frames * hann, n=self.fft_length, axis=-1))
        bank = mel_filters(
            self.fft_length // 2 + 1,
            self.min_frequency,
            self.max_frequency,
            self.feature_size,
            self.sampling_rate,
            self.fft_length,
        )
        logmel = np.log(np.maximum(spectrum @ bank, np.float64(self.mel_floor)))
        if self.per_bin_mean is not None:
            logmel = logmel - np.array(self.per_bin_mean)
        if self.per_bin_stddev is not None:
            logmel = logmel / np.array(self.per_bin_stddev)
        mask = valid[::hop][:count].astype(bool)
        return logmel.astype(np.float32), mask
