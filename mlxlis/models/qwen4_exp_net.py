"""Qwen4-Exp (text): the network (the family's config and names: qwen4_exp.py).

The residual h is hc_count streams side by side, (B, T, hc·hidden); the embedding starts every
stream. Per layer (transformers' Qwen4ExpTextDecoderLayer):
  PLE        (its layers) h += gated n-gram values + a dilated depthwise conv over them
  attention  x = mix(h); h += out(x) written into each stream by its injection weight
  MoE        the same around the experts (softmax top-k, a sigmoid-gated shared expert)
where mix(h) = mean over streams of sigmoid(up(silu(down(ĥ) / hc))) · ĥ, ĥ = h normed per
stream (x̂·(1 + w)), and the injection weights are 2·sigmoid(inject(ĥ) / hc). The head reads a
last mix (no final norm). Attention is Qwen3.5's gated attention restricted by the QSA indexer
(indexer_budget tokens of the best blocks, plus the query's unfinished block); the DeltaNet
and the experts are Qwen3.5's / Qwen3-Next's (deltanet.py, experts.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mlxlis.cache import CacheBatch, JointCache, KVCache, KVFormat, RecurrentCache
from mlxlis.models.config import ModelConfig
from mlxlis.models.decoder import Decoder
from mlxlis.models.deltanet import GatedDeltaNet
from mlxlis.models.experts import ExpertSource, SparseMoE
from mlxlis.models.layers import Cache, GatedAttention, Mask, norm
from mlxlis.models.multimodal import Inserts
from mlxlis.models.qwen4_exp_parts import F32, PLE, Qwen4ExpStructure, StreamNorm
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxlis.models.base import Family


class HyperConnection(nn.Module):
    """A sublayer's reading of the streams (the mix) and its writing weights (transformers'
    Qwen4ExpTextGatedResidual; `combine` False: the head's last mix, no weights)."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, combine: bool = True):
        super().__init__()
        n, d = s.hc_count, cfg.hidden_size
        self.n, self.d = n, d
        self.hc_norm = StreamNorm(n * d, d, cfg.norms.eps)
        self.input_mix_weight_down = nn.Linear(n * d, s.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(s.hc_lowrank, n * d, bias=False)
        if combine:
            self.block_inject_weight = nn.Linear(n * d, n, bias=False)

    def __call__(self, h: mx.array) -> tuple[mx.array, mx.array | None]:
        """h (B, T, n·d) -> the mix (B, T, d) and the injection weights (B, T, n)."""
        b, t, _ = h.shape
        hn = self.hc_norm(h)
        w = mx.sigmoid(self.input_mix_weight_up(nn.silu(self.input_mix_weight_down(hn) / self.n)))
        mixed = (w.reshape(b, t, self.n, self.d) * hn.reshape(b, t, self.n, self.d)).mean(axis=-2)
        if "block_inject_weight" not in self:
            return mixed, None
        return mixed, 2 * mx.sigmoid(self.block_inject_weight(hn) / self.n)


def inject(h: mx.array, out: mx.array, weights: mx.array) -> mx.array:
    """h (B, T, n·d) plus out (B, T, d) written into each stream by its weight (B, T, n)."""
    return h + (out[..., None, :] * weights[..., None]).reshape(h.shape)


class Indexer(nn.Module):
    """QSA's token selection: per query, the indexer_budget / ratio blocks of `ratio` keys
    whose pooled key scores highest (Σ over heads of relu(q_h·k_block) / √dim), plus the keys
    of its own unfinished block. A block's key: the mean of its raw keys, normed, turned to
    its first position."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, rope: Rope):
        super().__init__()
        self.heads, self.dim = s.indexer_n_heads, s.indexer_head_dim
        self.ratio, self.top = (
            s.indexer_compress_ratio,
            s.indexer_budget // s.indexer_compress_ratio,
        )
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = norm(cfg, self.dim)
        self.k_layernorm = norm(cfg, self.dim)
        self.rope = rope

    def __call__(self, x: mx.array, cache: KVCache | None) -> mx.array | None:
        """x (B, T, hidden) -> the mask (B, 1, T, S) of the keys each query attends to, or
        None where every query sees all of its causal keys (few blocks yet)."""
        b, t, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q, k = mx.split(self.index_qk_proj(x), [self.heads * self.dim], axis=-1)
        q = self.q_layernorm(q.reshape(b, t, self.heads, self.dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset)  # (B, heads, T, dim)
        keys = k.reshape(b, 1, t, self.dim)
        if cache is not None:  # its values are unused: one zero per position
            keys, _ = cache.update_and_fetch(keys, mx.zeros((b, 1, t, 1), keys.dtype))
        s = keys.shape[2]
        nb = s // self.ratio
        if nb <= self.top:
            return None
        pooled = keys[:, 0, : nb * self.ratio].reshape(b, nb, self.ratio, self.dim)
        pooled = self.k_layernorm(pooled.astype(F32).mean(axis=2).astype(keys.dtype))
        starts = mx.broadcast_to((mx.arange(nb) * self.ratio)[:, None], (nb, self.rope.dims // 2))
        blocks = self.rope.at(pooled[:, None], starts)  # (B, 1, nb, dim)
        scores = q.astype(F32) @ blocks.astype(F32).swapaxes(-1, -2)  # (B, heads, T, nb)
        scores = mx.maximum(scores, 0).sum(axis=1) / math.sqrt(self.dim)  # (B, T, nb)
        p = offset + mx.arange(t)[:, None]  # each query's position (T, 1)
        seen = (mx.arange(nb) + 1) * self.ratio <= p + 1  # its finished blocks (T, nb)
        best = mx.argpartition(-mx.where(seen, scores, -mx.inf), self.top - 1, axis=-1)
        chosen = mx.put_along_axis(
            mx.zeros((b, t, nb), mx.bool_), best[..., : self.top], mx.array(True), axis=-1
        )
        chosen = chosen & seen
        key_pos = mx.arange(s)
        in_block = chosen[..., mx.minimum(key_pos // self.ratio, nb - 1)] & (
            key_pos < nb * self.ratio
        )
        own = (key_pos >= (p + 1) // self.ratio * self.ratio) & (key_pos <= p)
        return (in_block | own)[:, None]  # (B, 1, T, S)


class IndexedAttention(GatedAttention):
    """Qwen3.5's gated attention over the keys the indexer chose. Its cache: a JointCache of
    the attention's KV cache and the indexer's keys (a KV cache of one head)."""

    def __init__(self, cfg: ModelConfig, rope: Rope, s: Qwen4ExpStructure):
        super().__init__(cfg, rope)
        self.indexer = Indexer(cfg, s, rope)

    def __call__(self, x, mask: Mask, cache: JointCache | CacheBatch | None, positions=None):
        if isinstance(cache, CacheBatch):  # each sequence's selection on its own keys
            return mx.concatenate([self(x[i : i + 1], mask, c) for i, c in enumerate(cache.caches)])
        kv, index = cache.parts if cache is not None else (None, None)
        chosen = self.indexer(x, index)
        if chosen is None:
            chosen = "causal" if x.shape[1] > 1 else None
        return super().__call__(x, chosen, kv)


class Qwen4ExpLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope, layer: int):
        super().__init__()
        s = cfg.own(Qwen4ExpStructure)
        self.linear = cfg.is_linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = IndexedAttention(cfg, rope, s)
        if layer in s.ple_layers:
            self.ple = PLE(cfg, s, s.ple_layers.index(layer))
        self.mlp = SparseMoE(cfg)
        self.attn_hyper_connection = HyperConnection(cfg, s)
        self.mlp_hyper_connection = HyperConnection(cfg, s)

    def __call__(self, h: mx.array, ids: mx.array, cache: Cache | None) -> mx.array:
        """h (B, T, n·d) streams; ids (B, T) the tokens (PLE reads them)."""
        mixer = cache
        if "ple" in self:
            mixer, ple = _parts(cache)
            h = h + self._ple(h, ids, ple)
        x, w = self.attn_hyper_connection(h)
        out = self.linear_attn(x, None, mixer) if self.linear else self.self_attn(x, None, mixer)
        h = inject(h, out, w)
        x, w = self.mlp_hyper_connection(h)
        return inject(h, self.mlp(x), w)

    def _ple(self, h: mx.array, ids: mx.array, cache) -> mx.array:
        if not isinstance(cache, CacheBatch):
            return self.ple(h, ids, cache)
        rows = cache.caches
        if h.shape[1] > 1 or any(c.recurrent is None for c in rows):
            return mx.concatenate(
                [self.ple(h[i : i + 1], ids[i : i + 1], c) for i, c in enumerate(rows)]
            )
        both = RecurrentCache()  # one step of every row together, their states stacked
        both.conv_state = mx.concatenate([c.conv_state for c in rows])
        both.recurrent = mx.concatenate([c.recurrent for c in rows])
        out = self.ple(h, ids, both)
        for i, c in enumerate(rows):
            c.conv_state, c.recurrent = both.conv_state[i : i + 1], both.recurrent[i : i + 1]
            c.kept([])
            c.offset += 1
        return out


def _parts(cache: Cache | None) -> tuple:
    """A PLE layer's (DeltaNet cache, PLE cache), each a CacheBatch where `cache` is one."""
    if cache is None:
        return None, None
    if isinstance(cache, CacheBatch):
        return tuple(CacheBatch([c.parts[i] for c in cache.caches]) for i in range(2))
    return cache.parts


class Qwen4ExpModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        s = cfg.own(Qwen4ExpStructure)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen4ExpLayer(cfg, rope, i) for i in range(cfg.num_hidden_layers)]
        self.hyper_connection_mixer = HyperConnection(cfg, s, combine=False)


class Qwen4Exp(nn.Module):
    """inputs (B, T) token ids -> logits (B, T, vocab) in the compute dtype (T = 1 if last_only)."""

    heads = True  # the whole network, always (it does not run pipelined)
    verifies_in_batch = True  # verify_batch: the rows' caches through CacheBatch
    rope_freq_factors = None  # its RoPE is built without a GGUF's rope_freqs

    def __init__(self, cfg: ModelConfig, family: Family, rope_freq_factors: mx.array | None = None):
        super().__init__()
        self.config = cfg
        self._family = family
        rope = Rope(cfg.attention.rotary_dim or cfg.head_dim, cfg.rope)
        self.model = Qwen4ExpModel(cfg, rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        """Per layer: a DeltaNet's state (with its PLE's, joint), or the attention's keys
        beside the indexer's (joint; the indexer's always dense)."""
        if kv is not None:
            kv.check(self.config.head_dim)
        out: list[Cache] = []
        for layer in self.model.layers:
            if not layer.linear:
                out.append(JointCache(KVCache(kv), KVCache()))
            elif "ple" in layer:
                out.append(JointCache(RecurrentCache(), RecurrentCache()))
            else:
                out.append(RecurrentCache())
        return out

    # checkpoint names under ours (the wrapper's prefix off, the vision tower and any
    # prediction head dropped): the shared decoder's reading of the family's renames
    sanitize = Decoder.sanitize

    def expert_stacks(self) -> dict[str, ExpertSource]:
        """The experts' stacks, and each n-gram table from its shards (transformers saves it as
        split_ngram_parts chunks of ⌈rows / parts⌉ rows, torch.chunk's)."""
        stacks: dict[str, ExpertSource] = {}
        parts = self.config.own(Qwen4ExpStructure).split_ngram_parts
        for i, layer in enumerate(self.model.layers):
            stacks.update(layer.mlp.expert_stacks(f"model.layers.{i}.mlp"))
            if "ple" in layer:
                p = f"model.layers.{i}.ple.ple_embedding.ngram_embedding"
                rows = layer.ple.ple_embedding.ngram_embedding.weight.shape[0]
                n = -(-rows // -(-rows // parts))
                shards = tuple(f"{p}.shard_{j}.weight" for j in range(n))
                stacks[f"{p}.weight"] = ExpertSource(shards, f"{p}.weight", None, joined=True)
        return stacks

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """One token for each of B sequences (`tokens` (B,)), each with its own caches."""
        per_layer = [CacheBatch([c[i] for c in caches]) for i in range(len(self.model.layers))]
        return self(tokens.astype(mx.int32)[:, None], per_layer)[:, -1, :]

    def verify_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        per_layer = [CacheBatch([c[i] for c in caches]) for i in range(len(self.model.layers))]
        return self(tokens.astype(mx.int32), per_layer)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        last_only: bool = False,
        inserts: Inserts | None = None,
    ) -> mx.array:
        return self.head(self.hidden_states(inputs, cache, inserts), last_only)

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: Inserts | None = None
    ) -> mx.array:
        """(B, T) ids -> the streams' last mix (B, T, hidden), what the head reads."""
        if inserts:
            raise ValueError("Qwen4-Exp is read as a text model here: it takes no images")
        h = self.model.embed_tokens(inputs)
        h = mx.concatenate([h] * self.config.own(Qwen4ExpStructure).hc_count, axis=-1)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, inputs, cache[i] if cache is not None else None)
        return self.model.hyper_connection_mixer(h)[0]

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        if last_only:
            h = h[:, -1:, :]
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)
