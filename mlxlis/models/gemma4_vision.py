"""Gemma 4's vision: its encoder, pooler and multimodal embedder, from transformers'
Gemma4VisionModel and Gemma4MultimodalEmbedder, in MLX; and its image processing
(Gemma4ImageProcessorPil: variable resolution).

  an image, resized (aspect ratio kept, bicubic) to the largest h x w that are multiples of
  pooling_kernel x patch and hold at most max_soft_tokens x kernel² patches; rescaled to
  [0, 1] (not normalised)
  -> patches (N, p·p·3), each row-major (y, x, channel), with (x, y) positions
  -> 2·(x − 0.5) · W_in + the x and y rows of a learned 2-D position table
  -> L layers: sandwich RMSNorms (x̂·w, float32) around attention and a gated MLP; attention
     bidirectional over the image's patches, q and k RMS-normed then turned by 2-D RoPE (the
     first half of each head by x, the second by y, θ = rope_theta), v RMS-normed (no
     scale), scale 1; linears optionally clamped (use_clipped_linears)
  -> average pooling of each kernel x kernel square, × √hidden (float32), optionally
     standardised ((h − std_bias) · std_scale)
  -> the embedder: RMSNorm (no scale), then · W (vision hidden -> text hidden): one embedding
     per soft token, row-major over the pooled grid.
Our tower reads each image's own patches (transformers pads a batch to max_patches and masks
the padding out of attention and pooling: the same numbers).

`Gemma4Images` is what the model holds to see (multimodal.Vision): each image marker the
template writes (`<|image|>`) becomes <boi> + N x <|image|> + <eoi>, N the image's soft tokens
(Gemma4Processor.replace_image_token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, MlxlisError
from mlxlis.models.gemma4_net import PLAIN_ACTS
from mlxlis.models.multimodal import (
    BlockPositions,
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

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets Gemma4ImageProcessor accepts


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_activation: str
    rms_norm_eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    text_hidden: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], path: str) -> VisionConfig:
        v = cfg.get("vision_config")
        if not isinstance(v, dict):
            raise ConfigError(
                "no vision_config: a text-only model", path=path, field="vision_config"
            )
        text = cfg.get("text_config") or {}

        def num(src: dict, key: str, default: Any, kind=int) -> Any:
            value = src.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                where = ("vision_config." if src is v else "text_config.") + key
                raise ConfigError(
                    f"expected a positive number, got {value!r}", path=path, field=where
                )
            return kind(value)

        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(
                "Gemma 4's vision RoPE is axial", path=path, field="vision_config.rope_parameters"
            )
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in PLAIN_ACTS:
            raise ConfigError(
                f"activation {act!r} is not implemented",
                path=path,
                field="vision_config.hidden_activation",
            )
        out = cls(
            hidden_size=num(v, "hidden_size", 768),
            intermediate_size=num(v, "intermediate_size", 3072),
            num_hidden_layers=num(v, "num_hidden_layers", 16),
            num_attention_heads=num(v, "num_attention_heads", 12),
            num_key_value_heads=num(v, "num_key_value_heads", 12),
            head_dim=num(v, "head_dim", 64),
            hidden_activation=act,
            rms_norm_eps=num(v, "rms_norm_eps", 1e-6, float),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            pooling_kernel_size=num(v, "pooling_kernel_size", 3),
            patch_size=num(v, "patch_size", 16),
            position_embedding_size=num(v, "position_embedding_size", 10240),
            use_clipped_linears=bool(v.get("use_clipped_linears", False)),
            standardize=bool(v.get("standardize", False)),
            text_hidden=num(text, "hidden_size", 2560),
        )
        if out.head_dim % 4 or out.num_attention_heads % out.num_key_value_heads:
            raise ConfigError(
                "head_dim must be a multiple of 4 (2-D RoPE) and the heads of the KV heads",
                path=path,
                field="vision_config.head_dim",
            )
        return out


class _Norm(nn.Module):
    """Gemma4RMSNorm: x · (mean(x²) + eps)^-½ in float32, × w where it has a scale."""

    def __init__(self, dims: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        if scale:
            self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        h = x.astype(mx.float32)
        h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if "weight" in self:
            h = h * self.weight.astype(mx.float32)
        return h.astype(x.dtype)


class _Clipped(nn.Module):
    """Gemma4ClippableLinear: a linear map, its input and output clamped where clipped."""

    def __init__(self, cfg: VisionConfig, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        if cfg.use_clipped_linears:
            self.input_min, self.input_max = mx.array(-math.inf), mx.array(math.inf)
            self.output_min, self.output_max = mx.array(-math.inf), mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_min" not in self:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x·cos + rotate_half(x)·sin over x's last axis (transformers' apply_rotary_pos_emb)."""
    a, b = mx.split(x, 2, axis=-1)
    return x * cos + mx.concatenate([-b, a], axis=-1) * sin


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = _Clipped(cfg, d, cfg.num_attention_heads * hd)
        self.k_proj = _Clipped(cfg, d, cfg.num_key_value_heads * hd)
        self.v_proj = _Clipped(cfg, d, cfg.num_key_value_heads * hd)
        self.o_proj = _Clipped(cfg, cfg.num_attention_heads * hd, d)
        self.q_norm = _Norm(hd, cfg.rms_norm_eps)
        self.k_norm = _Norm(hd, cfg.rms_norm_eps)
        self.v_norm = _Norm(hd, cfg.rms_norm_eps, scale=False)

    def __call__(self, x: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
        n, cfg = x.shape[0], self.cfg
        q = self.q_norm(self.q_proj(x).reshape(n, -1, cfg.head_dim))  # (N, heads, head_dim)
        k = self.k_norm(self.k_proj(x).reshape(n, -1, cfg.head_dim))
        v = self.v_norm(self.v_proj(x).reshape(n, -1, cfg.head_dim))
        q, k = _rope2d(q, *rope), _rope2d(k, *rope)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        q, k, v = (a.transpose(1, 0, 2) for a in (q, k, v))  # (heads, N, head_dim)
        if rep > 1:
            k, v = mx.repeat(k, rep, axis=0), mx.repeat(v, rep, axis=0)
        scores = q @ k.swapaxes(-1, -2)  # scale 1: q and k are normed
        probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(q.dtype)
        out = (probs @ v).transpose(1, 0, 2).reshape(n, -1)
        return self.o_proj(out)


def _rope2d(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (N, heads, head_dim): the first half turned by the x angles, the second by the y
    angles (cos, sin: (N, 2, head_dim / 2), each half's angles repeated as [f, f])."""
    half = x.shape[-1] // 2
    parts = [
        _rotate(x[..., k * half : (k + 1) * half], cos[:, None, k], sin[:, None, k])
        for k in range(2)
    ]
    return mx.concatenate(parts, axis=-1)


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = _Clipped(cfg, d, f), _Clipped(cfg, d, f)
        self.down_proj = _Clipped(cfg, f, d)
        self.act = PLAIN_ACTS[cfg.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm, self.post_attention_layernorm = _Norm(d, eps), _Norm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = (
            _Norm(d, eps),
            _Norm(d, eps),
        )

    def __call__(self, h: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class _PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, cfg.position_embedding_size, cfg.hidden_size))

    def __call__(self, patches: mx.array, pos: mx.array) -> mx.array:
        h = self.input_proj((2 * (patches - 0.5)).astype(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return h + table[0][pos[:, 0]] + table[1][pos[:, 1]]


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [_Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class VisionTower(nn.Module):
    """Gemma4VisionModel for one image: patches (N, p·p·3) and their (x, y) positions
    (N, 2) on a (rows, cols) grid -> (N / kernel², hidden) pooled soft tokens."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = _PatchEmbedder(cfg)
        self.encoder = _Encoder(cfg)
        if cfg.standardize:
            self.std_bias = mx.zeros((cfg.hidden_size,))
            self.std_scale = mx.ones((cfg.hidden_size,))

    def rope(self, pos: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """cos, sin (N, 2, head_dim / 2) of the axial RoPE at (x, y) positions `pos`."""
        spatial = self.cfg.head_dim // 2
        inv = 1.0 / (self.cfg.rope_theta ** (mx.arange(0, spatial, 2, dtype=mx.float32) / spatial))
        freqs = pos.astype(mx.float32)[..., None] * inv  # (N, 2, head_dim / 4)
        freqs = mx.concatenate([freqs, freqs], axis=-1)
        return mx.cos(freqs).astype(dtype), mx.sin(freqs).astype(dtype)

    def __call__(self, patches: mx.array, pos: mx.array) -> mx.array:
        cfg, k = self.cfg, self.cfg.pooling_kernel_size
        h = self.patch_embedder(patches, pos)
        rope = self.rope(pos, h.dtype)
        for layer in self.encoder.layers:
            h = layer(h, rope)
        # the pooler: each kernel x kernel square averaged (float32), then × √hidden
        cols = int(pos[:, 0].max().item()) + 1
        cell = (pos[:, 0] // k) + (cols // k) * (pos[:, 1] // k)  # (N,) its pooled token
        n_out = h.shape[0] // (k * k)
        weights = (cell[None, :] == mx.arange(n_out)[:, None]).astype(mx.float32) / (k * k)
        pooled = (weights @ h.astype(mx.float32)).astype(h.dtype)
        pooled = pooled.astype(mx.float32) * cfg.hidden_size**0.5
        if cfg.standardize:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled.astype(h.dtype)


class Embedder(nn.Module):
    """Gemma4MultimodalEmbedder: RMSNorm without scale, then vision hidden -> text hidden."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embedding_pre_projection_norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps, scale=False)
        self.embedding_projection = nn.Linear(cfg.hidden_size, cfg.text_hidden, bias=False)

    def __call__(self, h: mx.array) -> mx.array:
        return self.embedding_projection(self.embedding_pre_projection_norm(h))


class Gemma4Vision(nn.Module):
    """The tower and the embedder: one image's patches and positions -> (tokens, text hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg)
        self.embed_vision = Embedder(cfg)

    def __call__(self, patches: mx.array, pos: mx.array) -> mx.array:
        return self.embed_vision(self.vision_tower(patches, pos))

    @staticmethod
    def sanitize(weights: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's vision tensors under this module's names (`model.` dropped)."""
        out = {}
        for name, arr in weights.items():
            name = name.removeprefix("model.")
            if name.startswith(("vision_tower.", "embed_vision.")):
                out[name] = arr
        return out


@dataclass(frozen=True)
class Processing:
    """Gemma4ImageProcessor's settings (preprocessor_config.json's names)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = 3  # bicubic
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: str) -> Processing:
        try:
            out = cls(
                patch_size=int(cfg.get("patch_size", 16)),
                max_soft_tokens=int(cfg.get("max_soft_tokens", 280)),
                pooling_kernel_size=int(cfg.get("pooling_kernel_size", 3)),
                resample=int(cfg.get("resample", 3)),
                rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                do_normalize=bool(cfg.get("do_normalize", False)),
                image_mean=tuple(float(x) for x in cfg.get("image_mean", (0.0,) * 3)),
                image_std=tuple(float(x) for x in cfg.get("image_std", (1.0,) * 3)),
                do_convert_rgb=bool(cfg.get("do_convert_rgb", True)),
            )
        except (TypeError, ValueError):
            raise MlxlisError(
                "expected numeric processor settings", path=path, field="patch_size"
            ) from None
        if out.max_soft_tokens not in SOFT_TOKENS:
            raise MlxlisError(
                f"must be one of {SOFT_TOKENS}, not {out.max_soft_tokens}",
                path=path,
                field="max_soft_tokens",
            )
        if out.resample not in RESAMPLE:
            raise MlxlisError("a resample filter it cannot use", path=path, field="resample")
        for flag in ("do_resize", "do_rescale"):
            if cfg.get(flag) is False:
                raise MlxlisError(f"{flag} false is not supported", path=path, field=flag)
        return out

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """get_aspect_ratio_preserving_size: the largest (h, w), multiples of kernel x patch,
        of the same aspect ratio within the patch budget."""
        p, k = self.patch_size, self.pooling_kernel_size
        budget = self.max_soft_tokens * k * k * p * p  # pixels
        factor = math.sqrt(budget / (height * width))
        side = k * p
        h = int(math.floor(factor * height / side)) * side
        w = int(math.floor(factor * width / side)) * side
        longest = (self.max_soft_tokens * k * k // (k * k)) * side
        if h == 0 and w == 0:
            raise MlxlisError("the image resizes to 0 x 0 pixels", field="image")
        if h == 0:
            h, w = side, min(int(math.floor(width / height)) * side, longest)
        elif w == 0:
            w, h = side, min(int(math.floor(height / width)) * side, longest)
        return h, w

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
        """(patches (N, p·p·3) float32, positions (N, 2) (x, y)), as the reference gives the
        image's unpadded rows."""
        rgb = to_rgb(image) if self.do_convert_rgb else image
        h, w = self.target_size(rgb.height, rgb.width)
        if (h, w) != (rgb.height, rgb.width):
            rgb = rgb.resize((w, h), resample=RESAMPLE[self.resample])
        x = np.moveaxis(np.asarray(rgb), -1, 0)  # (3, H, W) uint8
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, np.float32)[:, None, None]
            x = (x - mean) / np.array(self.image_std, np.float32)[:, None, None]
        p = self.patch_size
        rows, cols = h // p, w // p
        patches = x.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        return patches, np.stack([gx, gy], -1).reshape(-1, 2)


class Gemma4Images(BlockPositions):
    """Gemma 4's way of seeing (multimodal.Vision)."""

    def __init__(
        self,
        net: Gemma4Vision,
        processing: Processing,
        markers: tuple[str, str, str],
        image_token_id: int,
        fill_id: int,
        dtype: mx.Dtype,
    ):
        self.net = net
        self.processing = processing
        self.boi, self.image, self.eoi = markers
        self.image_token_id = image_token_id
        self.fill_id = fill_id  # the text model's pad id (Gemma4Model reads placeholders so)
        self.dtype = dtype

    def expand(self, text: str, images: Sequence[PromptImage]) -> str:
        return expand_markers(  # Gemma4Processor.replace_image_token
            text, self.image, images, lambda im: f"{self.boi}{self.image * im.tokens}{self.eoi}"
        )

    def marker_count(self, text: str) -> int:
        return text.count(self.image)

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        patches, pos = self.processing.preprocess(image)
        k = self.processing.pooling_kernel_size
        return PromptImage.of(patches, image.size, len(patches) // (k * k), name, pos)

    def uses(self, name: str) -> bool:
        return bool(self.net.sanitize({name: None}))

    def describe(self) -> str:
        p = self.processing
        return f"Gemma 4 vision, up to {p.max_soft_tokens} tokens per image"

    def features(self, image: PromptImage) -> mx.array:
        patches = mx.array(image.pixels).astype(self.dtype)
        return self.net(patches, mx.array(image.positions))


def load_images(
    folder: Path, cfg: dict[str, Any], tokenizer: Tokenizer, dtype: mx.Dtype
) -> Gemma4Images | None:
    """Gemma 4's vision from a multimodal folder; None for a text-only folder or one without
    an image processor's settings."""
    from mlxlis.loading.safetensors import load_tensors

    found = processor_settings(folder)
    if not isinstance(cfg.get("vision_config"), dict) or found is None:
        return None
    settings, source = found
    where = str(folder / "config.json")
    keys = (("boi_token_id", 255999), ("image_token_id", 258880), ("eoi_token_id", 258882))
    markers, ids = marker_tokens(cfg, keys, tokenizer, where)
    vcfg = VisionConfig.from_hf(cfg, where)
    processing = Processing.from_config(settings, source)
    if (
        processing.patch_size != vcfg.patch_size
        or processing.pooling_kernel_size != vcfg.pooling_kernel_size
    ):
        raise ConfigError(
            "the processor's patch_size / pooling_kernel_size are not the tower's",
            path=where,
            field="vision_config.patch_size",
        )
    net = Gemma4Vision(vcfg)
    theirs = Gemma4Vision.sanitize(load_tensors(folder))
    bind_vision(net, theirs, folder, dtype)
    pad = (cfg.get("text_config") or {}).get("pad_token_id", 0)
    return Gemma4Images(net, processing, markers, ids[1], int(pad or 0), dtype)
