"""Tensor parallelism across the ranks of MLX's distributed layer (`mlx.launch`, `--tensor N`):
every rank holds a slice of every layer and works on every token.

The split is data (`Layout`), checked against the config before a weight is read:
  attention  rank r holds query heads [r·H/N, (r+1)·H/N) and the K/N KV heads they read (the
             GQA ratio kept); with fewer KV heads than ranks (K < N, N a multiple of K) each KV
             head is replicated on N/K ranks, its query heads split between them. q/k/v are
             sliced by output rows, o_proj by input columns, then one all_sum.
  MLP        gate/up by rows, down by columns, then one all_sum (column then row parallel).
  vocabulary the embedding and the head by rows [r·V/N, (r+1)·V/N): a lookup takes the rows
             this rank holds (zeros elsewhere) and one all_sum; the head's slices of the
             logits are gathered (all_gather), so every rank holds the whole logits.
Quantized layers (MLX's, and GGUF blocks, which loading puts in MLX's packed layout) are
sliced as stored: rows whole, columns only at group boundaries (and super-block boundaries
where a K-quant keeps its float16 pair per 256 weights), never dequantized.

Each rank's KV caches hold its own KV heads only (K/N of the bytes per token; 1/K when
replicated). The sums of o_proj and down_proj add N partial products instead of one product
over the whole width: float32 results differ from a lone process in the last bits.

Bytes between ranks per token: per layer two all_sums of hidden × dtype, one for the
embedding, and the head's gather of vocab × dtype (`bytes_per_token`). Each rank loads the
whole file, then keeps its slices (the rest is freed): its peak during the load is the whole
model's.

A rank lost mid-step: MLX's ring backend fails the pending all_sum's tasks but the sum never
returns (a pipeline's recv raises instead), so the ranks left are ended by group.py's
watchdog after MLXLIS_RANK_TIMEOUT seconds, with its one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxlis.cache import Cache, KVFormat
from mlxlis.distributed.group import Ranks
from mlxlis.errors import PipelineError, UnsupportedError
from mlxlis.models.config import ModelConfig
from mlxlis.models.layers import MLP, Attention

import mlx.core as mx
import mlx.nn as nn

SUPER_BLOCK = 256  # weights per K-quant super-block (its float16 d, dmin pair)


@dataclass(frozen=True)
class Layout:
    """Rank `rank` of `size`'s share of every layer of a model of `heads` query heads, `kv`
    KV heads, `inter` MLP rows and `vocab` rows."""

    rank: int
    size: int
    heads: int
    kv: int
    inter: int
    vocab: int
    n_layers: int
    nbytes: int = 0  # weight bytes this rank holds, set once sliced

    @property
    def q_heads(self) -> range:
        per = self.heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        if self.kv < self.size:  # replicated: one KV head per rank, N/K ranks share it
            h = self.rank * self.kv // self.size
            return range(h, h + 1)
        per = self.kv // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def mlp_rows(self) -> range:
        per = self.inter // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_rows(self) -> range:
        per = self.vocab // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    # what loaders ask of a rank's share (split.Part's questions): every layer, both ends
    first = last = True

    @property
    def layers(self) -> range:
        return range(self.n_layers)

    def holds(self, name: str) -> bool:
        return True

    def describe(self) -> str:
        q, k, f, v = self.q_heads, self.kv_heads, self.mlp_rows, self.vocab_rows
        shared = f" (replicated on {self.size // self.kv} ranks)" if self.kv < self.size else ""
        return (
            f"tensor rank {self.rank} of {self.size}: query heads {q.start}-{q.stop - 1}, "
            f"KV heads {k.start}-{k.stop - 1}{shared}, MLP rows {f.start}-{f.stop - 1}, "
            f"vocabulary {v.start}-{v.stop - 1}"
            + (f", {self.nbytes / 2**20:.1f} MiB of weights" if self.nbytes else "")
        )


def plan_layout(cfg: ModelConfig, rank: int, size: int, what: str) -> Layout:
    """This rank's Layout, or an UnsupportedError naming the field that does not split evenly
    across `size` ranks (checked before any weight is read)."""
    checks = [
        ("num_attention_heads", cfg.num_attention_heads),
        ("intermediate_size", cfg.mlp.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ]
    for field, n in checks:
        if n % size:
            raise UnsupportedError(
                f"{n} does not split evenly across {size} tensor ranks", path=what, field=field
            )
    k = cfg.num_key_value_heads
    if (k % size) if k >= size else (size % k):
        raise UnsupportedError(
            f"{k} KV heads neither split evenly across {size} tensor ranks nor replicate "
            "evenly on them",
            path=what,
            field="num_key_value_heads",
        )
    if cfg.mlp.fused_gate_up:
        raise UnsupportedError(
            "a fused gate_up projection is not split across tensor ranks yet",
            path=what,
            field="mlp",
        )
    if any(cfg.is_linear(i) or cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)):
        raise UnsupportedError(
            "linear-attention and expert layers are not split across tensor ranks yet; run it "
            "in one process or pipelined",
            path=what,
            field="layers",
        )
    inter, layers = cfg.mlp.intermediate_size, cfg.num_hidden_layers
    return Layout(rank, size, cfg.num_attention_heads, k, inter, cfg.vocab_size, layers)


def _take(a: mx.array, rows: range, axis: int) -> mx.array:
    """A copy of `rows` of `a` along `axis` (a gather: a slice would keep the whole buffer)."""
    return mx.take(a, mx.arange(rows.start, rows.stop), axis=axis)


def by_rows(layer: nn.Module, rows: range) -> None:
    """Keep output rows `rows` of a Linear, QuantizedLinear or (Quantized)Embedding: its
    weight, scales, biases, super-scales and bias, as stored."""
    for name in ("weight", "scales", "biases", "super_scales", "bias"):
        if name in layer:
            layer[name] = _take(layer[name], rows, 0)


def by_columns(layer: nn.Module, cols: range, what: str) -> None:
    """Keep input columns `cols` of a Linear or QuantizedLinear (its bias untouched): packed
    words, scales and biases at whole groups (and whole super-blocks); an UnsupportedError
    naming the module where a boundary would cut one."""
    if "scales" not in layer:
        layer["weight"] = _take(layer["weight"], cols, 1)
        return
    gs, bits = layer.group_size, layer.bits
    step = SUPER_BLOCK if "super_scales" in layer else gs
    if cols.start % step or len(cols) % step:
        raise UnsupportedError(
            f"columns {cols.start}-{cols.stop - 1} cut a quantization group of {step} weights",
            field=what,
        )
    per_word = 32 // bits
    layer["weight"] = _take(
        layer["weight"], range(cols.start // per_word, cols.stop // per_word), 1
    )
    for name in ("scales", "biases"):
        if name in layer:
            layer[name] = _take(layer[name], range(cols.start // gs, cols.stop // gs), 1)
    if "super_scales" in layer:
        sup = range(cols.start // SUPER_BLOCK, cols.stop // SUPER_BLOCK)
        layer["super_scales"] = _take(layer["super_scales"], sup, 1)


class SumRanks(nn.Module):
    """A row-parallel projection: this rank's input columns of `inner`, the partial products
    summed over the ranks (one all_sum), then the bias once."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        if "bias" in inner:  # added once, after the sum
            self.bias = inner.pop("bias")
        self.inner = inner
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.inner(x), group=self._group)
        return y + self["bias"] if "bias" in self else y


class VocabEmbedding(nn.Module):
    """This rank's rows [lo, hi) of the embedding: a lookup sums, over the ranks, the rows
    each holds (zeros for ids outside them: adding zeros is exact); `as_linear` (a tied head)
    gathers every rank's slice of the logits in vocabulary order."""

    def __init__(self, inner: nn.Module, rows: range, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self._lo, self._n = rows.start, len(rows)
        self._group = group

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self._lo
        mine = (local >= 0) & (local < self._n)
        rows = self.inner(mx.where(mine, local, 0))  # (B, T, hidden)
        rows = mx.where(mine[..., None], rows, mx.zeros((), rows.dtype))
        return mx.distributed.all_sum(rows, group=self._group)

    def as_linear(self, x: mx.array) -> mx.array:
        return gather_vocab(self.inner.as_linear(x), self._group)


class VocabHead(nn.Module):
    """An untied head's rows [lo, hi) of the vocabulary: the logits' slices gathered."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_vocab(self.inner(x), self._group)


def gather_vocab(local: mx.array, group: mx.distributed.Group) -> mx.array:
    """(B, T, V/N) logits on each rank -> (B, T, V) in vocabulary (rank) order."""
    n = group.size()
    b, t, v = local.shape
    every = mx.distributed.all_gather(local, group=group)  # (N·B, T, V/N), rank-major
    every = every.reshape(n, b, t, v).transpose(1, 2, 0, 3)  # (B, T, N, V/N)
    return every.reshape(b, t, n * v)


def shard(net: Any, layout: Layout, group: mx.distributed.Group, what: str) -> None:
    """Slice a loaded Decoder in place to `layout`: the sliced arrays are copies, so the whole
    ones are freed when the loader drops them."""
    for i, layer in enumerate(net.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) is not MLP:
            raise UnsupportedError(
                f"layer {i}'s {type(attn).__name__} / {type(mlp).__name__} is not split across "
                "tensor ranks yet",
                path=what,
                field=f"model.layers.{i}",
            )
        hd = net.config.head_dim
        q, k = layout.q_heads, layout.kv_heads
        by_rows(attn.q_proj, range(q.start * hd, q.stop * hd))
        for proj in (attn.k_proj, attn.v_proj):
            by_rows(proj, range(k.start * hd, k.stop * hd))
        by_columns(attn.o_proj, range(q.start * hd, q.stop * hd), f"model.layers.{i}.o_proj")
        attn.o_proj = SumRanks(attn.o_proj, group)
        attn.n_heads, attn.n_kv_heads = len(q), len(k)
        f = layout.mlp_rows
        by_rows(mlp.gate_proj, f)
        by_rows(mlp.up_proj, f)
        by_columns(mlp.down_proj, f, f"model.layers.{i}.mlp.down_proj")
        mlp.down_proj = SumRanks(mlp.down_proj, group)
    v = layout.vocab_rows
    by_rows(net.model.embed_tokens, v)
    net.model.embed_tokens = VocabEmbedding(net.model.embed_tokens, v, group)
    if "lm_head" in net:
        by_rows(net.lm_head, v)
        net.lm_head = VocabHead(net.lm_head, group)
    mx.eval(net.parameters())


def bytes_per_token(cfg: ModelConfig, dtype: mx.Dtype, size: int) -> int:
    """Bytes one rank sends per token in a ring: an all_sum of n bytes sends 2·(N−1)/N·n, an
    all_gather (N−1)/N of the whole."""
    hidden = cfg.hidden_size * dtype.size
    sums = (2 * cfg.num_hidden_layers + 1) * 2 * (size - 1) * hidden // size
    return sums + (size - 1) * cfg.vocab_size * dtype.size // size


class TensorNet:
    """The network of a tensor-parallel Model: the Decoder with its layers sliced (called
    alike, every rank returning the whole logits), its ranks beside it. Every rank runs every
    step: rank 0 leads (leader.py), its own call gives the logits it samples."""

    verifies_in_batch = False
    logits_at_leader = True  # rank 0's own call returns the logits (nothing is sent to it)

    def __init__(self, net: Any, ranks: Ranks, layout: Layout, dtype: mx.Dtype):
        self.net = net
        self.ranks = ranks
        self.part = layout
        self.hidden_dtype = net.hidden_dtype(dtype)

    @property
    def config(self) -> ModelConfig:
        return self.net.config

    @property
    def heads(self) -> bool:
        return True

    @property
    def sends_logits(self) -> bool:
        return False

    @property
    def held_layers(self) -> range:
        return self.net.held_layers

    @property
    def rope_freq_factors(self) -> mx.array | None:
        return self.net.rope_freq_factors

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        """Every layer's cache, holding this rank's KV heads."""
        return self.net.make_cache(kv)

    def parameters(self) -> dict:
        return self.net.parameters()

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        return self.net.named_modules()

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        last_only: bool = False,
        inserts: object = None,
    ) -> mx.array:
        if inserts:  # Model.image_spans refuses a distributed model's images before this
            raise UnsupportedError("images with a tensor-parallel model", field="images")
        return self.net(inputs, cache, last_only)

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: object = None
    ) -> mx.array:
        return self.net.hidden_states(inputs, cache)

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        return self.net.head(h, last_only)

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        return self.net.decode_batch(tokens, caches)

    def verify_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        raise UnsupportedError("this network verifies one sequence per forward")


def check_group(size: int, ranks: Ranks | None) -> None:
    """PipelineError unless `--tensor size` matches the launched ranks (a tensor group inside
    pipeline stages is not built yet)."""
    have = 1 if ranks is None else ranks.size
    if size != have:
        raise PipelineError(
            f"{size} tensor ranks asked for but {have} run: start them with mlx.launch -n "
            f"{size} (tensor groups inside pipeline stages are not supported yet)",
            field="--tensor",
        )
