"""Which rank holds which layers: the layer split (balanced by weight bytes, or given as
`--layers-split 14,14`), what each rank reads from the file, and whether each share fits.

Rank 0 also holds the embedding, the last rank the final norm and the head (and, when the head
is tied to the embedding, the embedding too). Sizes are the tensors' bytes as stored in the
file: the loaded form is the same for quantized blocks kept as MLX arrays (Metal, CUDA), and
larger only where the device policy makes weights dense because they fit comfortably.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlxlis.errors import DoesNotFitError, LayersSplitError
from mlxlis.loading.slices import Cut
from mlxlis.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
HEAD_PREFIXES = ("model.norm.", "lm_head.")
EMBED_PREFIX = "model.embed_tokens."


@dataclass(frozen=True)
class Part:
    """One rank's share: layers [start, stop), the embedding when first, the head when last."""

    rank: int
    size: int  # ranks in all
    start: int
    stop: int
    tied: bool  # the head is the embedding (then the last rank holds the embedding too)
    nbytes: int = 0  # weight bytes as stored in the file

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    speculates = False  # the last stage sends (B, vocab): no positions' logits to verify
    sees = False  # the first stage would need the tower's features: not yet

    @property
    def embeds(self) -> bool:
        """Holds the embedding table: to embed (first) or as the tied head (last)."""
        return self.first or (self.last and self.tied)

    def holds(self, name: str) -> bool:
        """Whether module tensor `name` (e.g. model.layers.3.mlp.up_proj.weight) is this
        rank's to read; names outside the blocks, embedding and head go to every rank."""
        m = _LAYER.match(name)
        if m:
            return self.start <= int(m.group(1)) < self.stop
        if name.startswith(EMBED_PREFIX):
            return self.embeds
        if name.startswith(HEAD_PREFIXES):
            return self.last
        return True

    def local(self, cfg: ModelConfig) -> ModelConfig:
        return cfg

    def cut(self, name: str) -> Cut | None:
        return None  # a stage reads its tensors whole

    def describe(self) -> str:
        what = [f"layers {self.start}-{self.stop - 1}"]
        if self.embeds:
            what.append("embedding")
        if self.last:
            what.append("head")
        return f"rank {self.rank} of {self.size}: " + ", ".join(what)


def check_split(split: Sequence[int], layers: int, ranks: int) -> list[int]:
    """A split of `layers` over `ranks`, or a LayersSplitError saying what is wrong."""
    split = list(split)
    shown = ",".join(map(str, split))
    if len(split) != ranks:
        runs = "this process runs alone" if ranks == 1 else f"{ranks} ranks run"
        raise LayersSplitError(
            f"{shown} has {len(split)} entries but {runs} (one entry per rank: start "
            f"{len(split)} ranks with mlx.launch -n {len(split)})",
            field="--layers-split",
        )
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in split):
        raise LayersSplitError(
            f"{shown}: every rank needs a positive whole number of layers", field="--layers-split"
        )
    if sum(split) != layers:
        raise LayersSplitError(
            f"{shown} adds up to {sum(split)} layers; the model has {layers}",
            field="--layers-split",
        )
    return split


def layer_bytes(sizes: Mapping[str, int], layers: int) -> tuple[list[int], int, int]:
    """(bytes of each block, of the embedding, of the final norm and untied head) from module
    tensor name -> bytes."""
    per_layer = [0] * layers
    embed = head = 0
    for name, n in sizes.items():
        m = _LAYER.match(name)
        if m and int(m.group(1)) < layers:
            per_layer[int(m.group(1))] += n
        elif name.startswith(EMBED_PREFIX):
            embed += n
        elif name.startswith(HEAD_PREFIXES):
            head += n
    return per_layer, embed, head


def balanced_split(
    per_layer: Sequence[int], ranks: int, first_extra: int = 0, last_extra: int = 0
) -> list[int]:
    """Contiguous layer counts, at least one each, minimising the largest rank's bytes (rank 0
    also carries `first_extra`, the last rank `last_extra`). Exact, by dynamic programming over
    (ranks × layers²): a few milliseconds for hundreds of layers."""
    n = len(per_layer)
    if ranks > n:
        raise LayersSplitError(
            f"{ranks} ranks but the model has only {n} layers: at most one rank per layer",
            field="ranks",
        )
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)

    def load(r: int, a: int, b: int) -> int:  # rank r holding layers [a, b)
        extra = (first_extra if r == 0 else 0) + (last_extra if r == ranks - 1 else 0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[r][i]: the smallest max load placing layers [0, i) on ranks 0..r-1
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]
    cut = [[0] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0
    for r in range(1, ranks + 1):
        for i in range(r, n - (ranks - r) + 1):
            for j in range(r - 1, i):  # rank r-1 holds [j, i)
                v = max(best[r - 1][j], load(r - 1, j, i))
                if v < best[r][i]:
                    best[r][i], cut[r][i] = v, j
    split, i = [], n
    for r in range(ranks, 0, -1):
        j = cut[r][i]
        split.append(i - j)
        i = j
    return split[::-1]


def plan_parts(
    sizes: Mapping[str, int],
    layers: int,
    ranks: int,
    tied: bool,
    split: Sequence[int] | None = None,
) -> list[Part]:
    """Every rank's Part: `split` checked, else balanced by weight bytes."""
    per_layer, embed, head = layer_bytes(sizes, layers)
    if split is not None:
        counts = check_split(split, layers, ranks)
    else:
        counts = balanced_split(per_layer, ranks, embed, head + (embed if tied else 0))
    parts, start = [], 0
    for r, k in enumerate(counts):
        part = Part(r, ranks, start, start + k, tied)
        nbytes = sum(n for name, n in sizes.items() if part.holds(name))
        parts.append(Part(r, ranks, start, start + k, tied, nbytes))
        start += k
    return parts


def check_fit(needs: Sequence[int], budgets: Sequence[int], what: str) -> None:
    """DoesNotFitError naming every rank whose share (`needs`) exceeds its memory."""
    over = [r for r, (n, b) in enumerate(zip(needs, budgets, strict=True)) if n > b]
    if not over:
        return
    gib = 2**30
    detail = "; ".join(
        f"rank {r} needs {needs[r] / gib:.2f} GiB and has {budgets[r] / gib:.2f}" for r in over
    )
    raise DoesNotFitError(
        f"does not fit even split across {len(needs)} ranks ({detail} GiB available): "
        "start more ranks, move layers with --layers-split, or use a smaller quantization",
        path=what,
    )
