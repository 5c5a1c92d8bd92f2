"""Gemma 3n's audio tower (the USM conformer) and its embedder into soft tokens.

log-mels (B, T, F) -> two subsampling convolutions (each a 2-D convolution over time × mel
bins, a cumulative group norm over the time steps so far, ReLU; time and frequency padded by
hand as the reference does) -> a projection to the tower width -> conformer blocks (half-step
feed-forward, chunked local self-attention with relative positions and a logit softcap, a
light causal depthwise convolution, half-step feed-forward, norm) -> every
`conf_reduction_factor`-th step, padding steps zeroed -> the embedder: RMSNorm, a projection to
the text width, an unscaled RMSNorm.

The reference's attention cuts the sequence into chunks of `conf_attention_chunk_size` queries
each seeing its chunk and `conf_attention_context_left - 1` steps back and
`conf_attention_context_right` ahead; for a query at i that is the band of keys
i - left + 1 … i + right (padding steps never keys), which is what is computed here over the
whole sequence at once, with the relative term read at distance i - j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class AudioConfig:
    """Gemma3nAudioConfig's fields mlxlis reads (its names, transformers' defaults)."""

    hidden_size: int = 1536
    input_feat_size: int = 128
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    conf_attention_chunk_size: int = 12
    conf_attention_context_left: int = 13
    conf_attention_context_right: int = 0
    conf_attention_logit_cap: float = 50.0
    conf_num_attention_heads: int = 8
    conf_num_hidden_layers: int = 12
    conf_conv_kernel_size: int = 5
    conf_reduction_factor: int = 4
    conf_residual_weight: float = 0.5
    sscp_conv_channel_size: tuple[int, int] = (128, 32)
    sscp_conv_group_norm_eps: float = 1e-3
    sscp_conv_kernel_size: tuple[tuple[int, int], tuple[int, int]] = ((3, 3), (3, 3))
    sscp_conv_stride_size: tuple[tuple[int, int], tuple[int, int]] = ((2, 2), (2, 2))
    vocab_size: int = 128
    vocab_offset: int = 262_144 + 128

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], path: str) -> AudioConfig:
        """From config.json's `audio_config`; a missing or ill-typed field is named."""
        known = {k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None}
        for k in ("sscp_conv_kernel_size", "sscp_conv_stride_size"):
            v = known.get(k)
            if v is not None:
                try:
                    known[k] = tuple((int(a), int(b)) for a, b in v)
                except (TypeError, ValueError):
                    raise ConfigError(
                        "expected two (time, freq) pairs", path=path, field=k
                    ) from None
                if len(known[k]) != 2:
                    raise ConfigError("expected two (time, freq) pairs", path=path, field=k)
        if "sscp_conv_channel_size" in known:
            v = known["sscp_conv_channel_size"]
            if not isinstance(v, (list, tuple)) or len(v) != 2:
                raise ConfigError(
                    "expected two channel counts", path=path, field="sscp_conv_channel_size"
                )
            known["sscp_conv_channel_size"] = tuple(int(x) for x in v)
        out = cls(**known)
        for k in ("hidden_size", "conf_num_attention_heads", "conf_attention_chunk_size"):
            v = getattr(out, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 16:
                raise ConfigError(f"bad value {v!r}"[:100], path=path, field=f"audio_config.{k}")
        if out.hidden_size % out.conf_num_attention_heads:
            raise ConfigError(
                f"{out.hidden_size} does not split into {out.conf_num_attention_heads} heads",
                path=path,
                field="audio_config.conf_num_attention_heads",
            )
        if out.conf_attention_context_left < 1 or out.conf_attention_context_right < 0:
            raise ConfigError(
                "a negative context", path=path, field="audio_config.conf_attention_context_left"
            )
        return out


def _rms(x: mx.array, eps: float, weight: mx.array | None = None) -> mx.array:
    """Gemma 3n's RMSNorm (x̂·w, no + 1) in float32."""
    x32 = x.astype(mx.float32)
    y = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(mx.float32)).astype(x.dtype)


class Norm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return _rms(x, self.eps, self.weight)


class CumulativeGroupNorm(nn.Module):
    """Per time step, the mean and variance of every value at that step and before (over
    frequency × channels), then a per-channel scale: x (B, T, F, C)."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)
        per_step = x32.shape[2] * x32.shape[3]
        count = mx.arange(1, x32.shape[1] + 1, dtype=mx.float32)[None, :, None, None] * per_step
        mean = mx.cumsum(x32.sum(axis=(2, 3), keepdims=True), axis=1) / count  # (B, T, 1, 1)
        # each step's deviations from its own running mean, then accumulated
        sq = mx.cumsum(((x32 - mean) ** 2).sum(axis=(2, 3), keepdims=True), axis=1)
        y = (x32 - mean) * mx.rsqrt(sq / count + self.eps) * self.weight.astype(mx.float32)
        return y.astype(x.dtype)


class ConvBlock(nn.Module):
    def __init__(self, cfg: AudioConfig, i: int):
        super().__init__()
        cin = 1 if i == 0 else cfg.sscp_conv_channel_size[i - 1]
        cout = cfg.sscp_conv_channel_size[i]
        kt, kf = cfg.sscp_conv_kernel_size[i]
        self.stride = cfg.sscp_conv_stride_size[i]
        self.pad_t = kt - 1  # after the steps only (causal in time); one bin each side of F
        self.conv = nn.Conv2d(cin, cout, (kt, kf), stride=self.stride, bias=False)
        self.norm = CumulativeGroupNorm(cout, cfg.sscp_conv_group_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:  # (B, T, F, C)
        x = mx.pad(x, [(0, 0), (0, self.pad_t), (1, 1), (0, 0)])
        return nn.relu(self.norm(self.conv(x)))


class SubsampleConvProjection(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.conv_0, self.conv_1 = ConvBlock(cfg, 0), ConvBlock(cfg, 1)
        f = cfg.input_feat_size
        kernels, strides = cfg.sscp_conv_kernel_size, cfg.sscp_conv_stride_size
        for (_, kf), (_, sf) in zip(kernels, strides, strict=True):
            f = (f + 2 - kf) // sf + 1  # one bin of padding each side
        width = f * cfg.sscp_conv_channel_size[1]
        self.input_proj_linear = nn.Linear(width, cfg.hidden_size, bias=False)

    def __call__(self, mels: mx.array) -> mx.array:
        x = self.conv_1(self.conv_0(mels[..., None]))  # (B, T', F', C)
        b, t = x.shape[:2]
        return self.input_proj_linear(x.reshape(b, t, -1))  # (B, T', F' * C)


class RelativePositionEmbedding(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.heads = cfg.conf_num_attention_heads
        self.pos_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        n = cfg.hidden_size // 2
        step = math.log(1.0e4) / max(n - 1, 1)
        self._inv_timescales = mx.exp(mx.arange(n, dtype=mx.float32) * -step)

    def __call__(self, distances: mx.array) -> mx.array:
        """(F,) distances -> (H, F, D) projected sinusoids."""
        t = distances.astype(mx.float32)[:, None] * self._inv_timescales
        s = self.pos_proj(mx.concatenate([mx.sin(t), mx.cos(t)], axis=-1))
        return s.reshape(len(distances), self.heads, -1).transpose(1, 0, 2)  # (H, F, D)


class Attention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.conf_num_attention_heads
        self.head_dim = d // self.heads
        self.back = max(0, cfg.conf_attention_context_left - 1)
        self.ahead = cfg.conf_attention_context_right
        self.cap = cfg.conf_attention_logit_cap
        self.relative_position_embedding = RelativePositionEmbedding(cfg)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        b, t, _ = x.shape
        h, hd = self.heads, self.head_dim
        q = self.q_proj(x).reshape(b, t, h, hd).transpose(0, 2, 1, 3)  # (B, H, T, D)
        k = self.k_proj(x).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        # 1 / softplus(0) makes a zero per_dim_scale the plain 1/√D
        scale = (hd**-0.5 / math.log(2.0)) * nn.softplus(self.per_dim_scale.astype(mx.float32))
        q = q * scale.astype(q.dtype)
        span = mx.arange(self.back, -self.ahead - 1, -1)  # i - j for f = 0 … F - 1
        rel = q @ self.relative_position_embedding(span).transpose(0, 2, 1)[None]  # (B,H,T,F)
        i, j = mx.arange(t)[:, None], mx.arange(t)[None, :]
        f = self.back - (i - j)  # which distance each (query, key) pair is
        band = (f >= 0) & (f <= self.back + self.ahead)  # (T, T)
        idx = mx.broadcast_to(mx.clip(f, 0, self.back + self.ahead)[None, None], (b, h, t, t))
        logits = q @ k.transpose(0, 1, 3, 2) + mx.take_along_axis(rel, idx, axis=-1)
        logits = mx.tanh(logits / self.cap) * self.cap
        keep = band[None, None] & valid[:, None, None, :]  # (B, 1, T, T)
        logits = mx.where(keep, logits, mx.finfo(mx.float32).min)
        p = mx.softmax(logits.astype(mx.float32), axis=-1).astype(v.dtype)
        return (p @ v).transpose(0, 2, 1, 3).reshape(b, t, h * hd)  # (B, T, H * D)


class ConformerAttention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.clip = cfg.gradient_clipping
        self.pre_attn_norm = Norm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.post = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.post_norm = Norm(cfg.hidden_size)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        h = self.attn(self.pre_attn_norm(mx.clip(x, -self.clip, self.clip)), valid)
        return x + self.post_norm(mx.clip(self.post(h), -self.clip, self.clip))


class FeedForward(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, self.clip, self.scale = cfg.hidden_size, cfg.gradient_clipping, cfg.conf_residual_weight
        self.pre_layer_norm = Norm(d)
        self.ffw_layer_1 = nn.Linear(d, 4 * d, bias=False)
        self.ffw_layer_2 = nn.Linear(4 * d, d, bias=False)
        self.post_layer_norm = Norm(d)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ffw_layer_1(self.pre_layer_norm(mx.clip(x, -self.clip, self.clip)))
        h = mx.clip(self.ffw_layer_2(nn.silu(h)), -self.clip, self.clip)
        return x + self.post_layer_norm(h) * self.scale


class LightConv1d(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        d, eps, self.clip = cfg.hidden_size, cfg.rms_norm_eps, cfg.gradient_clipping
        self.kernel = cfg.conf_conv_kernel_size
        self.pre_layer_norm = Norm(d, eps)
        self.linear_start = nn.Linear(d, 2 * d, bias=False)
        self.depthwise_conv1d = nn.Conv1d(d, d, self.kernel, groups=d, bias=False)
        self.conv_norm = Norm(d, eps)
        self.linear_end = nn.Linear(d, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        h = nn.glu(self.linear_start(self.pre_layer_norm(x)), axis=-1)
        h = self.depthwise_conv1d(mx.pad(h, [(0, 0), (self.kernel - 1, 0), (0, 0)]))  # causal
        h = nn.silu(self.conv_norm(mx.clip(h, -self.clip, self.clip)))
        return self.linear_end(h) + x


class ConformerBlock(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.clip = cfg.gradient_clipping
        self.ffw_layer_start = FeedForward(cfg)
        self.attention = ConformerAttention(cfg)
        self.lconv1d = LightConv1d(cfg)
        self.ffw_layer_end = FeedForward(cfg)
        self.norm = Norm(cfg.hidden_size)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        x = self.attention(self.ffw_layer_start(x), valid)
        x = self.lconv1d(x * valid[..., None].astype(x.dtype))
        return self.norm(mx.clip(self.ffw_layer_end(x), -self.clip, self.clip))


class AudioEncoder(nn.Module):
    """log-mels (B, T, F) and their validity (B, T) -> (B, T'', hidden), validity (B, T'')."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.config = cfg
        self.subsample_conv_projection = SubsampleConvProjection(cfg)
        self.conformer = [ConformerBlock(cfg) for _ in range(cfg.conf_num_hidden_layers)]

    def __call__(self, mels: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
        x = self.subsample_conv_projection(mels)
        stride = math.prod(s[0] for s in self.config.sscp_conv_stride_size)
        steps = mx.minimum(mx.arange(x.shape[1]) * stride, valid.shape[1] - 1)
        valid = valid[:, steps]  # each subsampled step: the frame it starts at
        for block in self.conformer:
            x = block(x, valid)
        r = self.config.conf_reduction_factor
        x, valid = x[:, ::r], valid[:, ::r]
        return mx.where(valid[..., None], x, 0.0).astype(x.dtype), valid


class MultimodalEmbedder(nn.Module):
    """Soft tokens (a tower's output) or hard ids of the modality's vocabulary -> text width."""

    def __init__(self, cfg: AudioConfig, text_hidden: int):
        super().__init__()
        d, self.eps, self.offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.vocab_offset
        self.embedding = nn.Embedding(cfg.vocab_size, d)
        self.hard_embedding_norm = Norm(d, self.eps)
        self.soft_embedding_norm = Norm(d, self.eps)
        self.embedding_projection = nn.Linear(d, text_hidden, bias=False)

    def soft(self, h: mx.array) -> mx.array:
        return _rms(self.embedding_projection(self.soft_embedding_norm(h)), self.eps)

    def hard(self, ids: mx.array) -> mx.array:
        e = self.hard_embedding_norm(self.embedding(ids - self.offset))
        return _rms(self.embedding_projection(e), self.eps)


class Gemma3nAudio(nn.Module):
    """The tower and the embedder: log-mels of one window -> `tokens` soft tokens (text width),
    the steps past the audio's end (and up to `tokens`) the hard embedding of `pad_id` (the
    text vocabulary's last id), as Gemma3nModel pads them."""

    def __init__(self, cfg: AudioConfig, text_hidden: int, pad_id: int, tokens: int = 188):
        super().__init__()
        self.config, self.tokens, self.pad_id = cfg, tokens, pad_id
        self.audio_tower = AudioEncoder(cfg)
        self.embed_audio = MultimodalEmbedder(cfg, text_hidden)

    def __call__(self, mels: mx.array, valid: mx.array) -> mx.array:
        h, keep = self.audio_tower(mels, valid)
        out = self.embed_audio.soft(h)  # (B, T'', text hidden)
        pad = self.embed_audio.hard(mx.array([self.pad_id]))  # (1, text hidden)
        out = mx.where(keep[..., None], out, pad)
        b, t, d = out.shape
        if t > self.tokens:
            raise ConfigError(f"{t} audio steps for {self.tokens} soft tokens", field="audio")
        return mx.concatenate([out, mx.broadcast_to(pad, (b, self.tokens - t, d))], axis=1)

    @staticmethod
    def sanitize(weights: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's audio tensors under this module's names, convolutions in MLX's
        layout ((O, I, kT, kF) -> (O, kT, kF, I); depthwise (C, 1, K) -> (C, K, 1))."""
        out = {}
        for name, arr in weights.items():
            name = name.removeprefix("model.")
            if not name.startswith(("audio_tower.", "embed_audio.")):
                continue
            if arr is not None and name.endswith("conv.weight") and arr.ndim == 4:
                arr = arr.transpose(0, 2, 3, 1)
            elif arr is not None and name.endswith("depthwise_conv1d.weight"):
                arr = arr.transpose(0, 2, 1)
            out[name] = arr
        return out


def load_gemma3n_audio(folder: Path, dtype: mx.Dtype = mx.float32) -> Gemma3nAudio | None:
    """The audio tower and embedder of a Gemma3nForConditionalGeneration folder, in `dtype`;
    None for a folder without `audio_config`. A missing, extra or misshapen tensor is a
    FileFormatError naming it."""
    from mlxlis.loading.safetensors import load_tensors
    from mlxlis.models.config import read_json
    from mlxlis.models.multimodal import bind_vision

    where = str(folder / "config.json")
    cfg = read_json(folder / "config.json")
    audio, text = cfg.get("audio_config"), cfg.get("text_config")
    if not isinstance(audio, dict) or not isinstance(text, dict):
        return None
    tokens = cfg.get("audio_soft_tokens_per_image", 188)
    hidden, vocab = text.get("hidden_size", 2048), text.get("vocab_size", 262400)
    for k, v in (("audio_soft_tokens_per_image", tokens), ("text_config.vocab_size", vocab)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 24:
            raise ConfigError(f"bad value {v!r}"[:100], path=where, field=k)
    net = Gemma3nAudio(AudioConfig.from_hf(audio, where), hidden, vocab - 1, tokens)
    bind_vision(net, Gemma3nAudio.sanitize(load_tensors(folder)), folder, dtype)
    return net
