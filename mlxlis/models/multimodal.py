"""Images in a prompt: what a model that sees takes beside the token ids, and how a forward
step uses it.

A prompt with images is token ids in which each image is a run of placeholder ids (the
family's image token, as many as its tokens per image) plus the preprocessed images in order
(`Prompt`). `image_spans` pairs each run with its image. A forward step over a chunk holding
whole runs (`Inserts`) embeds the ids, puts each image's features in place of its run's
embeddings, and lets the positions of one run see each other both ways (transformers'
`token_type_ids` blocks: OR-ed into the causal mask, AND-ed with the sliding window); text
stays causal. The caches know an image by its content: `cache_ids` replaces each run's ids by
ids derived from the image's digest, so a prefix entry is reused only for the same image.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mlxlis.errors import ConfigError, FileFormatError, MlxlisError

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image, preprocessed for its model: `pixels` as the tower takes them (and their
    patches' `positions` where the tower reads those), `tokens` the placeholders it fills,
    `digest` the SHA-256 of the pixels (what the caches key it by), `size` the original
    (width, height)."""

    pixels: np.ndarray
    digest: str
    size: tuple[int, int]
    tokens: int
    name: str = "image"  # what surfaces call it (a file name, "image 1")
    positions: np.ndarray | None = None
    crops: tuple[PromptImage, ...] = ()  # Gemma 3's pan and scan: each its own run after it

    @classmethod
    def of(
        cls,
        pixels: np.ndarray,
        size: tuple[int, int],
        tokens: int,
        name: str = "image",
        positions: np.ndarray | None = None,
        crops: tuple[PromptImage, ...] = (),
    ) -> PromptImage:
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        digest = hashlib.sha256(pixels.tobytes() + str(pixels.shape).encode())
        if positions is not None:
            digest.update(np.ascontiguousarray(positions, np.int32).tobytes())
        return cls(pixels, digest.hexdigest(), size, tokens, name, positions, crops)

    def runs(self) -> tuple[PromptImage, ...]:
        """The images whose placeholder runs it makes, in order: itself, then its crops."""
        return (self, *self.crops)


@dataclass(frozen=True)
class Prompt:
    """Token ids with each image's placeholders expanded (`ids`) and the images (`images`),
    in the order their runs appear."""

    ids: list[int]
    images: tuple[PromptImage, ...] = ()
    text: str = ""  # the rendered text the ids encode (placeholders expanded)
    sources: tuple[int, ...] = ()  # per image: which of the messages' images it is (or crops)


@dataclass(frozen=True)
class ImageSpan:
    """The run of placeholder ids at [start, start + length) that `image` fills."""

    start: int
    length: int
    image: PromptImage

    @property
    def end(self) -> int:
        return self.start + self.length


class Vision(Protocol):
    """What a family's vision part gives the model (gemma3_vision.Gemma3Images)."""

    image_token_id: int  # the placeholder id each image's features replace
    fill_id: int  # the id a placeholder is read as before its features replace it
    bidirectional: bool  # an image's positions see each other both ways (Gemma: yes)

    def positions(self, spans: Sequence[ImageSpan], at: int, n: int) -> mx.array | None:
        """Explicit RoPE positions (n, rotary pairs) of the prompt's ids [at, at + n), where
        the family's positions over an image are not its indices (Qwen3.5's M-RoPE); None:
        each position is its index plus `shift`."""
        ...

    def shift(self, spans: Sequence[ImageSpan], p: int) -> int:
        """How far the RoPE position of index `p` (and, once the prompt is read, of every
        later one) runs ahead of `p` after the images before it (Qwen3.5: negative)."""
        ...

    def expand(self, text: str, images: Sequence[PromptImage]) -> str:
        """The rendered prompt with each image marker the template wrote expanded as the
        processor does (the image's placeholders, with the tokens around them)."""
        ...

    def marker_count(self, text: str) -> int:
        """How many image markers the rendered prompt holds."""
        ...

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        """An opened image preprocessed as the family's processor does."""
        ...

    def features(self, image: PromptImage) -> mx.array:
        """(image.tokens, text hidden) embeddings that replace its placeholders."""
        ...

    def uses(self, name: str) -> bool:
        """Whether the checkpoint's tensor `name` is one of the vision part's."""
        ...

    def describe(self) -> str:
        """The vision part, in words (for `describe`)."""
        ...


FEATURES_KEPT = 8  # images whose features a tower keeps (a second request about one)


@runtime_checkable
class Hearing(Protocol):
    """A multimodal part whose clips are audio (gemma3n_hearing.Gemma3nHearing): the seam
    audio content parts go through."""

    rate: int  # the sample rate in Hz the tower's features are made at
    tasks: tuple[str, ...]  # what /v1/audio/* may ask of it: "transcribe", "translate"

    def prepare_audio(self, source: Any, field: str, name: str) -> PromptImage:
        """A path or bytes decoded, resampled and turned into the tower's input; an
        AudioError naming `field` for bad audio."""
        ...

    def attach(self, net: Any) -> None:
        """Give the language model what it embeds of the part's own vocabulary."""
        ...


@runtime_checkable
class Transcribes(Protocol):
    """A Hearing with a transcription request of its own, not a chat (Voxtral's)."""

    rate: int

    def prepare_audio(self, source: Any, field: str, name: str) -> PromptImage: ...

    def transcription(self, clip: PromptImage, language: str | None) -> list[int]:
        """The request's prompt ids for `clip` (its placeholder run included), in `language`
        (an ISO-639-1 code) or the model's own detection (None)."""
        ...


class CachedVision:
    """A vision tower that keeps the features of the last FEATURES_KEPT images it gave, by
    digest (a chat's later turns, a second request about one image); the rest is the tower's."""

    def __init__(self, tower: Vision):
        self.tower = tower
        self._features: OrderedDict[str, mx.array] = OrderedDict()  # by image digest

    @property
    def image_token_id(self) -> int:
        return self.tower.image_token_id

    @property
    def fill_id(self) -> int:
        return self.tower.fill_id

    @property
    def bidirectional(self) -> bool:
        return self.tower.bidirectional

    def features(self, image: PromptImage) -> mx.array:
        out = self._features.pop(image.digest, None)
        if out is None:
            out = self.tower.features(image)
            mx.eval(out)
        self._features[image.digest] = out
        while len(self._features) > FEATURES_KEPT:
            self._features.popitem(last=False)
        return out

    def positions(self, spans: Sequence[ImageSpan], at: int, n: int) -> mx.array | None:
        return self.tower.positions(spans, at, n)

    def shift(self, spans: Sequence[ImageSpan], p: int) -> int:
        return self.tower.shift(spans, p)

    def expand(self, text: str, images: Sequence[PromptImage]) -> str:
        return self.tower.expand(text, images)

    def marker_count(self, text: str) -> int:
        return self.tower.marker_count(text)

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        return self.tower.prepare(image, name)

    def uses(self, name: str) -> bool:
        return self.tower.uses(name)

    def describe(self) -> str:
        return self.tower.describe()


class BlockPositions:
    """For a Vision whose image positions are their indices and whose image runs see
    themselves both ways (Gemma 3 and 4)."""

    bidirectional = True

    def positions(self, spans: Sequence[ImageSpan], at: int, n: int) -> None:
        return None

    def shift(self, spans: Sequence[ImageSpan], p: int) -> int:
        return 0


def image_spans(
    ids: Sequence[int], images: Sequence[PromptImage], token_id: int
) -> tuple[ImageSpan, ...]:
    """Each run of `token_id` in `ids` paired with the next of `images`; an MlxlisError
    (field "images") when the runs and the images do not pair up one to one, each run as
    long as its image's tokens, or a run ends the prompt (no position after it to predict
    from)."""
    arr = np.asarray(ids, dtype=np.int64)
    hit = np.concatenate([[False], arr == token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
    if len(runs) != len(images):
        raise MlxlisError(
            f"the prompt holds {len(runs)} image placeholder runs for {len(images)} images",
            field="images",
        )
    spans = []
    for i, ((a, b), image) in enumerate(zip(runs, images, strict=True)):
        if b - a != image.tokens:
            raise MlxlisError(
                f"image {i + 1}'s placeholder run is {b - a} tokens, the image fills "
                f"{image.tokens}",
                field="images",
            )
        spans.append(ImageSpan(a, b - a, image))
    if spans and spans[-1].end >= len(ids):
        raise MlxlisError("an image ends the prompt: nothing follows it", field="images")
    return tuple(spans)


def cache_ids(ids: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """`ids` with each image's placeholders replaced by negative ids from its digest (and the
    position in its run): what prefix and disk caches key the sequence by, so the same ids
    with another image share only what precedes it."""
    if not spans:
        return list(ids)
    out = list(ids)
    for s in spans:
        base = int(s.image.digest[:16], 16)  # 64 bits of the SHA-256
        for k in range(s.start, min(s.end, len(out))):
            out[k] = -1 - (base + k - s.start) % (1 << 62)
    return out


@dataclass
class Inserts:
    """What one forward step over a chunk of a prompt takes beside its ids: for each image
    whose run the chunk holds, the run's offset in the chunk and its (length, hidden)
    features."""

    parts: list[tuple[int, mx.array]] = field(default_factory=list)
    fill: int = 0  # the id placeholders are read as (Vision.fill_id)
    bidirectional: bool = True  # an image's positions see each other both ways (Gemma)
    positions: mx.array | None = None  # (t, rotary pairs) explicit RoPE positions (Qwen3.5)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def blocks(self, t: int) -> mx.array:
        """(t,) int32: each position's image (its index in `parts`), -1 for text."""
        out = np.full(t, -1, np.int32)
        for j, (o, f) in enumerate(self.parts):
            out[o : o + f.shape[0]] = j
        return mx.array(out)

    def ids(self, inputs: mx.array) -> mx.array:
        """(1, t) ids with each run's placeholders read as `fill` (their embeddings are
        replaced, but a placeholder id past the vocabulary must not index the embedding, and
        Gemma 4's per-layer embeddings read the pad id there), as transformers does."""
        return mx.where(self.blocks(inputs.shape[1])[None] >= 0, self.fill, inputs)

    def place(self, h: mx.array) -> mx.array:
        """(1, t, hidden) embeddings with each run's replaced by its features."""
        pieces, at = [], 0
        for o, f in sorted(self.parts, key=lambda p: p[0]):
            pieces += [h[:, at:o], f[None].astype(h.dtype)]
            at = o + f.shape[0]
        pieces.append(h[:, at:])
        return mx.concatenate(pieces, axis=1)


def with_blocks(base: mx.array, blocks: mx.array, window: int | None) -> mx.array:
    """A (t, K) boolean mask whose last t columns are the chunk's own keys, with the
    positions of one image (`blocks`, (t,), -1 text) also seeing each other; on a sliding
    layer (`window`) only within the window (transformers: AND(window, OR(causal, block)))."""
    t, k = blocks.shape[0], base.shape[-1]
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)  # (t, t)
    if window is not None:
        pos = mx.arange(t)
        same = same & (pos[None, :] > pos[:, None] - window)
    if k > t:
        same = mx.concatenate([mx.zeros((t, k - t), dtype=mx.bool_), same], axis=1)
    return base | same


# --- what the families' vision loaders share ---
def processor_settings(folder: Path) -> tuple[dict[str, Any], str] | None:
    """The image processor's settings and the file they are in (what a refusal names):
    preprocessor_config.json, or the `image_processor` of transformers 5's
    processor_config.json; None when the folder has neither."""
    from mlxlis.models.config import read_json

    if (folder / "preprocessor_config.json").is_file():
        path = folder / "preprocessor_config.json"
        return read_json(path), str(path)
    if (folder / "processor_config.json").is_file():
        path = folder / "processor_config.json"
        cfg = read_json(path)
        inner = cfg.get("image_processor")
        return (inner if isinstance(inner, dict) else cfg), str(path)
    return None


def expand_markers(
    text: str, marker: str, images: Sequence[PromptImage], run: Callable[[PromptImage], str]
) -> str:
    """`text` with its k-th `marker` replaced by `run(images[k])` (as a processor's
    replace_image_token does); unchanged when the count differs (the caller refuses it)."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(images):
        return text
    out = [pieces[0]]
    for image, rest in zip(images, pieces[1:], strict=True):
        out += [run(image), rest]
    return "".join(out)


def marker_tokens(
    cfg: dict[str, Any], keys: Sequence[tuple[str, int]], tokenizer: Any, where: str
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The token strings and ids config.json names under `keys` (each (key, default);
    `*_index` also read as `*_id`): each must read back as its one special token, else a
    ConfigError naming the key."""
    strings, ids = [], []
    for key, default in keys:
        alias = (
            key.replace("_index", "_id") if key.endswith("_index") else key.replace("_id", "_index")
        )
        i = cfg.get(key, cfg.get(alias, default))
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"expected a token id, got {i!r}", path=where, field=key)
        token = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else ""
        if not token or tokenizer.encode(token, True, add_bos=False, add_eos=False) != [i]:
            raise ConfigError(
                f"token {i} is not a special token of the tokenizer", path=where, field=key
            )
        strings.append(token)
        ids.append(i)
    return tuple(strings), tuple(ids)


def bind_vision(net: nn.Module, theirs: dict[str, mx.array], folder: Path, dtype: mx.Dtype) -> None:
    """Load `theirs` into `net` in `dtype`; a missing, extra or misshapen tensor is a
    FileFormatError naming it."""
    ours = dict(tree_flatten(net.parameters()))
    if missing := sorted(ours.keys() - theirs.keys()):
        raise FileFormatError(f"no tensor for {missing[0]}", path=folder, field=missing[0])
    if extra := sorted(theirs.keys() - ours.keys()):
        raise FileFormatError(
            f"a tensor the vision model has no place for: {extra[0]}", path=folder, field=extra[0]
        )
    for name, arr in theirs.items():
        if arr.shape != ours[name].shape:
            raise FileFormatError(
                f"shape {tuple(arr.shape)}, expected {tuple(ours[name].shape)}",
                path=folder,
                field=name,
            )
    net.load_weights([(k, v.astype(dtype)) for k, v in theirs.items()])
    mx.eval(net.parameters())
