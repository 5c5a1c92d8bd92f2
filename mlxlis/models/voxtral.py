"""Voxtral (Mistral's audio LM): a Whisper encoder (whisper_encoder.py) and a two-layer
projector into the Llama decoder.

  features     Whisper's log-mels (prompt/whisper_features.py): the clip padded to whole
               30 s chunks, the floor taken over the whole clip, then cut into chunks
  tower        each chunk encoded alone; its (positions, width) states regrouped four
               positions to a row (width × 4 = audio_config.intermediate_size), then
               linear_1, the activation, linear_2: 375 soft tokens per 30 s chunk
  prompt       a clip is "[BEGIN_AUDIO]" and one "[AUDIO]" (audio_token_id) per soft token,
               causal text positions like any other; the chat template writes "[AUDIO]" once
               per clip and it is expanded here (mistral_common's user content)
  transcribe   mistral_common's instruct transcription request: BOS, [INST], the clip,
               [/INST], "lang:xx" where the language is given, [TRANSCRIBE]
HF `voxtral` (VoxtralForConditionalGeneration: `language_model.*` or
`model.language_model.*`, `audio_tower.*`, `multi_modal_projector.*`; text_config a
`llama`). No GGUF of its own (llama.cpp writes its text as `llama`, its tower as an mmproj).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.base import (
    LANGUAGE_MODEL_RENAMES,
    Export,
    Family,
    GGUFFormat,
    GGUFMeta,
    HFFormat,
)
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.multimodal import BlockPositions, PromptImage, expand_markers, marker_tokens
from mlxlis.models.reading import check_act
from mlxlis.models.whisper_encoder import ACTIVATIONS, WhisperEncoder, WhisperEncoderConfig
from mlxlis.prompt.audio import load_audio
from mlxlis.prompt.whisper_features import WhisperFeatures

import mlx.core as mx
import mlx.nn as nn
from PIL import Image

TOWERS = ("audio_tower.", "multi_modal_projector.")
GROUP = 4  # encoder positions per soft token (the projector's input is 4 × the width)


class Projector(nn.Module):
    def __init__(self, inner: int, hidden: int, act: str):
        super().__init__()
        self.linear_1 = nn.Linear(inner, hidden, bias=False)
        self.linear_2 = nn.Linear(hidden, hidden, bias=False)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.act(self.linear_1(x)))


class VoxtralAudio(nn.Module):
    """The encoder and projector: (chunks, mels, frames) -> (chunks × per_chunk, hidden)."""

    def __init__(self, c: WhisperEncoderConfig, hidden: int, act: str):
        super().__init__()
        self.audio_tower = WhisperEncoder(c)
        self.multi_modal_projector = Projector(c.intermediate_size, hidden, act)
        self.inner = c.intermediate_size
        self.per_chunk = c.max_source_positions * c.hidden_size // c.intermediate_size

    def __call__(self, mels: mx.array) -> mx.array:
        states = self.audio_tower(mels)  # (C, positions, width)
        return self.multi_modal_projector(states.reshape(-1, self.inner))  # (C·per_chunk, hidden)


def uses(name: str) -> bool:
    return name.removeprefix("model.").startswith(TOWERS)


class VoxtralHearing(BlockPositions):
    """multimodal.Vision and multimodal.Hearing for Voxtral's encoder."""

    bidirectional = False
    tasks = ("transcribe",)  # mistral_common's request; no documented translation prompt

    def __init__(
        self,
        net: VoxtralAudio,
        extractor: WhisperFeatures,
        ids: dict[str, int],
        tok: Any,
        dtype: mx.Dtype,
    ):
        self.net, self.extractor, self.ids, self.dtype = net, extractor, ids, dtype
        self.rate = extractor.sampling_rate
        self.image_token_id = self.fill_id = ids["audio"]
        self.soft, self.boa = tok.id_to_token(ids["audio"]), tok.id_to_token(ids["begin_audio"])
        self.tokenizer = tok

    def expand(self, text: str, images: list[PromptImage]) -> str:
        return expand_markers(text, self.soft, images, lambda a: self.boa + self.soft * a.tokens)

    def marker_count(self, text: str) -> int:
        return text.count(self.soft)

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        raise UnsupportedError("Voxtral hears, it does not see", field="images")

    def prepare_audio(self, source: Any, field: str, name: str) -> PromptImage:
        x = load_audio(source, self.rate, field)
        mels = self.extractor(x)  # (chunks, mels, frames)
        if not name:
            name = Path(source).name if isinstance(source, (str, Path)) else "audio"
        return PromptImage.of(mels, (len(x), 1), len(mels) * self.net.per_chunk, name)

    def features(self, image: PromptImage) -> mx.array:
        return self.net(mx.array(image.pixels).astype(self.dtype))  # (tokens, hidden)

    def attach(self, net: Any) -> None:
        return None  # the clip's ids are text ids: the decoder embeds them

    def uses(self, name: str) -> bool:
        return uses(name)

    def describe(self) -> str:
        c = self.net.audio_tower.config
        return (
            f"Whisper encoder, {c.num_hidden_layers} layers, "
            f"{self.net.per_chunk} tokens per {self.extractor.chunk_length} s chunk"
        )

    def transcription(self, clip: PromptImage, language: str | None) -> list[int]:
        """mistral_common's instruct transcription request's ids for `clip`."""
        i = self.ids
        ids = [i["bos"], i["inst"], i["begin_audio"], *[i["audio"]] * clip.tokens, i["end_inst"]]
        if language is not None:
            ids += self.tokenizer.encode(f"lang:{language}", False, add_bos=False, add_eos=False)
        return [*ids, i["transcribe"]]


SPECIALS = {  # mistral_common's names for the ids a Voxtral prompt is built of
    "bos": "<s>",
    "inst": "[INST]",
    "end_inst": "[/INST]",
    "begin_audio": "[BEGIN_AUDIO]",
    "transcribe": "[TRANSCRIBE]",
}


def load_hearing(folder: Path, cfg: dict[str, Any], tokenizer: Any, dtype: mx.Dtype):
    """Voxtral's audio part: the encoder and projector from the folder's tensors, the
    extractor's settings from preprocessor_config.json; None without `audio_config`."""
    from mlxlis.loading.safetensors import load_tensors
    from mlxlis.models.gemma3n_hearing import extractor_settings
    from mlxlis.models.multimodal import bind_vision

    where = str(folder / "config.json")
    audio, text = cfg.get("audio_config"), cfg.get("text_config") or {}
    found = extractor_settings(folder)
    if not isinstance(audio, dict) or found is None:
        return None
    extractor = WhisperFeatures.from_config(*found)
    c = WhisperEncoderConfig.from_hf(audio, where)
    if extractor.chunk_frames != c.frames or extractor.feature_size != c.num_mel_bins:
        raise ConfigError(
            f"the extractor's chunks ({extractor.feature_size} × {extractor.chunk_frames}) are "
            f"not the encoder's input ({c.num_mel_bins} × {c.frames})",
            path=found[1],
            field="chunk_length",
        )
    if c.max_source_positions * c.hidden_size % c.intermediate_size:
        raise ConfigError(
            "a chunk's states do not regroup into intermediate_size rows",
            path=where,
            field="audio_config.intermediate_size",
        )
    act = cfg.get("projector_hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(
            f"activation {act!r} is not supported", path=where, field="projector_hidden_act"
        )
    (_,), (audio_id,) = marker_tokens(cfg, (("audio_token_id", 24),), tokenizer, where)
    ids = {"audio": audio_id}
    for key, token in SPECIALS.items():
        got = tokenizer.encode(token, True, add_bos=False, add_eos=False)
        if len(got) != 1:
            raise ConfigError(f"the tokenizer has no {token} token", path=where, field=key)
        ids[key] = got[0]
    net = VoxtralAudio(c, text.get("hidden_size", 3072), act)
    theirs = {k.removeprefix("model."): v for k, v in load_tensors(folder).items() if uses(k)}
    tower = {k: v for k, v in theirs.items() if k.startswith("audio_tower.")}
    rest = {k: v for k, v in theirs.items() if k not in tower}
    sane = WhisperEncoder.sanitize({k.removeprefix("audio_tower."): v for k, v in tower.items()})
    bind_vision(net, {**rest, **{f"audio_tower.{k}": v for k, v in sane.items()}}, folder, dtype)
    return VoxtralHearing(net, extractor, ids, tokenizer, dtype)


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    if cfg.get("model_type") not in (None, "llama", "voxtral"):
        raise UnsupportedError(
            f"a Voxtral text_config of type {cfg.get('model_type')!r} (expected llama)",
            path=path,
            field="text_config.model_type",
        )
    return check_act(base, path)


def _no_gguf(base: ModelConfig, meta: GGUFMeta) -> ModelConfig:
    return base


VOXTRAL = Family(
    name="voxtral",
    hf=HFFormat(
        model_types=("voxtral",),
        parse=parse_hf,
        renames=LANGUAGE_MODEL_RENAMES,
        dropped=TOWERS + tuple(f"model.{t}" for t in TOWERS),
    ),
    gguf=GGUFFormat(archs=(), parse=_no_gguf),
    network=Decoder,
    vision=load_hearing,
    export=Export(  # the text part, as transformers writes it (the tower is not converted)
        model_type="voxtral",
        architecture="VoxtralForConditionalGeneration",
        config=lambda cfg: {"model_type": "llama", "attention_bias": cfg.attention.bias},
        wrapper="voxtral",
        renames=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    ),
)
