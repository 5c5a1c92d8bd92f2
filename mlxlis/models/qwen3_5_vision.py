"""Qwen3.5's vision: its ViT and patch merger (transformers' Qwen3_5VisionModel, no deepstack),
its image processing (Qwen2VLImageProcessorPil) and the multimodal RoPE positions of the text
around an image (Qwen3_5Model.get_rope_index), in MLX.

  an image, resized (smart_resize: sides multiples of patch x merge, the pixel count within
  [shortest_edge, longest_edge]; bicubic), rescaled, normalised
  -> patches of p x p, in 2 x 2 merge-block order, each written twice along time (a still image
     is two equal frames): (N, 3·2·p·p); a (rows, cols) patch grid
  -> · W (the checkpoint's Conv3d, stride = kernel: one linear map) + b
  -> + the learned (side x side) position table resampled bilinearly (align_corners) to the grid
  -> L pre-LN blocks: fused qkv, every patch of the image seeing every other, 2-D RoPE over the
     whole head (pairs [rows | cols | rows | cols] of head_dim / 4 frequencies, θ = 10⁴, float32),
     a tanh-GELU MLP
  -> the merger: LayerNorm, each 2 x 2 block's four patches side by side, fc1, exact GELU, fc2:
     (N / 4, text hidden), row-major over the merged grid.
In the language model the image's placeholders (`<|image_pad|>` x N / 4 between
<|vision_start|> and <|vision_end|>) take those rows, attention stays causal, and RoPE reads three
position streams interleaved over its pairs (pair i: rows when i % 3 == 1, cols when 2, else
time, within mrope_section): an image starting at P (its index plus the shift so far) is at
(P, P + row, P + col); text after it continues from P + max(rows, cols) of the merged grid — so
every later position runs max(rows, cols) − rows·cols behind its index (`shift`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, MlxlisError
from mlxlis.models.multimodal import (
    ImageSpan,
    PromptImage,
    bind_vision,
    expand_markers,
    marker_tokens,
    processor_settings,
)
from mlxlis.prompt.images import RESAMPLE, to_rgb
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from PIL import Image

MAX_ASPECT = 200  # smart_resize refuses longer strips
QUERY_BLOCK = 2048  # patches whose attention one step computes


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        """The learned position table's side."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], path: str) -> VisionConfig:
        v = cfg.get("vision_config")
        if not isinstance(v, dict):
            raise ConfigError(
                "no vision_config: a text-only model", path=path, field="vision_config"
            )

        def num(key: str, default: Any, alias: str | None = None) -> int:
            value = v.get(key, v.get(alias, default) if alias else default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"expected a positive integer, got {value!r}",
                    path=path,
                    field=f"vision_config.{key}",
                )
            return value

        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(
                f"activation {act!r} is not implemented",
                path=path,
                field="vision_config.hidden_act",
            )
        rope = v.get("rope_parameters") or {}
        out = cls(
            depth=num("depth", 27, "num_hidden_layers"),
            hidden_size=num("hidden_size", 1152),
            intermediate_size=num("intermediate_size", 4304),
            num_heads=num("num_heads", 16, "num_attention_heads"),
            patch_size=num("patch_size", 16),
            spatial_merge_size=num("spatial_merge_size", 2),
            temporal_patch_size=num("temporal_patch_size", 2),
            out_hidden_size=num("out_hidden_size", 3584),
            num_position_embeddings=num("num_position_embeddings", 2304),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            in_channels=num("in_channels", 3),
        )
        if out.hidden_size % out.num_heads or out.head_dim % 4:
            raise ConfigError(
                "hidden_size / num_heads must be a multiple of 4 (2-D RoPE)",
                path=path,
                field="vision_config.num_heads",
            )
        if out.side**2 != out.num_position_embeddings:
            raise ConfigError(
                "not a square number", path=path, field="vision_config.num_position_embeddings"
            )
        text = cfg.get("text_config") or {}
        if text.get("hidden_size", out.out_hidden_size) != out.out_hidden_size:
            raise ConfigError(
                "the merger's output is not the language model's hidden size",
                path=path,
                field="vision_config.out_hidden_size",
            )
        return out


def block_order(rows: int, cols: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in the processor's order: merge block by merge block,
    row-major, each block's m x m patches row-major."""
    r = np.broadcast_to(np.arange(rows).reshape(rows // m, m, 1, 1), (rows // m, m, cols // m, m))
    c = np.broadcast_to(np.arange(cols).reshape(1, 1, cols // m, m), (rows // m, m, cols // m, m))
    return r.transpose(0, 2, 1, 3).reshape(-1), c.transpose(0, 2, 1, 3).reshape(-1)


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n, d = x.shape
        q, k, v = mx.split(self.qkv(x).reshape(n, 3, self.heads, -1), 3, axis=1)
        q, k, v = (a[:, 0].transpose(1, 0, 2) for a in (q, k, v))  # (heads, N, head_dim)
        q, k = _turn(q, cos, sin), _turn(k, cos, sin)
        scale = q.shape[-1] ** -0.5
        # every patch sees every patch of its image, QUERY_BLOCK queries at a time: a 4096 px
        # square is 65 536 patches, and a head size of 72 has no fused kernel (its scores
        # would be 16 x 65 536² at once)
        out = mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(
                    q[None, :, a : a + QUERY_BLOCK], k[None], v[None], scale=scale
                )[0]
                for a in range(0, n, QUERY_BLOCK)
            ],
            axis=1,
        )
        return self.proj(out.transpose(1, 0, 2).reshape(n, d))


def _turn(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x·cos + rotate_half(x)·sin in float32 (transformers' apply_rotary_pos_emb_vision)."""
    h = x.astype(mx.float32)
    a, b = mx.split(h, 2, axis=-1)
    return (h * cos + mx.concatenate([-b, a], axis=-1) * sin).astype(x.dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(nn.gelu_approx(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = _Attention(cfg)
        self.mlp = _MLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        wide = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(wide, wide)
        self.linear_fc2 = nn.Linear(wide, cfg.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.norm(x)
        h = h.reshape(
            -1, self.linear_fc1.weight.shape[1]
        )  # each merge block's patches side by side
        return self.linear_fc2(nn.gelu(self.linear_fc1(h)))


class Qwen35Vision(nn.Module):
    """Qwen3_5VisionModel for one image: (N, 3·T·p·p) patch rows in block order on a
    (rows, cols) grid -> (N / merge², text hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        self.patch_embed.proj.weight = mx.zeros((cfg.hidden_size, c, t, p, p))
        self.patch_embed.proj.bias = mx.zeros((cfg.hidden_size,))
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = [_Block(cfg) for _ in range(cfg.depth)]
        self.merger = _Merger(cfg)

    def positions(self, rows: int, cols: int) -> mx.array:
        """(N, hidden): the position table resampled to the grid (bilinear, align_corners),
        in block order, float32 (transformers' get_vision_interpolation_indices_and_weights)."""
        cfg, side = self.config, self.config.side
        r, c = block_order(rows, cols, cfg.spatial_merge_size)

        def taps(idx: np.ndarray, size: int):
            src = idx.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            low = np.floor(src)
            frac = (src - low).astype(np.float32)
            at = np.clip(np.stack([low, low + 1], 1).astype(np.int64), 0, side - 1)
            return at, np.stack([1 - frac, frac], 1)

        (ra, rw), (ca, cw) = taps(r, rows), taps(c, cols)
        table = self.pos_embed.weight.astype(mx.float32)
        out = 0
        for a in range(2):
            for b in range(2):
                w = mx.array((rw[:, a] * cw[:, b]).astype(np.float32))[:, None]
                out = out + table[mx.array(ra[:, a] * side + ca[:, b])] * w
        return out

    def rope(self, rows: int, cols: int) -> tuple[mx.array, mx.array]:
        """cos, sin (1, N, head_dim): pairs [rows | cols | rows | cols], float32."""
        hd = self.config.head_dim
        inv = 1.0 / (
            self.config.rope_theta ** (np.arange(0, hd // 2, 2, dtype=np.float32) / (hd // 2))
        )
        r, c = block_order(rows, cols, self.config.spatial_merge_size)
        fr, fc = r[:, None].astype(np.float32) * inv, c[:, None].astype(np.float32) * inv
        ang = mx.array(np.concatenate([fr, fc, fr, fc], -1))[None]
        return mx.cos(ang), mx.sin(ang)

    def __call__(self, patches: mx.array, rows: int, cols: int) -> mx.array:
        w = self.patch_embed.proj.weight
        h = patches @ w.reshape(w.shape[0], -1).T + self.patch_embed.proj.bias
        h = (h.astype(mx.float32) + self.positions(rows, cols)).astype(h.dtype)
        cos, sin = self.rope(rows, cols)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.merger(h)

    @staticmethod
    def sanitize(weights: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's vision tensors (`model.visual.*`) under this module's names."""
        out = {}
        for name, arr in weights.items():
            for prefix in ("model.visual.", "visual."):
                if name.startswith(prefix):
                    out[name.removeprefix(prefix)] = arr
        return out


@dataclass(frozen=True)
class Processing:
    """Qwen2VLImageProcessor's settings (preprocessor_config.json's names; `size`'s edges are
    pixel counts)."""

    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: str) -> Processing:
        size = cfg.get("size") or {}
        try:
            out = cls(
                min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge", 65536)),
                max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge", 16777216)),
                patch_size=int(cfg.get("patch_size", 16)),
                temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
                merge_size=int(cfg.get("merge_size", 2)),
                resample=int(cfg.get("resample", 3)),
                rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                image_mean=tuple(float(x) for x in cfg.get("image_mean", (0.5,) * 3)),
                image_std=tuple(float(x) for x in cfg.get("image_std", (0.5,) * 3)),
                do_convert_rgb=bool(cfg.get("do_convert_rgb", True)),
            )
        except (TypeError, ValueError, AttributeError):
            raise MlxlisError(
                "expected numeric processor settings", path=path, field="size"
            ) from None
        if not 0 < out.min_pixels <= out.max_pixels:
            raise MlxlisError(
                "shortest_edge must be positive and at most longest_edge", path=path, field="size"
            )
        if out.resample not in RESAMPLE:
            raise MlxlisError("a resample filter it cannot use", path=path, field="resample")
        for flag in ("do_resize", "do_rescale", "do_normalize"):
            if cfg.get(flag) is False:
                raise MlxlisError(f"{flag} false is not supported", path=path, field=flag)
        return out

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """smart_resize: sides multiples of patch x merge, the pixel count in range."""
        f = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise MlxlisError(
                f"a {width} x {height} image: the aspect ratio must be under {MAX_ASPECT}",
                field="image",
            )
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        """(patch rows (N, 3·T·p·p) float32 in block order, grid rows, grid cols)."""
        rgb = to_rgb(image) if self.do_convert_rgb else image
        h, w = self.target_size(rgb.height, rgb.width)
        if (h, w) != (rgb.height, rgb.width):
            rgb = rgb.resize((w, h), resample=RESAMPLE[self.resample])
        x = np.moveaxis(np.asarray(rgb), -1, 0)
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = (x - np.array(self.image_mean, np.float32)[:, None, None]) / np.array(
            self.image_std, np.float32
        )[:, None, None]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, cols = h // p, w // p
        x = x.reshape(3, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t, p, p))  # frames after C
        return np.ascontiguousarray(x.reshape(rows * cols, 3 * t * p * p)), rows, cols


class Qwen35Images:
    """Qwen3.5's way of seeing (multimodal.Vision)."""

    bidirectional = False  # image tokens attend causally, as text

    def __init__(
        self,
        net: Qwen35Vision,
        processing: Processing,
        pad: str,
        image_token_id: int,
        rotary_dim: int,
        mrope_section: tuple[int, int, int],
        dtype: mx.Dtype,
    ):
        self.net = net
        self.processing = processing
        self.pad = pad  # <|image_pad|>: the template writes one per image
        self.image_token_id = image_token_id
        self.fill_id = image_token_id  # in the vocabulary; its embedding is replaced
        self.dtype = dtype
        pairs = rotary_dim // 2
        stream = np.zeros(pairs, np.int64)  # per RoPE pair: 0 time, 1 rows, 2 cols
        stream[1 : 3 * mrope_section[1] : 3] = 1
        stream[2 : 3 * mrope_section[2] : 3] = 2
        self.stream = stream

    def _grid(self, image: PromptImage) -> tuple[int, int]:
        m = self.processing.merge_size
        _, rows, cols = (int(x) for x in image.positions)
        return rows // m, cols // m

    def shift(self, spans: Sequence[ImageSpan], p: int) -> int:
        out = 0
        for s in spans:
            if s.end <= p:
                lh, lw = self._grid(s.image)
                out += max(lh, lw) - lh * lw
        return out

    def positions(self, spans: Sequence[ImageSpan], at: int, n: int) -> mx.array:
        index = np.arange(at, at + n)
        streams = np.repeat((index + self.shift(spans, at))[None], 3, 0)  # (3, n), text
        for s in spans:
            if at <= s.start < at + n:
                lh, lw = self._grid(s.image)
                start = s.start + self.shift(spans, s.start)
                j, o = np.arange(lh * lw), s.start - at
                streams[:, o : o + lh * lw] = [start + 0 * j, start + j // lw, start + j % lw]
                after = start + max(lh, lw)  # the text after it continues from here
                streams[:, o + lh * lw :] = after + np.arange(n - o - lh * lw)[None]
        return mx.array(streams[self.stream].T.astype(np.float32))  # (n, rotary pairs)

    def expand(self, text: str, images: Sequence[PromptImage]) -> str:
        return expand_markers(text, self.pad, images, lambda im: self.pad * im.tokens)

    def marker_count(self, text: str) -> int:
        return text.count(self.pad)

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        patches, rows, cols = self.processing.preprocess(image)
        m = self.processing.merge_size
        grid = np.array([1, rows, cols], np.int32)  # in the digest: equal pixels, other grids
        return PromptImage.of(patches, image.size, rows * cols // (m * m), name, grid)

    def uses(self, name: str) -> bool:
        return bool(self.net.sanitize({name: None}))

    def describe(self) -> str:
        p = self.processing
        return f"Qwen3.5 ViT, {p.min_pixels}–{p.max_pixels} pixels per image"

    def features(self, image: PromptImage) -> mx.array:
        _, rows, cols = (int(x) for x in image.positions)
        return self.net(mx.array(image.pixels).astype(self.dtype), rows, cols)


def load_images(
    folder: Path, cfg: dict[str, Any], tokenizer: Tokenizer, dtype: mx.Dtype
) -> Qwen35Images | None:
    """Qwen3.5's vision from a multimodal folder; None for a text-only folder or one without
    an image processor's settings."""
    from mlxlis.loading.safetensors import load_tensors

    found = processor_settings(folder)
    if not isinstance(cfg.get("vision_config"), dict) or found is None:
        return None
    settings, source = found
    where = str(folder / "config.json")
    (pad,), (image_id,) = marker_tokens(cfg, (("image_token_id", 248056),), tokenizer, where)
    vcfg = VisionConfig.from_hf(cfg, where)
    processing = Processing.from_config(settings, source)
    if (processing.patch_size, processing.merge_size, processing.temporal_patch_size) != (
        vcfg.patch_size,
        vcfg.spatial_merge_size,
        vcfg.temporal_patch_size,
    ):
        raise ConfigError(
            "the processor's patch, merge and temporal sizes are not the tower's",
            path=where,
            field="vision_config.patch_size",
        )
    text = cfg.get("text_config") or {}
    rope = text.get("rope_parameters") or {}
    section = rope.get("mrope_section", [11, 11, 10])
    if not (
        isinstance(section, list) and len(section) == 3 and all(isinstance(x, int) for x in section)
    ):
        raise ConfigError(
            f"expected three integers, got {section!r}"[:200],
            path=where,
            field="text_config.rope_parameters.mrope_section",
        )
    head_dim = text.get("head_dim", 256)
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    net = Qwen35Vision(vcfg)
    bind_vision(net, Qwen35Vision.sanitize(load_tensors(folder)), folder, dtype)
    rotary = int(head_dim * factor)
    return Qwen35Images(net, processing, pad, image_id, rotary, tuple(section), dtype)
