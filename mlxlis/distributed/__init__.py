"""Pipeline parallelism across the ranks of MLX's distributed layer (`mlx.launch`).

Under a launcher with two or more ranks, `mlxlis.load` gives each rank a contiguous share of
the layers (split.py), reads only that share's tensors from the file, and wraps the network in
a `PipelineNet` (stage.py) that passes hidden states rank to rank. Rank 0 runs the surface and
its generation core, whose steps are LeaderSteps (leader.py): each step is announced to the
other ranks, which `follow`. group.py holds the ranks and the failure handling. With
`--tensor N` (MLXLIS_TENSOR) each rank holds a slice of every layer instead (tensor.py, a
`Tensor` placement), its steps led from rank 0 alike; with twice N ranks, two pipeline
stages of a tensor pair each (tensor_stage.py, a `TensorStages` placement; 2 × 2 only).
Outside a launcher nothing here runs.
Imports the generation core and below; the core never imports this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.distributed.collectives import Pair, World
from mlxlis.distributed.digest import check_same_model
from mlxlis.distributed.group import Ranks, launched, world
from mlxlis.distributed.leader import LeaderSteps
from mlxlis.distributed.split import (
    Part,
    check_fit,
    check_split,
    plan_parts,
)
from mlxlis.distributed.stage import PipelineNet
from mlxlis.distributed.tensor import Layout, TensorNet, check_group, plan_layout, shard
from mlxlis.distributed.tensor_stage import TensorStageNet, check_shape
from mlxlis.errors import PipelineError, TooLargeError, UnsupportedError
from mlxlis.generation.steps import pipeline_steps
from mlxlis.runtime.memory import memory_budget
from mlxlis.settings import parse_split, settings

import mlx.core as mx

__all__ = [
    "Pipeline",
    "held_alone",
    "Tensor",
    "placement_from_env",
    "PipelineNet",
    "Part",
    "Ranks",
    "launched",
    "world",
    "parse_split",
    "plan_parts",
]

MiB = 1 << 20

pipeline_steps(LeaderSteps)  # the core runs a pipelined model's steps led from rank 0


@dataclass
class Pipeline:
    """What a load needs to place one rank's share: the ranks (None: a lone process, where
    only the split is checked) and the split asked for (None: balanced by weight bytes)."""

    ranks: Ranks | None
    split: Sequence[int] | None = None

    @classmethod
    def from_env(cls, split: str | Sequence[int] | None = None) -> Pipeline:
        """The launched ranks (None outside a launcher) and `split`, else MLXLIS_LAYERS_SPLIT."""
        if split is None:
            split = settings().layers_split
        if isinstance(split, str):
            split = parse_split(split)
        return cls(world(), split)

    def place(self, cfg: Any, sizes: Mapping[str, int], what: str) -> Part | None:
        """This rank's Part for a model of config `cfg` whose module tensors take `sizes`
        bytes; None in a lone process. Collective: every rank checks that all ranks read the
        same model and that every share fits in its rank's memory, before any weight is read."""
        layers = cfg.num_hidden_layers
        if self.ranks is None:
            if self.split is not None:
                check_split(self.split, layers, 1)
            check_lone_fit(sum(sizes.values()), what)
            return None
        check_same_model(self.ranks, what)  # first: a different file may fail what follows
        check_pipelinable(cfg, what)
        ranks = self.ranks
        parts = plan_parts(sizes, layers, ranks.size, cfg.tie_word_embeddings, self.split)
        part = parts[ranks.rank]
        total = sum(sizes.values())
        model_id = [layers, cfg.hidden_size, cfg.vocab_size, total // MiB, total % MiB]
        rows = ranks.gather([*model_id, -(-part.nbytes // MiB), memory_budget() // MiB])
        for r, row in enumerate(rows):
            if row[:5] != model_id:
                raise PipelineError(
                    f"rank {r} opened a different model ({row[0]} layers, {row[3]} MiB of "
                    f"weights) from rank {ranks.rank} ({layers} layers, {model_id[3]} MiB): "
                    "every rank needs the same file",
                    path=what,
                )
        check_fit([row[5] * MiB for row in rows], [row[6] * MiB for row in rows], what)
        return part

    def wrap(self, net: Any, part: Part, dtype: mx.Dtype) -> PipelineNet:
        assert self.ranks is not None
        return PipelineNet(net, self.ranks, part, dtype)

    def ready(self) -> None:
        """Every rank has loaded its share (an untimed wait: loads differ in length)."""
        if self.ranks is not None:
            self.ranks.barrier()


@dataclass
class Tensor:
    """A tensor-parallel load (`--tensor N`, tensor.py): every rank checks that the model
    splits evenly and that all ranks opened the same one, then reads its slices only."""

    ranks: Ranks | None
    size: int
    config: Any = None  # the whole model's, once placed

    def place(self, cfg: Any, sizes: Mapping[str, int], what: str) -> Layout | None:
        check_group(self.size, self.ranks)
        if self.ranks is None:  # --tensor 1 in a lone process: nothing to split
            check_lone_fit(sum(sizes.values()), what)
            return None
        check_same_model(self.ranks, what)  # first: a different file may fail what follows
        check_pipelinable(cfg, what)
        ranks = self.ranks
        layout = plan_layout(cfg, ranks.rank, ranks.size, what)
        self.config = cfg
        total = sum(sizes.values())
        model_id = [cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, total // MiB]
        for r, row in enumerate(ranks.gather(model_id)):
            if row != model_id:
                raise PipelineError(
                    f"rank {r} opened a different model ({row[0]} layers, {row[3]} MiB of "
                    f"weights) from rank {ranks.rank} ({model_id[0]} layers, {model_id[3]} "
                    "MiB): every rank needs the same file",
                    path=what,
                )
        return layout

    def wrap(self, net: Any, layout: Layout, dtype: mx.Dtype) -> TensorNet:
        assert self.ranks is not None
        shard(net, layout, World(self.ranks.group), "model")
        held = sum({id(a): a.nbytes for _, a in _leaves(net.parameters())}.values())
        return TensorNet(net, self.ranks, replace(layout, nbytes=held), dtype, self.config)

    def ready(self) -> None:
        if self.ranks is not None:
            self.ranks.barrier()


@dataclass
class TensorStages:
    """Tensor groups inside pipeline stages (tensor_stage.py): 2 stages of 2 tensor ranks,
    the layers split between the stages as a pipeline's (`split`, else balanced), each
    stage's layers sliced between its pair."""

    ranks: Ranks
    size: int
    split: Sequence[int] | None = None
    config: Any = None

    def place(self, cfg: Any, sizes: Mapping[str, int], what: str) -> Layout:
        ranks = self.ranks
        check_same_model(ranks, what)  # first: a different file may fail what follows
        check_pipelinable(cfg, what)
        stages = ranks.size // self.size
        tied = cfg.tie_word_embeddings
        parts = plan_parts(sizes, cfg.num_hidden_layers, stages, tied, self.split)
        layout = plan_layout(cfg, ranks.rank, self.size, what)
        self.config = cfg
        return replace(layout, stage=parts[ranks.rank // self.size])

    def wrap(self, net: Any, layout: Layout, dtype: mx.Dtype) -> TensorStageNet:
        peer = self.ranks.rank ^ 1  # the other rank of its pair: 0-1, 2-3
        shard(net, layout, Pair(self.ranks.group, self.ranks.rank, peer), "model")
        held = sum({id(a): a.nbytes for _, a in _leaves(net.parameters())}.values())
        layout = replace(layout, nbytes=held)
        return TensorStageNet(net, self.ranks, layout, dtype, self.config)

    def ready(self) -> None:
        self.ranks.barrier()


_alone: list[bool] = []  # inside `held_alone`


@contextlib.contextmanager
def held_alone() -> Iterator[None]:
    """Loads within it place the whole model in this process, as a lone process does, even
    under a launcher: a draft model held on rank 0 beside a target split across the ranks
    (the other ranks never load it: nothing collective runs)."""
    _alone.append(True)
    try:
        yield
    finally:
        _alone.pop()


def placement_from_env(split: str | Sequence[int] | None, tensor: int | None) -> Pipeline | Tensor:
    """How this process places a model it loads: split in tensor ranks (`tensor`, else
    MLXLIS_TENSOR), else pipelined by layers under a launcher (`split`); whole in this
    process inside `held_alone`."""
    if _alone:
        return Pipeline(None)
    if tensor is None:
        tensor = settings().tensor
    if tensor is None:
        return Pipeline.from_env(split)
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise PipelineError(f"{tensor!r}: a positive number of ranks", field="--tensor")
    ranks = world()
    if ranks is not None and ranks.size > tensor:  # tensor groups inside pipeline stages
        check_shape(tensor, ranks.size)
        return TensorStages(ranks, tensor, Pipeline.from_env(split).split)
    if split is not None or settings().layers_split is not None:
        raise PipelineError(
            "--layers-split with --tensor needs more ranks than the tensor group (stages of "
            f"{tensor} ranks)",
            field="--tensor",
        )
    return Tensor(ranks, tensor)


def _leaves(tree: Any) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def check_lone_fit(stored: int, what: str) -> None:
    """TooLargeError when the weights as stored (`stored` bytes: what a load takes at least;
    made dense or in a wider dtype they take more) exceed the memory this process may fill."""
    budget = memory_budget()
    if stored > budget:
        gib = 2**30
        raise TooLargeError(
            f"its weights take {stored / gib:.2f} GiB as stored, more than the "
            f"{budget / gib:.2f} GiB this process may fill (the GPU's working set, or the free "
            "memory; MLXLIS_MAX_MEMORY caps it): use a smaller quantization, or split it across "
            "machines with mlx.launch",
            path=what,
        )


def check_pipelinable(cfg: Any, what: str) -> None:
    """UnsupportedError for a family whose network is not the shared Decoder."""
    from mlxlis.models import family
    from mlxlis.models.decoder import Decoder

    if not issubclass(family(cfg.family).network, Decoder):
        raise UnsupportedError(
            f"{cfg.family} models have their own network, which does not run pipelined "
            "across ranks yet; run it in one process",
            path=what,
        )
