"""What every rank checks before it reads a weight: that all ranks opened the same model.

Each rank hashes what it is about to load, cheaply: each file's size, its first 4 MiB (a
GGUF's header and tensor table, up to there; a safetensors header) and 16 samples of 4 KiB
spread across it, a folder's config.json and weight files alike. Rank 0's digest is compared
with every rank's (one gather) before any other collective, so ranks holding different
files stop with one error naming the rank instead of splitting two models or waiting on each
other. Files that differ only outside the bytes hashed pass (two fine-tunes with the same
shapes differ in their samples).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mlxlis.distributed.group import Ranks
from mlxlis.errors import PipelineError

HEAD = 4 << 20  # bytes hashed from the start of each file
SAMPLES = 16  # pieces hashed across each file
SAMPLE = 4096


def model_files(what: str) -> list[Path]:
    """The files a load reads: the file itself, or a folder's config.json and weights."""
    path = Path(what)
    if path.is_file():
        return [path]
    return sorted([p for p in [path / "config.json", *path.glob("*.safetensors")] if p.is_file()])


def model_digest(what: str) -> list[int]:
    """The digest of the model at `what`, as 8 integers of 24 bits (a gather's int32s)."""
    h = hashlib.sha256()
    for f in model_files(what):
        size = f.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            h.update(fh.read(HEAD))
            for i in range(SAMPLES):
                fh.seek(size * i // SAMPLES)
                h.update(fh.read(SAMPLE))
    d = h.digest()
    return [int.from_bytes(d[i : i + 3], "little") for i in range(0, 24, 3)]


def check_same_model(ranks: Ranks, what: str) -> None:
    """PipelineError on every rank when a rank's model is not rank 0's (collective)."""
    rows = ranks.gather(model_digest(what))
    for r, row in enumerate(rows):
        if row != rows[0]:
            raise PipelineError(
                f"rank {r} of {ranks.size} opened a different model from rank 0 (its size, "
                f"header or sampled bytes differ; this is rank {ranks.rank}'s {what}): every "
                "rank needs the same file",
                path=what,
            )
