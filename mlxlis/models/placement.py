"""What building a model asks of a pipeline (the distributed layer, above this one, provides
it): where this rank's share of the layers lies, and the network wrapped as a pipeline stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from mlxlis.loading.slices import Cut
from mlxlis.models.config import ModelConfig
from mlxlis.models.network import Network

import mlx.core as mx


class Share(Protocol):
    """One rank's share of the layers: layers [start, stop), the embedding when first, the
    final norm and head when last."""

    @property
    def rank(self) -> int: ...

    @property
    def first(self) -> bool: ...

    @property
    def last(self) -> bool: ...

    @property
    def layers(self) -> range: ...

    def holds(self, name: str) -> bool:
        """Whether module tensor `name` is this rank's to read."""
        ...

    def describe(self) -> str: ...

    @property
    def speculates(self) -> bool:
        """Whether its steps verify speculative drafts (rank 0 holds every verified position's
        logits and the other ranks trim their caches to the verdict: tensor ranks; not a
        pipeline's stages yet)."""
        ...

    @property
    def sees(self) -> bool:
        """Whether images reach its steps: rank 0 loads the vision tower and sends each
        chunk's image features with the step (tensor ranks; not a pipeline's stages yet)."""
        ...

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """The config of the network this rank builds (a tensor rank's heads and rows; a
        pipeline stage's is the whole model's)."""
        ...

    def cut(self, name: str) -> Cut | None:
        """The slice of module tensor `name` this rank reads (None: all of it)."""
        ...


class Placement(Protocol):
    def place(self, cfg: ModelConfig, sizes: Mapping[str, int], what: str) -> Share | None:
        """This rank's share for a model whose module tensors take `sizes` bytes (None: the
        whole model, one process). Collective across the ranks."""
        ...

    def wrap(self, net: Network, share: Share, dtype: mx.Dtype) -> Network:
        """`net` (built for `share` only) as the pipeline stage that passes activations on."""
        ...
