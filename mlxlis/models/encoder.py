"""Encoder blocks: bidirectional self-attention over a padded batch, the embeddings of absolute
positions (and token types), a post-norm block, and the stack an encoder family composes.

A batch is (B, T) ids padded on the right with a (B, T) mask (1: a token, 0: padding). Padding
is never attended to, so each row's outputs equal those of the row run alone; the outputs at
padded positions are whatever they are and poolers must ignore them (pooling.py).

Absolute-position families (BERT) use `Encoder`; rotary ones (ModernBERT, nomic-bert) compose
their own stack from the same pieces: `EncoderAttention` with a `rotary` hook, `GLU` MLPs,
`PreNormLayer` / `PostNormBlock` blocks and `window_mask` for local (sliding-window) attention.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.attention import attend
from mlxlis.models.base import GGUFMeta
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

# the hidden activations of encoder MLPs by config.json name
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    # exact, erf-based (transformers' GELUActivation); on the CPU a compiled erf, as MLX's
    # own evaluates erf a scalar at a time (all-MiniLM at 256 tokens: ~40% of a forward)
    "gelu": fused.gelu,
    "gelu_new": nn.gelu_approx,  # tanh approximation
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
}


SCORES_PER_CHUNK = 1 << 20  # attention scores computed at once (4 MiB in float32)


@dataclass(frozen=True)
class EncoderConfig(FamilyConfig):
    """What an encoder needs beyond ModelConfig's shared fields (ModelConfig.family_config)."""

    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2  # token type (segment) embeddings rows; 0: none
    pad_token_id: int = 0
    # first position id: 0 (BERT), padding_idx + 1 (RoBERTa / XLM-R count positions from
    # past the padding index, as transformers' create_position_ids_from_input_ids does)
    position_offset: int = 0
    positions: str = "absolute"  # "absolute" (learnt table) | "rotary" (RoPE on q and k)
    # "post": add & LayerNorm after each sublayer (BERT, nomic-bert); "pre": LayerNorm before
    # each sublayer, added to the residual (ModernBERT)
    norm: str = "post"
    hidden_act: str = "gelu"
    # the classification head of a cross-encoder: "" (none: an embedding model), "pooler"
    # (BERT: tanh dense on the first token, then a linear classifier), "roberta" (a tanh
    # dense then out_proj on the first token, no pooler), "modernbert" (its family's head)
    head: str = ""
    num_labels: int = 1


# --- config values every encoder family reads, checked alike (config.json is untrusted) ---


def norm_eps(cfg: dict, key: str, default: float, path: str) -> float:
    eps = cfg.get(key, default)
    if not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        raise ConfigError(f"expected a small number, got {eps!r}", path=path, field=key)
    return float(eps)


def pad_id(cfg: dict, default: int, path: str, null_is_default: bool = False) -> int:
    """pad_token_id (absent: `default`; null too where `null_is_default`)."""
    pad = cfg.get("pad_token_id", default)
    pad = default if pad is None and null_is_default else pad
    if not isinstance(pad, int) or pad < 0:
        raise ConfigError(f"expected an id, got {pad!r}", path=path, field="pad_token_id")
    return pad


def type_vocab(cfg: dict, path: str) -> int:
    types = cfg.get("type_vocab_size", 2)
    if not isinstance(types, int) or isinstance(types, bool) or not 0 <= types <= 1 << 16:
        raise ConfigError(
            f"expected a count, got {types!r}"[:200], path=path, field="type_vocab_size"
        )
    return types


def flag(cfg: dict, key: str, default: bool, path: str) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"expected true or false, got {value!r}", path=path, field=key)
    return value


def label_count(cfg: dict, path: str) -> int:
    """A classification head's outputs: id2label's size, else num_labels (1: a reranker)."""
    labels = cfg.get("id2label")
    count = len(labels) if isinstance(labels, dict) else cfg.get("num_labels", 1)
    if not isinstance(count, int) or not 1 <= count <= 1 << 16:
        raise ConfigError(f"expected a count, got {count!r}"[:200], path=path, field="num_labels")
    return count


def max_tokens(cfg: ModelConfig) -> int:
    """How many tokens one input may hold: the position table's rows past the offset (a
    rotary encoder's: the length it was trained to, max_position_embeddings)."""
    return cfg.max_position_embeddings - cfg.own(EncoderConfig).position_offset


def gguf_pad(m: GGUFMeta) -> int:
    """tokenizer.ggml.padding_token_id (absent: 0, llama.cpp's default)."""
    pad = m.md.get("tokenizer.ggml.padding_token_id", 0)
    if not isinstance(pad, int) or pad < 0:
        raise ConfigError(
            f"expected an id, got {pad!r}", path=m.path, field="tokenizer.ggml.padding_token_id"
        )
    return pad


def gguf_names(table: list[tuple[str, str]]) -> Callable[[str], str | None]:
    """A family's GGUF name reader (GGUFFormat.names) from (llama.cpp's tensor name less
    .weight / .bias as a regular expression, our module as its replacement) rows."""
    rows = [(re.compile(p), r) for p, r in table]

    def name(gguf_name: str) -> str | None:
        stem, _, part = gguf_name.rpartition(".")
        for pattern, repl in rows:
            if part in ("weight", "bias") and (m := pattern.fullmatch(stem)):
                return f"{m.expand(repl)}.{part}"
        return None

    return name


def attention_mask(mask: mx.array) -> mx.array:
    """(B, T) 1/0 token mask -> (B, 1, 1, T) boolean: every query sees the row's tokens only."""
    return (mask > 0)[:, None, None, :]


class EncoderAttention(nn.Module):
    """Bidirectional multi-head self-attention, with biases on q, k, v and the output unless
    `bias` is False; `rope` (see `rotary`) applies positions to q and k, None for
    absolute-position encoders (their positions are in the embeddings). `fused`: q, k, v as
    one projection `qkv` (rows [q | k | v]: llama.cpp's attn_qkv), else three."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        head_dim: int,
        bias: bool = True,
        rope: Callable[[mx.array, mx.array], tuple[mx.array, mx.array]] | None = None,
        fused: bool = False,
    ):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        if fused:
            self.qkv = nn.Linear(hidden, 3 * heads * head_dim, bias=bias)
        else:
            self.query = nn.Linear(hidden, heads * head_dim, bias=bias)
            self.key = nn.Linear(hidden, heads * head_dim, bias=bias)
            self.value = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.out = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.scale = head_dim**-0.5
        self.rope = rope

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        B, T, _ = x.shape

        def split(t: mx.array) -> mx.array:
            return t.reshape(B, T, self.heads, self.head_dim).transpose(0, 2, 1, 3)

        if "qkv" in self:
            q, k, v = mx.split(self.qkv(x), 3, axis=-1)  # (B, T, H * D) each
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        q, k, v = split(q), split(k), split(v)  # (B, H, T, D)
        if self.rope is not None:
            q, k = self.rope(q, k)
        # the shared attention: on the CPU explicit scores with fastmath's softmax (MLX's fused
        # attention exponentiates a scalar at a time there), a few rows at a time so the
        # scores stay in cache: all-MiniLM's 32×256 tokens took 280 ms a row at a time,
        # 860 ms at once and 500 ms fused
        rows = max(1, SCORES_PER_CHUNK // (self.heads * T * T))
        o = [
            attend(
                q[i : i + rows],
                k[i : i + rows],
                v[i : i + rows],
                self.scale,
                mask[i : i + rows],
                heads_last=True,
            )
            for i in range(0, B, rows)
        ]
        return self.out(o[0] if len(o) == 1 else mx.concatenate(o))  # (B, T, hidden)


def rotary(dims: int, base: float) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """RoPE on (B, H, T, D) q and k: the first `dims` of each head rotated in halves (x1, x2)
    as transformers' rotate_half does (not interleaved pairs), position t for the t-th token of
    each row (rows are right-padded, so every row starts at 0)."""

    def apply(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        def r(x: mx.array) -> mx.array:
            return mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=0)

        return r(q), r(k)

    return apply


def window_mask(mask: mx.array, half: int) -> mx.array:
    """(B, T) 1/0 token mask -> (B, 1, T, T) boolean: local attention, each query sees the
    row's tokens at most `half` positions away on either side. A pad query far past its row's
    end sees no token: it sees itself, so its scores are never all masked (their NaN would
    reach the real rows through a product with its zero weight)."""
    i = mx.arange(mask.shape[1])
    near = mx.abs(i[:, None] - i[None, :]) <= half  # (T, T)
    itself = (i[:, None] == i[None, :])[None, None]  # (1, 1, T, T)
    return (attention_mask(mask) & near[None, None]) | itself


class GLU(nn.Module):
    """A gated MLP: down(act(a) * b) where [a | b] = gate_up(x), the two halves of one matmul
    (GeGLU with gelu, SwiGLU with silu); `apart`: a = gate(x), b = up(x), two projections
    (llama.cpp's ffn_gate and ffn_up)."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool = False, apart: bool = False
    ):
        super().__init__()
        if apart:
            self.gate = nn.Linear(hidden, intermediate, bias=bias)
            self.up = nn.Linear(hidden, intermediate, bias=bias)
        else:
            self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        if "gate" in self:
            a, b = self.gate(x), self.up(x)
        else:
            a, b = mx.split(self.gate_up(x), 2, axis=-1)  # (B, T, intermediate) each
        return self.down(self.act(a) * b)


class PreNormLayer(nn.Module):
    """A pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)). `attention_norm`
    None: the attention reads x as it is (ModernBERT's first layer, whose input the embeddings
    just normalised)."""

    def __init__(
        self,
        attention: EncoderAttention,
        mlp: nn.Module,
        attention_norm: nn.Module | None,
        mlp_norm: nn.Module,
    ):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        if attention_norm is not None:
            self.attention_norm = attention_norm
        self.mlp_norm = mlp_norm

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention_norm(x) if "attention_norm" in self else x
        x = x + self.attention(h, mask)
        return x + self.mlp(self.mlp_norm(x))


class PostNormBlock(nn.Module):
    """A post-norm block of given parts: norm(x + attention(x)), then norm(x + mlp(x))."""

    def __init__(
        self,
        attention: EncoderAttention,
        mlp: nn.Module,
        attention_norm: nn.Module,
        mlp_norm: nn.Module,
    ):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.attention_norm, self.mlp_norm = attention_norm, mlp_norm

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention_norm(x + self.attention(x, mask))
        return self.mlp_norm(x + self.mlp(x))


class PostNormLayer(nn.Module):
    """BERT's block: attention -> add & LayerNorm -> MLP (act) -> add & LayerNorm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        enc = cfg.own(EncoderConfig)
        h = cfg.hidden_size
        self.attention = EncoderAttention(h, cfg.num_attention_heads, cfg.head_dim)
        self.attention_norm = nn.LayerNorm(h, eps=enc.layer_norm_eps)
        self.up = nn.Linear(h, cfg.mlp.intermediate_size)
        self.down = nn.Linear(cfg.mlp.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=enc.layer_norm_eps)
        self.act = ACTIVATIONS[enc.hidden_act]

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention_norm(x + self.attention(x, mask))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class AbsoluteEmbeddings(nn.Module):
    """Word + learnt absolute position (+ token type) embeddings, then LayerNorm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        enc = cfg.own(EncoderConfig)
        h = cfg.hidden_size
        self.enc = enc
        self.words = nn.Embedding(cfg.vocab_size, h)
        self.positions = nn.Embedding(cfg.max_position_embeddings, h)
        if enc.type_vocab_size:
            self.types = nn.Embedding(enc.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=enc.layer_norm_eps)

    def position_ids(self, ids: mx.array, mask: mx.array) -> mx.array:
        """(B, T) position ids: 0.. for BERT; for an offset (XLM-R) transformers' count of the
        non-pad ids so far plus the padding index, the padding index itself at pad ids."""
        enc = self.enc
        if enc.position_offset == 0:
            return mx.broadcast_to(mx.arange(ids.shape[1])[None], ids.shape)
        real = (ids != enc.pad_token_id).astype(mx.int32)
        return mx.cumsum(real, axis=1) * real + enc.pad_token_id

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None) -> mx.array:
        x = self.words(ids) + self.positions(self.position_ids(ids, mask))
        if self.enc.type_vocab_size:
            # one type (XLM-R): its tokenizer states none, whatever a pair encoding says
            one = types is None or self.enc.type_vocab_size == 1
            types = mx.zeros_like(ids) if one else types
            x = x + self.types(types)
        return self.norm(x)  # (B, T, hidden)


class EncoderNetwork(Protocol):
    """What an encoder family's network is to the embedding runtime (embedding.py)."""

    config: ModelConfig

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        """(B, T) ids, mask, token types -> (B, T, hidden) last hidden states."""
        ...

    def classify(self, h: mx.array, mask: mx.array) -> mx.array:
        """(B, T, hidden) hidden states, (B, T) mask -> (B, num_labels) logits
        (cross-encoders)."""
        ...


class Encoder(nn.Module):
    """Embeddings and a stack of blocks: the body every absolute-position encoder shares."""

    def __init__(self, cfg: ModelConfig, block: type[nn.Module] = PostNormLayer):
        super().__init__()
        enc = cfg.own(EncoderConfig)
        if enc.positions != "absolute" or enc.norm != "post":
            raise UnsupportedError(
                f"{enc.positions} positions with {enc.norm}-norm blocks", field="encoder"
            )
        self.embeddings = AbsoluteEmbeddings(cfg)
        self.layers = [block(cfg) for _ in range(cfg.num_hidden_layers)]

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        x = self.embeddings(ids, mask, types)
        m = attention_mask(mask)
        for layer in self.layers:
            x = layer(x, m)
        return x  # (B, T, hidden)
