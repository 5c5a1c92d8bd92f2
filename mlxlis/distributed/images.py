"""Images under `--tensor`: rank 0 holds the vision tower and the other ranks receive what it
made of each image.

Every rank embeds a prompt chunk's ids and needs the image features that replace the
placeholders' rows, whole (hidden wide: the embedding's sum gives every rank the whole
embeddings). Rank 0 alone loads the tower and runs it (the other ranks would repeat the same
work on the same pixels), and sends a chunk's features with the step: their offsets, shapes
and the Inserts' settings in the step's message, the values in one all_sum to which the other
ranks add zeros (exact: x + 0 = x). Per image that is tokens × hidden × 4 bytes (Gemma 3's
256 × 2560: 2.6 MB), less than its pixels (896² × 3 × 4: 9.6 MB).
"""

from __future__ import annotations

from mlxlis.distributed.group import Ranks
from mlxlis.models.multimodal import Inserts

import mlx.core as mx


def describe(inserts: Inserts) -> dict:
    """What the step's message carries of `inserts` (its features go by `send`)."""
    positions = None if inserts.positions is None else inserts.positions.tolist()
    return {
        "parts": [[o, list(f.shape)] for o, f in inserts.parts],
        "fill": inserts.fill,
        "bidirectional": inserts.bidirectional,
        "positions": positions,
    }


def send(ranks: Ranks, inserts: Inserts) -> None:
    """Rank 0: the features of `inserts` to every rank (after the step's message)."""
    flat = [f.astype(mx.float32).reshape(-1) for _, f in inserts.parts]  # (rows × hidden,)
    _share(ranks, mx.concatenate(flat))


def receive(ranks: Ranks, told: dict) -> Inserts:
    """Another rank: the Inserts rank 0 described in `told`, its features received."""
    sizes = [rows * width for _, (rows, width) in told["parts"]]
    flat = _share(ranks, mx.zeros((sum(sizes),), mx.float32))
    parts, at = [], 0
    for (offset, shape), n in zip(told["parts"], sizes, strict=True):
        parts.append((offset, flat[at : at + n].reshape(shape)))  # (rows, hidden)
        at += n
    positions = told["positions"]
    return Inserts(
        parts,
        told["fill"],
        told["bidirectional"],
        None if positions is None else mx.array(positions, mx.int32),
    )


def _share(ranks: Ranks, x: mx.array) -> mx.array:
    with ranks.translate():
        total = mx.distributed.all_sum(x, group=ranks.group)
        mx.eval(total)
    return total
