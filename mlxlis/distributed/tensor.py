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
Each rank builds the network of its share (`Layout.local`) and reads only its slices from the
file (`Layout.cut`, loading/slices.py): GGUF blocks by rows or by whole blocks along K,
safetensors rows and columns through a memory map, MLX-quantized layers' words, scales and
biases at whole groups; a cut inside a block or group is refused by name. Nothing is
dequantized, and a rank's peak memory while loading is its share (replicated: the norms,
o_proj's and down_proj's biases, and the k/v projections of a KV head held on N/K ranks).

Each rank's KV caches hold its own KV heads only (K/N of the bytes per token; 1/K when
replicated). The sums of o_proj and down_proj add N partial products instead of one product
over the whole width: float32 results differ from a lone process in the last bits.

Bytes between ranks per token: per layer two all_sums of hidden × dtype, one for the
embedding, and the head's gather of vocab × dtype (`bytes_per_token`).

A rank lost mid-step: MLX's ring backend fails the pending all_sum's tasks but the sum never
returns (a pipeline's recv raises instead), so the ranks left are ended by group.py's
watchdog after MLXLIS_RANK_TIMEOUT seconds, with its one-line error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.cache import Cache, KVFormat
from mlxlis.distributed.collectives import Collectives, SumRanks, VocabEmbedding, VocabHead
from mlxlis.distributed.group import Ranks
from mlxlis.distributed.split import Part
from mlxlis.errors import PipelineError, UnsupportedError
from mlxlis.loading.slices import Cut
from mlxlis.models.config import ModelConfig
from mlxlis.models.experts import SparseMoE
from mlxlis.models.layers import MLP, Attention

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class Layout:
    """Process `rank`'s share of every layer of a model of `heads` query heads, `kv` KV heads,
    `inter` MLP rows and `vocab` rows, as member `rank % size` of a tensor group of `size`;
    inside pipeline stages (`stage`), of that stage's layers only."""

    rank: int
    size: int
    heads: int
    kv: int
    inter: int
    vocab: int
    n_layers: int
    head_dim: int
    experts: int = 0  # each expert's rows (MoE layers), 0 without
    shared: int = 0  # the shared expert's rows, 0 without
    nbytes: int = 0  # weight bytes this rank holds, set once loaded
    stage: Part | None = None  # the pipeline stage's layers (None: every layer)

    @property
    def member(self) -> int:
        """This rank's place in its tensor group (stages are contiguous runs of ranks)."""
        return self.rank % self.size

    def share(self, n: int) -> range:
        """This rank's rows of `n` split evenly."""
        per = n // self.size
        return range(self.member * per, (self.member + 1) * per)

    @property
    def q_heads(self) -> range:
        return self.share(self.heads)

    @property
    def kv_heads(self) -> range:
        if self.kv < self.size:  # replicated: one KV head per rank, N/K ranks share it
            h = self.member * self.kv // self.size
            return range(h, h + 1)
        per = self.kv // self.size
        return range(self.member * per, (self.member + 1) * per)

    @property
    def mlp_rows(self) -> range:
        return self.share(self.inter)

    @property
    def vocab_rows(self) -> range:
        return self.share(self.vocab)

    # what loaders ask of a rank's share (split.Part's questions): its stage's layers and ends
    @property
    def first(self) -> bool:
        return self.stage is None or self.stage.first

    @property
    def last(self) -> bool:
        return self.stage is None or self.stage.last

    @property
    def layers(self) -> range:
        return range(self.n_layers) if self.stage is None else self.stage.layers

    def holds(self, name: str) -> bool:
        return self.stage is None or self.stage.holds(name)

    @property
    def speculates(self) -> bool:
        """Every rank computes the whole logits of every verified position (rank 0's own);
        inside pipeline stages the last stage sends (B, vocab) only."""
        return self.stage is None

    @property
    def sees(self) -> bool:
        """Rank 0 holds the vision tower and sends a chunk's image features to every rank
        (images.py); inside pipeline stages not yet."""
        return self.stage is None

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """The network this rank builds: its query and KV heads, MLP rows and vocabulary."""
        mlp = replace(cfg.mlp, intermediate_size=len(self.mlp_rows))
        n_q, n_kv, n_v = len(self.q_heads), len(self.kv_heads), len(self.vocab_rows)
        own = cfg.with_(num_attention_heads=n_q, num_key_value_heads=n_kv, vocab_size=n_v, mlp=mlp)
        if cfg.moe is None:
            return own
        e, sh = len(self.share(self.experts)), len(self.share(self.shared))
        moe = replace(cfg.moe, intermediate_size=e, shared_expert_intermediate_size=sh)
        return own.with_(moe=moe)

    def cut(self, name: str) -> Cut | None:
        """The slice of module tensor `name` this rank reads: q/k/v, gate/up, the embedding
        and the head by output rows (a bias too), o_proj and down_proj by input columns (their
        bias whole: added once after the sum); norms whole."""
        m = _SLICED.match(name)
        if m is None:
            return None
        module, part, block = m.group("module"), m.group("part"), m.group("block")
        hd = self.head_dim
        rows = {
            "q_proj": (self.q_heads, self.heads, hd),
            "k_proj": (self.kv_heads, self.kv, hd),
            "v_proj": (self.kv_heads, self.kv, hd),
            "o_proj": (self.q_heads, self.heads, hd),
            "gate_proj": (self.mlp_rows, self.inter, 1),
            "up_proj": (self.mlp_rows, self.inter, 1),
            "down_proj": (self.mlp_rows, self.inter, 1),
            "embed_tokens": (self.vocab_rows, self.vocab, 1),
            "lm_head": (self.vocab_rows, self.vocab, 1),
        }
        span, whole, per = rows[module]
        if block is not None:  # every expert's rows (E, F, hidden) alike; the shared expert's
            whole = self.experts if block == "switch_mlp" else self.shared
            span = self.share(whole)
        part_range = range(span.start * per, span.stop * per)
        if module in ("o_proj", "down_proj"):  # row parallel: input columns
            return None if part == "bias" else Cut(-1, part_range, whole * per)
        return Cut(-1 if part == "bias" else -2, part_range, whole * per)

    def describe(self) -> str:
        q, k, f, v = self.q_heads, self.kv_heads, self.mlp_rows, self.vocab_rows
        shared = f" (replicated on {self.size // self.kv} ranks)" if self.kv < self.size else ""
        return (
            (self.stage.describe().replace("rank", "stage", 1) + ", " if self.stage else "")
            + f"tensor rank {self.member} of {self.size}: query heads {q.start}-{q.stop - 1}, "
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
    if any(cfg.is_linear(i) for i in range(cfg.num_hidden_layers)):
        raise UnsupportedError(
            "linear-attention layers are not split across tensor ranks yet; run it in one "
            "process or pipelined",
            path=what,
            field="layers",
        )
    experts = shared = 0
    if cfg.moe is not None and any(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)):
        experts, shared = cfg.moe.intermediate_size, cfg.moe.shared_expert_intermediate_size
        for field, n in (("moe_intermediate_size", experts), ("shared_expert", shared)):
            if n % size:
                raise UnsupportedError(
                    f"{n} expert rows do not split evenly across {size} tensor ranks",
                    path=what,
                    field=field,
                )
    inter, layers = cfg.mlp.intermediate_size, cfg.num_hidden_layers
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    return Layout(rank, size, heads, k, inter, cfg.vocab_size, layers, hd, experts, shared)


_SLICED = re.compile(
    r"^(?:model\.layers\.\d+\.(?:self_attn|mlp)\.(?:(?P<block>switch_mlp|shared_expert)\.)?"
    r"|model\.)?"
    r"(?P<module>[qkvo]_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)"
    r"\.(?P<part>weight|scales|biases|bias)$"
)


def shard(net: Any, layout: Layout, group: Collectives, what: str) -> None:
    """Join a Decoder built and loaded for `layout` (its slices only: Layout.local and
    Layout.cut) to its ranks: o_proj and down_proj summed over them, the vocabulary's
    lookups summed and its logits gathered."""
    for i, layer in enumerate(net.model.layers):
        if layer is None:  # another pipeline stage's
            continue
        attn, mlp = layer.self_attn, layer.mlp
        # the experts' partial outputs (each its columns of down_proj, weighted by the same
        # routing on every rank) and the shared expert's add up: one sum for the whole block
        moe = type(mlp) is SparseMoE and "bias" not in mlp.switch_mlp.down_proj
        if type(attn) is not Attention or not (type(mlp) is MLP or moe):
            raise UnsupportedError(
                f"layer {i}'s {type(attn).__name__} / {type(mlp).__name__} is not split across "
                "tensor ranks yet",
                path=what,
                field=f"model.layers.{i}",
            )
        attn.o_proj = SumRanks(attn.o_proj, group)
        if moe:
            layer.mlp = SumRanks(mlp, group)
        else:
            mlp.down_proj = SumRanks(mlp.down_proj, group)
    v = layout.vocab_rows
    if "embed_tokens" in net.model:  # a pipeline stage embeds only first (or as a tied head)
        net.model.embed_tokens = VocabEmbedding(net.model.embed_tokens, v, group)
    if "lm_head" in net:
        net.lm_head = VocabHead(net.lm_head, group)


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

    def __init__(
        self, net: Any, ranks: Ranks, layout: Layout, dtype: mx.Dtype, config: ModelConfig
    ):
        self.net = net
        self.ranks = ranks
        self.part = layout
        self.hidden_dtype = net.hidden_dtype(dtype)
        self._config = config

    @property
    def config(self) -> ModelConfig:
        """The whole model's (the network's own holds this rank's heads and rows)."""
        return self._config

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
        seen = {"inserts": inserts} if inserts else {}  # images: every rank has the features
        return self.net(inputs, cache, last_only, **seen)

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: object = None
    ) -> mx.array:
        seen = {"inserts": inserts} if inserts else {}
        return self.net.hidden_states(inputs, cache, **seen)

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        return self.net.head(h, last_only)

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        return self.net.decode_batch(tokens, caches)

    def verify_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        raise UnsupportedError("this network verifies one sequence per forward")


def check_group(size: int, ranks: Ranks | None) -> None:
    """PipelineError unless `--tensor size` matches the launched ranks (more ranks than the
    group: tensor_stage.py's placement)."""
    have = 1 if ranks is None else ranks.size
    if size != have:
        raise PipelineError(
            f"{size} tensor ranks asked for but {have} run: start them with mlx.launch -n "
            f"{size} (or -n {2 * size} for two pipeline stages of {size})",
            field="--tensor",
        )
