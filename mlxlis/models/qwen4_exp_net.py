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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxlis.cache import CacheBatch, JointCache, KVCache, KVFormat, RecurrentCache
from mlxlis.models.config import FamilyConfig, ModelConfig
from mlxlis.models.deltanet import GatedDeltaNet
from mlxlis.models.experts import ExpertSource, SparseMoE
from mlxlis.models.layers import Attention, Cache, Mask, norm
from mlxlis.models.multimodal import Inserts
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxlis.models.base import Family

F32 = mx.float32


@dataclass(frozen=True)
class Qwen4ExpStructure(FamilyConfig):
    hc_count: int
    hc_lowrank: int
    ple_layers: tuple[int, ...]  # zero-indexed, ascending
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    split_ngram_parts: int
    seed: int
    eos_token_id: int  # the n-gram context's filler and separator
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    def head_sizes(self, index: int) -> list[int]:
        """The prime table size of each n-gram head of the `index`-th PLE layer: the primes
        from ngram_vocab_size_base on, numbered across the layers' heads in order."""
        first = index * self.ngram_heads
        primes, p = [], self.ngram_vocab_size_base - 1
        while len(primes) < first + self.ngram_heads:
            p += 1
            if _is_prime(p):
                primes.append(p)
        return primes[first:]

    def table_rows(self, index: int) -> int:
        """The `index`-th PLE layer's table: every head's rows, padded to the divisor."""
        d = self.make_ngram_vocab_size_divisible_by
        return -(-sum(self.head_sizes(index)) // d) * d


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % k for k in range(3, math.isqrt(n) + 1, 2))


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % k for k in range(3, math.isqrt(n) + 1, 2))


_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def hash_multipliers(vocab: int, n: int, index: int, seed: int) -> list[int]:
    """The odd multipliers of the `index`-th PLE layer's n-gram hash, one per position in the
    n-gram (transformers' _build_layer_multipliers; checkpoints carry them too, and theirs are
    what is used): small enough that id·multiplier stays below 2⁶³."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(n)]


class StreamNorm(nn.Module):
    """x̂·(1 + w) over each stream's `group` dims of (…, streams·group), in float32."""

    def __init__(self, dims: int, group: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.group, self.eps = group, eps

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(F32).reshape(*x.shape[:-1], -1, self.group)  # (…, streams, group)
        y = mx.fast.rms_norm(y, None, self.eps).reshape(x.shape)
        return (y * (1.0 + self.weight.astype(F32))).astype(x.dtype)


class HyperConnection(nn.Module):
    """A sublayer's reading of the streams (the mix) and its writing weights (transformers'
    Qwen4ExpTextGatedResidual; `combine` False: the head's last mix, no weights)."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, combine: bool = True):
        super().__init__()
        n, d = s.hc_count, cfg.hidden_size
        self.n, self.d = n, d
        self.hc_norm = StreamNorm(n * d, d, cfg.rms_norm_eps)
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


class NGramEmbedding(nn.Module):
    """Each position's hashed 2..ngram_size-gram ids, heads_per_ngram tables each, embedded
    and concatenated: (B, T) ids -> (B, T, ple_embed_dim). Tokens before an EOS do not reach
    past it (the EOS id stands in for them), nor positions before the first."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, index: int):
        super().__init__()
        sizes = s.head_sizes(index)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.n, self.per, self.eos = s.ngram_size, s.heads_per_ngram, s.eos_token_id
        self.ngram_embedding = nn.Embedding(s.table_rows(index), s.ple_embed_dim // len(sizes))
        m = hash_multipliers(cfg.vocab_size, s.ngram_size, index, s.seed)
        self.layer_multipliers = mx.array(m, mx.int64)
        self.ngram_heads_vocab_sizes = mx.array(sizes, mx.int64)
        self.ngram_heads_offsets = mx.array(offsets, mx.int64)

    def rows(self, history: mx.array, t: int) -> mx.array:
        """history (B, n−1+T): the n−1 ids before the T new ones, then those -> each new
        position's table rows (B, T, heads)."""
        hist = history.astype(mx.int64)
        length = hist.shape[1]
        pos = mx.arange(length)
        eos_at = mx.where(hist == self.eos, pos, -1)
        before = mx.concatenate(
            [mx.full((hist.shape[0], 1), -1), mx.cummax(eos_at, axis=1)[:, :-1]], 1
        )
        since = pos - (before + 1)  # positions since the last EOS before each one
        eos = mx.array(self.eos, mx.int64)
        shifted = [hist]
        for k in range(1, self.n):  # the token k back, where the context reaches it
            back = mx.concatenate(
                [mx.full((hist.shape[0], k), self.eos, mx.int64), hist[:, :-k]], 1
            )
            shifted.append(mx.where(since >= k, back, eos))
        m, sizes, offs = (
            self.layer_multipliers,
            self.ngram_heads_vocab_sizes,
            self.ngram_heads_offsets,
        )
        blocks = []
        for g in range(2, self.n + 1):
            mixed = shifted[0] * m[0]
            for k in range(1, g):
                mixed = mx.bitwise_xor(mixed, shifted[k] * m[k])
            heads = slice((g - 2) * self.per, (g - 1) * self.per)
            blocks.append(mixed[..., None] % sizes[heads] + offs[heads])  # (B, n−1+T, per)
        return mx.concatenate(blocks, axis=-1)[:, -t:]

    def __call__(self, history: mx.array, t: int) -> mx.array:
        e = self.ngram_embedding(self.rows(history, t).astype(mx.uint32))  # (B, T, heads, dim)
        return e.reshape(*e.shape[:2], -1)


class PLE(nn.Module):
    """Per-layer n-gram embeddings into every stream (transformers' Qwen4ExpTextPLELayer):
    value v = W_v·e shared, a key per stream k_s = norm(W_k·e)_s against the stream's normed
    state q_s; gate g_s = signed √|k_s·q_s / √d|; out_s = sigmoid(g_s)·v, plus SiLU of a
    causal depthwise convolution (kernel ple_conv_kernel_size, dilation ngram_size) over the
    normed outs. Its cache (a RecurrentCache): the convolution's last (kernel−1)·dilation
    inputs as `conv_state`, the last n−1 ids as `recurrent`."""

    def __init__(self, cfg: ModelConfig, s: Qwen4ExpStructure, index: int):
        super().__init__()
        n, d, e = s.hc_count, cfg.hidden_size, s.ple_embed_dim
        self.n, self.d, self.context = n, d, s.ngram_size - 1
        self.eos = s.eos_token_id
        self.ple_embedding = NGramEmbedding(cfg, s, index)
        self.key_proj = nn.Linear(e, n * d, bias=False)
        self.value_proj = nn.Linear(e, d, bias=False)
        self.norm_key = StreamNorm(n * d, d, cfg.rms_norm_eps)
        self.norm_query = StreamNorm(n * d, d, cfg.rms_norm_eps)
        self.norm_conv = StreamNorm(n * d, d, cfg.rms_norm_eps)
        self.kernel, self.dilation = s.ple_conv_kernel_size, s.ngram_size
        self.span = (self.kernel - 1) * self.dilation
        self.conv1d = nn.Module()
        self.conv1d.weight = mx.zeros((n * d, 1, self.kernel))  # HF (C, 1, kernel)

    def __call__(self, h: mx.array, ids: mx.array, cache: RecurrentCache | None) -> mx.array:
        b, t, _ = h.shape
        ctx = cache.recurrent if cache is not None else None
        if ctx is None:
            ctx = mx.full((b, self.context), self.eos, mx.int64)
        history = mx.concatenate([ctx, ids.astype(mx.int64)], axis=1)  # (B, n−1+T)
        emb = self.ple_embedding(history, t)  # (B, T, ple_embed_dim)
        key = self.norm_key(self.key_proj(emb)).reshape(b, t, self.n, self.d)
        query = self.norm_query(h).reshape(b, t, self.n, self.d)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.d)  # (B, T, n, 1)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate) * self.value_proj(emb)[:, :, None, :]).reshape(b, t, -1)
        xp = self._conv_input(self.norm_conv(gated), cache)  # (B, span + T, n·d)
        w = self.conv1d.weight[:, 0, :].astype(xp.dtype)  # (C, kernel)
        y = sum(
            xp[:, j * self.dilation : j * self.dilation + t] * w[:, j] for j in range(self.kernel)
        )
        if cache is not None:
            steps = []  # a verification's states after each token but the last
            if cache.keep:
                for i in range(t - 1):
                    conv = mx.contiguous(xp[:, i + 1 : i + 1 + self.span])
                    steps.append(
                        (cache.offset + i + 1, conv, history[:, i + 1 : i + 1 + self.context])
                    )
            cache.conv_state = xp[:, -self.span :]
            cache.recurrent = history[:, -self.context :]
            cache.kept(steps)
            cache.offset += t
        return gated + nn.silu(y)

    def _conv_input(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        before = cache.conv_state if cache is not None else None
        if before is None:
            before = mx.zeros((x.shape[0], self.span, x.shape[2]), x.dtype)
        return mx.concatenate([before.astype(x.dtype), x], axis=1)


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


class IndexedAttention(Attention):
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

    def __init__(self, cfg: ModelConfig, family: Family, rope_freq_factors: mx.array | None = None):
        super().__init__()
        self.config = cfg
        self._family = family
        rope = Rope(cfg.rotary_dim or cfg.head_dim, cfg.rope)
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

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names under ours: the wrapper's prefix taken off, the vision tower and
        any prediction head dropped."""
        out = {}
        for name, arr in weights.items():
            ours = self._family.hf_name(name)
            if ours is not None:
                out[ours] = arr
        return out

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
