"""Gemma 3n hears: the audio tower as the model's multimodal part (multimodal.Vision's seam:
an audio clip is a run of placeholders its soft tokens replace), loaded where the folder has
an `audio_config`, the tower's tensors and the feature extractor's settings
(preprocessor_config.json / processor_config.json).

A clip is decoded and resampled to the extractor's rate (prompt/audio.py) and turned into
log-mels (a clip longer than the processor's 30 s window is refused, not cut); the prompt's
audio marker (the chat template's `<audio_soft_token>`) is expanded as Gemma3nProcessor does:
"\\n\\n<start_of_audio>", 188 placeholders, "<end_of_audio>\\n\\n". The placeholders are
causal text positions for the language model (no bidirectional block, unlike images in
Gemma 3), and the end-of-audio token, an id of the audio vocabulary, is embedded by the audio
embedder (`attach`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxlis.errors import UnsupportedError
from mlxlis.models.gemma3n_audio import Gemma3nAudio, load_gemma3n_audio
from mlxlis.models.gemma3n_net import Gemma3n, HardTokens
from mlxlis.models.multimodal import (
    BlockPositions,
    PromptImage,
    expand_markers,
    marker_tokens,
)
from mlxlis.prompt.audio import AudioError, Gemma3nAudioFeatures, load_audio

import mlx.core as mx
import numpy as np
from PIL import Image


class Gemma3nHearing(BlockPositions):
    """multimodal.Vision and multimodal.Hearing for Gemma 3n's audio tower."""

    bidirectional = False
    tasks = ("transcribe", "translate")  # Google documents both prompts for Gemma 3n
    fill_id = 0  # Gemma3nModel's per-layer inputs read a placeholder past their table as 0

    def __init__(
        self,
        net: Gemma3nAudio,
        extractor: Gemma3nAudioFeatures,
        markers: tuple[str, ...],
        ids: tuple[int, ...],
        dtype: mx.Dtype,
    ):
        self.net, self.extractor, self.dtype = net, extractor, dtype
        self.rate = extractor.sampling_rate
        self.boa, self.soft, self.eoa = markers
        self.image_token_id = ids[1]

    def expand(self, text: str, images: list[PromptImage]) -> str:
        run = f"\n\n{self.boa}{self.soft * self.net.tokens}{self.eoa}\n\n"
        return expand_markers(text, self.soft, images, lambda _: run)

    def marker_count(self, text: str) -> int:
        return text.count(self.soft)

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        raise UnsupportedError(
            "Gemma 3n's vision tower is not implemented: it hears, it does not see",
            field="images",
        )

    def prepare_audio(self, source: Any, field: str, name: str) -> PromptImage:
        x = load_audio(source, self.extractor.sampling_rate, field)
        most = self.extractor.max_samples
        if len(x) > most:  # the processor would cut it silently
            raise AudioError(
                f"{len(x) / self.rate:.1f} s of audio: a clip is at most "
                f"{most / self.rate:g} s (/v1/audio/transcriptions reads longer audio window "
                "by window)",
                field=field,
            )
        mels, valid = self.extractor(x)  # (frames, mel bins), (frames,)
        if not name:
            name = Path(source).name if isinstance(source, (str, Path)) else "audio"
        # `positions` carries each frame's validity (the padding's frames are False)
        return PromptImage.of(mels, (len(x), 1), self.net.tokens, name, valid.astype(np.int32))

    def features(self, image: PromptImage) -> mx.array:
        mels = mx.array(image.pixels)[None].astype(self.dtype)  # (1, frames, mel bins)
        valid = mx.array(np.asarray(image.positions, bool))[None]  # (1, frames)
        return self.net(mels, valid)[0]  # (tokens, text hidden)

    def attach(self, net: Any) -> None:
        if isinstance(net, Gemma3n):
            embedder = self.net.embed_audio
            net.hard_audio = HardTokens(embedder.offset, embedder.hard)

    def uses(self, name: str) -> bool:
        return bool(Gemma3nAudio.sanitize({name: None}))

    def describe(self) -> str:
        c = self.net.config
        return (
            f"USM audio tower, {c.conf_num_hidden_layers} conformer blocks, "
            f"{self.net.tokens} tokens per 30 s clip"
        )


def extractor_settings(folder: Path) -> tuple[dict[str, Any], str] | None:
    """The feature extractor's settings and their file: preprocessor_config.json, or the
    `feature_extractor` of transformers 5's processor_config.json; None without either."""
    from mlxlis.models.config import read_json

    places = (("preprocessor_config.json", None), ("processor_config.json", "feature_extractor"))
    for name, key in places:
        path = folder / name
        if path.is_file():
            cfg = read_json(path)
            inner = cfg.get(key) if key else cfg
            if isinstance(inner, dict) and "feature_size" in inner:
                return inner, str(path)
    return None


def load_hearing(folder: Path, cfg: dict[str, Any], tokenizer: Any, dtype: mx.Dtype):
    """Gemma 3n's audio part from a multimodal folder; None for a text-only folder or one
    without the feature extractor's settings."""
    found = extractor_settings(folder)
    if not isinstance(cfg.get("audio_config"), dict) or found is None:
        return None
    settings, source = found
    keys = (("boa_token_id", 256000), ("audio_token_id", 262273), ("eoa_token_id", 262272))
    markers, ids = marker_tokens(cfg, keys, tokenizer, str(folder / "config.json"))
    extractor = Gemma3nAudioFeatures.from_config(settings, source)
    net = load_gemma3n_audio(folder, dtype)
    return Gemma3nHearing(net, extractor, markers, ids, dtype)
