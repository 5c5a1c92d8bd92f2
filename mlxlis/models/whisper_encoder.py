"""Whisper's audio encoder (as Voxtral carries it: transformers' VoxtralEncoder).

log-mels (C, mel bins, frames) -> a width-3 convolution and GELU, a width-3 stride-2
convolution and GELU -> learned absolute positions added -> pre-norm transformer layers
(LayerNorm; multi-head attention over the whole chunk, no mask, queries scaled by
head_dim^-1/2, q/v/out with bias, k without; LayerNorm; fc1, the activation, fc2) -> a final
LayerNorm. Each chunk is encoded alone (a batch of chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlxlis.errors import ConfigError

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu, "gelu_new": nn.gelu_approx, "silu": nn.silu}


@dataclass(frozen=True)
class WhisperEncoderConfig:
    """VoxtralEncoderConfig's fields mlxlis reads (its names, transformers' defaults)."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 20
    num_mel_bins: int = 128
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    scale_embedding: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], path: str) -> WhisperEncoderConfig:
        """From config.json's `audio_config` (Whisper's d_model / encoder_* names too); a
        field of the wrong type or out of range is named."""
        aliases = {
            "d_model": "hidden_size",
            "encoder_layers": "num_hidden_layers",
            "encoder_attention_heads": "num_attention_heads",
            "encoder_ffn_dim": "intermediate_size",
        }
        cfg = {aliases.get(k, k): v for k, v in cfg.items()}
        known = {k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None}
        out = cls(**known)
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers"):
            v = getattr(out, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 20:
                raise ConfigError(f"expected a positive size, got {v!r}"[:100], path=path, field=k)
        for k in ("num_attention_heads", "num_mel_bins", "max_source_positions"):
            v = getattr(out, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 20:
                raise ConfigError(f"expected a positive size, got {v!r}"[:100], path=path, field=k)
        if out.hidden_size % out.num_attention_heads:
            raise ConfigError(
                "hidden_size is not a multiple of num_attention_heads",
                path=path,
                field="num_attention_heads",
            )
        if out.activation_function not in ACTIVATIONS:
            raise ConfigError(
                f"activation {out.activation_function!r} is not supported",
                path=path,
                field="activation_function",
            )
        if out.scale_embedding:
            raise ConfigError(
                "scale_embedding is not supported", path=path, field="scale_embedding"
            )
        return out

    @property
    def frames(self) -> int:
        """The log-mel frames of one chunk (the second convolution halves them)."""
        return self.max_source_positions * 2


class EncoderLayer(nn.Module):
    def __init__(self, c: WhisperEncoderConfig):
        super().__init__()
        d, self.heads = c.hidden_size, c.num_attention_heads
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d)
        self.self_attn.k_proj = nn.Linear(d, d, bias=False)
        self.self_attn.v_proj = nn.Linear(d, d)
        self.self_attn.out_proj = nn.Linear(d, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, d)
        self.act = ACTIVATIONS[c.activation_function]

    def __call__(self, x: mx.array) -> mx.array:
        B, T, D = x.shape
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q, k, v = (
            p(h).reshape(B, T, self.heads, -1).transpose(0, 2, 1, 3)  # (B, H, T, Dh)
            for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(D // self.heads))
        x = x + a.out_proj(o.transpose(0, 2, 1, 3).reshape(B, T, D))  # (B, T, D)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """(chunks, mel bins, config.frames) log-mels -> (chunks, max_source_positions, hidden)."""

    def __init__(self, c: WhisperEncoderConfig):
        super().__init__()
        self.config = c
        d = c.hidden_size
        self.conv1 = nn.Conv1d(c.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, d)
        self.layers = [EncoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.layer_norm = nn.LayerNorm(d)

    def __call__(self, mels: mx.array) -> mx.array:
        x = mels.transpose(0, 2, 1)  # (C, frames, mels): MLX convolves channels-last
        x = nn.gelu(self.conv1(x))  # transformers' encoder: the exact (erf) GELU here
        x = nn.gelu(self.conv2(x))  # (C, positions, d)
        x = x + self.embed_positions.weight.astype(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)

    @staticmethod
    def sanitize(weights: dict[str, Any]) -> dict[str, Any]:
        """transformers' Conv1d weights (out, in, width) as MLX's (out, width, in)."""
        return {
            k: v.transpose(0, 2, 1) if k.startswith(("conv1.w", "conv2.w")) else v
            for k, v in weights.items()
        }
