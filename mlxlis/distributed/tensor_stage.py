"""Tensor groups inside pipeline stages (`--tensor 2` over 4 ranks: 2 × 2).

Ranks 0 and 1 are stage 0's tensor pair, ranks 2 and 3 stage 1's: each pair splits its
stage's layers as tensor.py does, its sums and gathers an exchange between the two (a
collectives.Pair). The ring joins 0-1-2-3-0 and MLX's ring backend sends only to a neighbour,
so stage 0's rank r hands the hidden states (the same on both of its ranks) to rank 3 − r, its
neighbour in stage 1; rank 3, rank 0's neighbour, sends the step's logits to rank 0 (both of
stage 1's ranks compute them whole). Other shapes (3 stages, groups of 3) would need sends
past a neighbour: refused by name.
"""

from __future__ import annotations

from typing import Any

from mlxlis.distributed.group import Ranks
from mlxlis.distributed.stage import PipelineNet
from mlxlis.distributed.tensor import Layout
from mlxlis.errors import PipelineError, UnsupportedError
from mlxlis.models.config import ModelConfig

import mlx.core as mx

TENSOR, STAGES = 2, 2  # the one shape a ring of neighbours carries


def check_shape(tensor: int, ranks: int) -> None:
    """PipelineError unless `ranks` launched ranks make 2 stages of `tensor` = 2."""
    if tensor != TENSOR or ranks != TENSOR * STAGES:
        raise PipelineError(
            f"--tensor {tensor} over {ranks} ranks: tensor groups inside pipeline stages run "
            "as 2 stages of 2 ranks (mlx.launch -n 4 ... --tensor 2) only, as MLX's ring "
            "backend sends to its neighbours only",
            field="--tensor",
        )


class TensorStageNet(PipelineNet):
    """One rank of a 2 × 2: its stage's layers, sliced; hidden states from and to its
    neighbour in the other stage."""

    def __init__(
        self, net: Any, ranks: Ranks, layout: Layout, dtype: mx.Dtype, config: ModelConfig
    ):
        super().__init__(net, ranks, layout, dtype)  # type: ignore[arg-type]
        self._config = config
        self.across = ranks.size - 1 - ranks.rank  # the other stage's neighbour

    @property
    def config(self) -> ModelConfig:
        """The whole model's (the network's own holds this rank's heads and rows)."""
        return self._config

    @property
    def sends_logits(self) -> bool:
        return self.part.last and self.ranks.rank == self.ranks.size - 1

    def __call__(
        self,
        inputs: mx.array,
        cache: list | None = None,
        last_only: bool = False,
        inserts: object = None,
    ) -> mx.array:
        if inserts:
            raise UnsupportedError("images with a model split across ranks", field="images")
        group = self.ranks.group
        b, t = inputs.shape[:2]
        if self.is_first:
            h = self.net.embed(inputs)
        else:
            shape = (b, t, self.net.config.hidden_size)
            h = mx.distributed.recv(shape, self.hidden_dtype, self.across, group=group)
        h = self.net.run_layers(h, cache)  # (B, T, hidden)
        if not self.is_last:
            return mx.distributed.send(h.astype(self.hidden_dtype), self.across, group=group)
        return self.net.head(h, last_only)
