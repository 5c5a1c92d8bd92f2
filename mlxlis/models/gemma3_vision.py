"""Gemma 3's vision: SigLIP's vision transformer and Gemma 3's multimodal projector, from
transformers' SiglipVisionModel and Gemma3MultiModalProjector, in MLX.

  pixels (B, 3, S, S), normalised (prompt/images.py)
  -> patches of p x p, each a linear map of its 3·p·p values (the checkpoint's stride-p conv)
  -> + a learned embedding per patch position (no interpolation: S is the config's image_size)
  -> L encoder layers: x + attn(LayerNorm(x)) (every patch sees every patch), then
     x + fc2(gelu_tanh(fc1(LayerNorm(x))))
  -> LayerNorm: (B, N = (S/p)², vision hidden), the tower's last hidden state
  -> the projector: the (S/p) x (S/p) grid average-pooled to mm_tokens_per_image (a square),
     Gemma's RMSNorm (x̂·(1 + w)), then · W (vision hidden, text hidden): one embedding per
     image token, which replaces an image placeholder's embedding in the language model.

`Gemma3Images` is what the model holds to see (multimodal.Vision): the processor's settings, the
placeholder expansion Gemma3Processor does (each `<start_of_image>` the template writes becomes
"\n\n<start_of_image>" + tokens_per_image x `<image_soft_token>` + "<end_of_image>\n\n") and
the features of one image.

Checkpoint names: `vision_tower.vision_model.*` (transformers 4) or `vision_tower.*` (5), and
`multi_modal_projector.*`, each possibly under `model.`; a SigLIP pooling head some configs
keep (`vision_use_head`) is left out, as Gemma 3 reads the patches, never the head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.multimodal import (
    BlockPositions,
    PromptImage,
    bind_vision,
    expand_markers,
    marker_tokens,
    processor_settings,
)
from mlxlis.prompt.images import ImageProcessing
from mlxlis.runtime import fused
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx
import mlx.nn as nn
from PIL import Image


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    tokens_per_image: int  # mm_tokens_per_image: image tokens in the prompt, a square number
    text_hidden: int  # the language model's hidden size (the projection's output)
    num_channels: int = 3

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """Patches per side averaged into one image token."""
        return self.grid // math.isqrt(self.tokens_per_image)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], path: str) -> VisionConfig:
        """From a Gemma 3 multimodal config.json (its vision_config, mm_tokens_per_image and
        text_config.hidden_size); ConfigError naming the field otherwise."""
        vision = cfg.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(
                "no vision_config: a text-only model", path=path, field="vision_config"
            )
        if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise UnsupportedError(
                f"vision tower {vision.get('model_type')!r}: Gemma 3's is SigLIP",
                path=path,
                field="vision_config.model_type",
            )
        text = cfg.get("text_config") or {}

        def num(src: dict, key: str, default: Any, where: str, kind=int):
            v = src.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"expected a positive number, got {v!r}", path=path, field=where)
            return kind(v)

        out = cls(
            hidden_size=num(vision, "hidden_size", 1152, "vision_config.hidden_size"),
            intermediate_size=num(
                vision, "intermediate_size", 4304, "vision_config.intermediate_size"
            ),
            num_hidden_layers=num(
                vision, "num_hidden_layers", 27, "vision_config.num_hidden_layers"
            ),
            num_attention_heads=num(
                vision, "num_attention_heads", 16, "vision_config.num_attention_heads"
            ),
            image_size=num(vision, "image_size", 896, "vision_config.image_size"),
            patch_size=num(vision, "patch_size", 14, "vision_config.patch_size"),
            layer_norm_eps=num(
                vision, "layer_norm_eps", 1e-6, "vision_config.layer_norm_eps", float
            ),
            tokens_per_image=num(cfg, "mm_tokens_per_image", 256, "mm_tokens_per_image"),
            text_hidden=num(text, "hidden_size", 2560, "text_config.hidden_size"),
            num_channels=num(vision, "num_channels", 3, "vision_config.num_channels"),
        )
        side = math.isqrt(out.tokens_per_image)
        if (
            side * side != out.tokens_per_image
            or out.grid % side
            or out.image_size % out.patch_size
        ):
            raise ConfigError(
                f"{out.tokens_per_image} image tokens do not pool a {out.grid} x {out.grid} "
                f"patch grid ({out.image_size} px in patches of {out.patch_size})",
                path=path,
                field="mm_tokens_per_image",
            )
        if out.hidden_size % out.num_attention_heads:
            raise ConfigError(
                "hidden_size is not a multiple of num_attention_heads",
                path=path,
                field="vision_config.num_attention_heads",
            )
        return out


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.scale = (d // self.heads) ** -0.5
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def __call__(self, x: mx.array) -> mx.array:
        b, n, d = x.shape
        q, k, v = (
            p(x).reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )  # (B, heads, N, head_dim)
        scores = (q @ k.swapaxes(-1, -2)) * self.scale
        probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(q.dtype)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
        return self.out_proj(out)


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu_approx(self.fc1(x)))  # SigLIP's gelu_pytorch_tanh


class _Layer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = _Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _MLP(cfg)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        c, p = cfg.num_channels, cfg.patch_size
        # the conv's weight as the checkpoint has it, (out, in, p, p): a linear map per patch
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = mx.zeros((cfg.hidden_size, c, p, p))
        self.patch_embedding.bias = mx.zeros((cfg.hidden_size,))
        self.position_embedding = nn.Embedding(cfg.grid**2, cfg.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        b, c, s, _ = pixels.shape
        p, g = self.cfg.patch_size, self.cfg.grid
        patches = pixels.reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, g * g, c * p * p)  # row by row, each patch (c, y, x)
        w = self.patch_embedding.weight.reshape(self.cfg.hidden_size, -1)
        return patches @ w.T + self.patch_embedding.bias + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [_Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class VisionTower(nn.Module):
    """SigLIP's vision transformer: pixels (B, 3, S, S) -> (B, (S/p)², vision hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class Projector(nn.Module):
    """Gemma3MultiModalProjector: (B, N, vision hidden) -> (B, tokens, text hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.mm_input_projection_weight = mx.zeros((cfg.hidden_size, cfg.text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = mx.zeros((cfg.hidden_size,))

    def __call__(self, h: mx.array) -> mx.array:
        b, _, d = h.shape
        g, k = self.cfg.grid, self.cfg.pool
        t = g // k
        pooled = h.reshape(b, t, k, t, k, d).mean(axis=(2, 4)).reshape(b, t * t, d)
        w = 1.0 + self.mm_soft_emb_norm.weight.astype(mx.float32)  # Gemma's x̂·(1 + w)
        normed = fused.rms_norm(pooled.astype(mx.float32), w, self.cfg.layer_norm_eps)
        return (normed.astype(h.dtype) @ self.mm_input_projection_weight).astype(h.dtype)


class Gemma3Vision(nn.Module):
    """The tower and the projector: pixels (B, 3, S, S) -> (B, tokens, text hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg)
        self.multi_modal_projector = Projector(cfg)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.multi_modal_projector(self.vision_tower(pixels))

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The checkpoint's vision and projector tensors under this module's names (the text
        model's left out)."""
        out = {}
        for name, arr in weights.items():
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
                if not name.startswith("head."):  # SigLIP's pooling head: Gemma 3 never reads it
                    out["vision_tower." + name] = arr
            elif name.startswith("multi_modal_projector."):
                out[name] = arr
        return out


def load_gemma3_vision(folder: Path, dtype: mx.Dtype = mx.float32) -> Gemma3Vision:
    """The vision tower and projector of a Gemma 3 multimodal folder, in `dtype`; a missing,
    extra or misshapen tensor is a FileFormatError naming it."""
    from mlxlis.loading.safetensors import load_tensors
    from mlxlis.models.config import read_json

    cfg = VisionConfig.from_hf(read_json(folder / "config.json"), str(folder / "config.json"))
    net = Gemma3Vision(cfg)
    bind_vision(net, Gemma3Vision.sanitize(load_tensors(folder)), folder, dtype)
    return net


class Gemma3Images(BlockPositions):
    """Gemma 3's way of seeing (multimodal.Vision): Gemma3Processor's expansion and image
    processing, and the tower's features in the model's compute dtype."""

    def __init__(
        self,
        net: Gemma3Vision,
        processing: ImageProcessing,
        markers: tuple[str, str, str],
        image_token_id: int,
        dtype: mx.Dtype,
    ):
        self.net = net
        self.processing = processing
        self.boi, self.soft, self.eoi = markers  # <start_of_image>, <image_soft_token>, <end_...>
        self.image_token_id = image_token_id
        self.fill_id = 0  # transformers reads out-of-vocabulary placeholders as 0
        self.tokens_per_image = net.config.tokens_per_image
        self.dtype = dtype

    def expand(self, text: str, images: Sequence[PromptImage]) -> str:
        run = f"\n\n{self.boi}{self.soft * self.tokens_per_image}{self.eoi}\n\n"

        def sequence(image: PromptImage) -> str:  # Gemma3Processor.replace_image_token
            if not image.crops:
                return run
            return (  # with pan and scan
                f"Here is the original image {run} and here are some crops to help you see "
                "better " + " ".join([run] * len(image.crops))
            )

        return expand_markers(text, self.boi, images, sequence)

    def marker_count(self, text: str) -> int:
        return text.count(self.boi)

    def prepare(self, image: Image.Image, name: str) -> PromptImage:
        p, n = self.processing, self.tokens_per_image
        crops = tuple(
            PromptImage.of(p.preprocess(c), c.size, n, f"{name} crop {k + 1}")
            for k, c in enumerate(p.crops(image))
        )
        return PromptImage.of(p.preprocess(image), image.size, n, name, crops=crops)

    def uses(self, name: str) -> bool:
        return bool(self.net.sanitize({name: None}))

    def describe(self) -> str:
        c = self.net.config
        return f"SigLIP {c.image_size} px, {self.tokens_per_image} tokens per image"

    def features(self, image: PromptImage) -> mx.array:
        pixels = mx.array(image.pixels)[None].astype(self.dtype)  # (1, 3, S, S)
        return self.net(pixels)[0]  # (tokens_per_image, text hidden)


def load_images(
    folder: Path, cfg: dict[str, Any], tokenizer: Tokenizer, dtype: mx.Dtype
) -> Gemma3Images | None:
    """Gemma 3's vision from a multimodal folder (its tower, projector and processor
    settings); None for a text-only folder or one without an image processor's settings."""
    found = processor_settings(folder)
    if not isinstance(cfg.get("vision_config"), dict) or found is None:
        return None
    settings, source = found
    where = str(folder / "config.json")
    keys = (
        ("boi_token_index", 255999),
        ("image_token_index", 262144),
        ("eoi_token_index", 256000),
    )
    markers, ids = marker_tokens(cfg, keys, tokenizer, where)
    processing = ImageProcessing.from_config(settings, source)
    net = load_gemma3_vision(folder, dtype)
    if (processing.height, processing.width) != (net.config.image_size,) * 2:
        raise ConfigError(
            f"the processor makes {processing.height} x {processing.width} images, the tower "
            f"takes {net.config.image_size}",
            path=source,
            field="size",
        )
    return Gemma3Images(net, processing, markers, ids[1], dtype)
