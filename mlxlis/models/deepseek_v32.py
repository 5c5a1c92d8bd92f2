"""DeepSeek V3.2 (DeepSeek Sparse Attention): DeepSeek V3 (deepseek_v3.py: latent attention,
grouped routing) whose every attention layer attends only to the index_topk keys its lightning
indexer picks per query.

The indexer (transformers' DeepseekV32Indexer, without the reference's Hadamard rotation and
FP8 scoring, which leave the scores' order as it is): index_n_heads queries wq_b(q_resid) of
index_head_dim (q_resid = q_a_layernorm(q_a_proj(x)), the attention's own) and one key
k_norm(wk(x)) (a LayerNorm with bias) per position, RoPE on their first qk_rope_head_dim dims
in the rotate-half layout (not the attention's interleaved pairs); a key's score for a query
is Σ_h w_h · relu(q_h·k) / √index_head_dim, w = weights_proj(x) / √index_n_heads. Each query
keeps its index_topk best causal keys (all of them while it has fewer); ties at the cut go to
the earlier positions. The indexer's keys are cached beside the latents (a JointCache: the
latent KVCache, and a dense KVCache of one head whose values are empty).

HF `deepseek_v32` (q_lora_rank required: transformers drops the full-rank query; the expert
layers as mlp_layer_types says, which must be first_k_dense_replace's); mlx-lm's folders as
DeepSeek V3's. GGUF (llama.cpp's deepseek32) is not read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mlxlis.cache import CacheBatch, JointCache, KVCache, KVFormat
from mlxlis.errors import UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import Description, Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.deepseek_v3 import DEEPSEEK_V3, DeepseekV3, DeepseekV3Config, DeepseekV3Layer
from mlxlis.models.deepseek_v3 import export as export_v3
from mlxlis.models.deepseek_v3 import parse_hf as parse_v3
from mlxlis.models.layers import Cache, Mask
from mlxlis.models.mla import LatentAttention, LatentDims
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

HF_DEFAULTS = {  # transformers' DeepseekV32Config, for the keys the shared parser reads
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
V3 = DEEPSEEK_V3.describe
INDEX_EPS = 1e-6  # the indexer's k_norm (transformers' nn.LayerNorm(index_head_dim, 1e-6))


@dataclass(frozen=True)
class IndexDims:
    """The lightning indexer's sizes."""

    n_heads: int = 64
    head_dim: int = 128
    topk: int = 2048


@dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    """DeepSeek V3's config and the indexer's."""

    index: IndexDims = IndexDims()


def top_keys(scores: mx.array, k: int) -> mx.array:
    """scores (B, T, S), -inf where a key is out of reach -> (B, T, S) bool: each query's k
    best keys (all S if S ≤ k), ties at the k-th score going to the earlier positions."""
    if scores.shape[-1] <= k:
        return mx.ones(scores.shape, mx.bool_)
    kth = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)  # (B, T, 1): the k-th best
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(axis=-1, keepdims=True)  # the places the tied keys share
    return above | (tied & (mx.cumsum(tied, axis=-1) <= room))


class Indexer(nn.Module):
    """The lightning indexer (the module doc): x (B, T, hidden), q_resid (B, T, q_lora_rank)
    -> the keys each query attends to (B, 1, T, S), causal and top-k."""

    def __init__(self, cfg: ModelConfig, dims: LatentDims, index: IndexDims):
        super().__init__()
        self.index = index
        self.wq_b = nn.Linear(dims.q_lora_rank or 0, index.n_heads * index.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, index.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(index.head_dim, eps=INDEX_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, index.n_heads, bias=False)
        self.rope = Rope(dims.qk_rope_head_dim, cfg.rope)  # rotate-half, unlike the attention's

    def __call__(self, x: mx.array, q_resid: mx.array, cache: KVCache | None) -> mx.array:
        b, t, _ = x.shape
        n, d = self.index.n_heads, self.index.head_dim
        offset = cache.offset if cache is not None else 0
        q = self.wq_b(q_resid).reshape(b, t, n, d).transpose(0, 2, 1, 3)  # (B, n, T, d)
        k = self.k_norm(self.wk(x))[:, None]  # (B, 1, T, d)
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:  # its values are unused: none per position
            k, _ = cache.update_and_fetch(k, mx.zeros((b, 1, t, 0), k.dtype))
        f32 = mx.float32
        scores = mx.maximum(q.astype(f32) @ k.astype(f32).swapaxes(-1, -2), 0)  # (B, n, T, S)
        w = self.weights_proj(x).astype(f32) * (n**-0.5 * d**-0.5)  # (B, T, n)
        index = (w.transpose(0, 2, 1)[..., None] * scores).sum(axis=1)  # (B, T, S)
        s = k.shape[2]
        causal = mx.arange(s)[None] <= (offset + mx.arange(t))[:, None]  # (T, S)
        index = mx.where(causal, index, -mx.inf)
        return (top_keys(index, self.index.topk) & causal)[:, None]  # (B, 1, T, S)


class IndexedLatentAttention(LatentAttention):
    """MLA over the keys the indexer picks; its cache a JointCache (latents, indexer keys)."""

    def __init__(self, cfg: ModelConfig, rope: Rope | None):
        own = cfg.own(DeepseekV32Config)
        super().__init__(cfg, rope, own.mla)
        self.indexer = Indexer(cfg, own.mla, own.index)

    def __call__(
        self, x: mx.array, mask: Mask, cache: Cache | None, positions: mx.array | None = None
    ) -> mx.array:
        if isinstance(cache, CacheBatch):  # each sequence's selection on its own keys
            return mx.concatenate([self(x[i : i + 1], mask, c) for i, c in enumerate(cache.caches)])
        latents, keys = cache.parts if isinstance(cache, JointCache) else (None, None)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        chosen = self.indexer(x, q_resid, keys)
        return self.forward(x, self.q_b_proj(q_resid), chosen, latents)


class DeepseekV32Layer(DeepseekV3Layer):
    attention = staticmethod(IndexedLatentAttention)


class DeepseekV32(DeepseekV3):
    """DeepSeek V3's decoder with indexed attention; per layer a JointCache of the latent
    KVCache and the indexer's (always dense)."""

    layer: type[nn.Module] = DeepseekV32Layer

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        latents = super().make_cache(kv)
        return [JointCache(c, KVCache()) for c in latents]


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    if cfg.get("q_lora_rank", 1536) is None:
        raise UnsupportedError(
            "DeepSeek V3.2 needs q_lora_rank (its indexer reads q_resid)",
            path=path,
            field="q_lora_rank",
        )
    v3 = parse_v3({"rope_interleave": True, **cfg}, base, path)
    types = cfg.get("mlp_layer_types")
    want = ["sparse" if s else "dense" for s in v3.moe.sparse_layers]
    if types is not None and list(types) != want:
        raise UnsupportedError(
            f"expected {want} (first_k_dense_replace), got {types!r}"[:300],
            path=path,
            field="mlp_layer_types",
        )
    size = {
        f: check_sizes({bound: (key, cfg.get(key, default))}, path)[bound]
        for f, key, bound, default in (
            ("n_heads", "index_n_heads", "num_attention_heads", 64),
            ("head_dim", "index_head_dim", "head_dim", 128),
            ("topk", "index_topk", "max_position_embeddings", 2048),
        )
    }
    rope_d = v3.own(DeepseekV3Config).mla.qk_rope_head_dim
    if size["head_dim"] < rope_d:
        raise UnsupportedError(
            f"an indexer head of {size['head_dim']} dims under RoPE's {rope_d}",
            path=path,
            field="index_head_dim",
        )
    own = v3.own(DeepseekV3Config)
    index = IndexDims(**size)
    return v3.with_(family_config=DeepseekV32Config(own.mla, own.routing, own.mtp_layers, index))


def _no_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    raise UnsupportedError(
        "DeepSeek V3.2 GGUF files are not read", path=m.path, field="general.architecture"
    )


def export(cfg: ModelConfig) -> dict[str, Any]:
    i = cfg.own(DeepseekV32Config).index
    out = export_v3(cfg)
    return {**out, "index_n_heads": i.n_heads, "index_head_dim": i.head_dim, "index_topk": i.topk}


def _describe(c: ModelConfig) -> dict[str, Any]:
    i = c.own(DeepseekV32Config).index
    return {**V3.config(c), "sparse_attention": asdict(i)}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    i = config["sparse_attention"]
    text = (
        f"each query attends to its {i['topk']} best keys by a lightning indexer of "
        f"{i['n_heads']} heads of {i['head_dim']} dims (ties: the earlier keys)"
    )
    return [*V3.rows(config), ("sparse attention", text)]


DEEPSEEK_V32 = Family(
    name="deepseek_v32",
    hf=HFFormat(model_types=("deepseek_v32",), parse=parse_hf, defaults=HF_DEFAULTS),
    gguf=GGUFFormat(archs=(), parse=_no_gguf),  # llama.cpp's deepseek32: not read
    network=DeepseekV32,
    export=Export(model_type="deepseek_v32", architecture="DeepseekV32ForCausalLM", config=export),
    describe=Description((*V3.keys, "sparse_attention"), _describe, _rows),
)
