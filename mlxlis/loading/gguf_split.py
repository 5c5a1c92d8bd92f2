"""Opening a GGUF (`read_gguf`): one file, or a GGUF split into parts by llama.cpp's
`gguf-split`, read as one file.

Layout (tools/gguf-split/gguf-split.cpp): the parts are named `PREFIX-00001-of-00003.gguf`, ...
(`llama_split_path`, numbered from 1); each is a complete GGUF whose tensor offsets are relative
to its own data section. The first part carries all of the model's metadata; every part carries
`split.no` (u16, from 0), `split.count` (u16) and `split.tensors.count` (i32, the tensors of all
parts together). With `--no-tensor-first-split` the first part holds metadata only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mlxlis.errors import FileFormatError, ModelNotFoundError
from mlxlis.loading.gguf import GGUFFile, GGUFTensor

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def split_count(gf: GGUFFile) -> int:
    """The number of parts the file belongs to (1 for a whole file)."""
    return _int(gf, SPLIT_COUNT, default=1)


def part_paths(path: Path, count: int) -> list[Path]:
    """The paths of all `count` parts of the split that `path` is one part of."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise FileFormatError(
            f"part of a {count}-part split, but the name does not follow llama.cpp's "
            f"PREFIX-{1:05d}-of-{count:05d}.gguf: the other parts cannot be found",
            path=path,
            field=SPLIT_COUNT,
        )
    return [
        path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]


class SplitGGUF:
    """All parts of a split GGUF behind GGUFFile's interface: `metadata` of the first part,
    `tensors` of every part (each tensor's offset is in its own part), `raw`, `release`."""

    def __init__(self, first: GGUFFile, count: int):
        self.parts: list[GGUFFile] = []
        self._owner: dict[str, GGUFFile] = {}
        try:
            self._open(first, count)
        except BaseException:
            self.close()
            first.close()
            raise

    def _open(self, given: GGUFFile, count: int) -> None:
        paths = part_paths(given.path, count)
        for i, p in enumerate(paths):
            if p.name == given.path.name:
                gf = given
            elif not p.is_file():
                raise ModelNotFoundError(
                    f"part {i + 1} of {count} of a split GGUF is missing "
                    f"(opened from {given.path.name})",
                    path=p,
                )
            else:
                gf = GGUFFile(p)
            self.parts.append(gf)
            if _int(gf, SPLIT_NO, default=-1) != i:
                raise FileFormatError(f"expected part {i} of the split", path=p, field=SPLIT_NO)
            if split_count(gf) != count:
                raise FileFormatError(
                    f"says {split_count(gf)} parts, the first says {count}",
                    path=p,
                    field=SPLIT_COUNT,
                )
        first = self.parts[0]
        self.path, self.version, self.alignment = first.path, first.version, first.alignment
        self.metadata: dict[str, Any] = first.metadata
        self.metadata_types: dict[str, int] = first.metadata_types
        self.tensors: dict[str, GGUFTensor] = {}
        for gf in self.parts:
            for name, t in gf.tensors.items():
                if name in self.tensors:
                    raise FileFormatError(
                        "tensor appears in two parts of the split", path=gf.path, field=name
                    )
                self.tensors[name] = t
                self._owner[name] = gf
        expected = _int(first, SPLIT_TENSORS, default=len(self.tensors))
        if expected != len(self.tensors):
            raise FileFormatError(
                f"the parts hold {len(self.tensors)} tensors, the first part says {expected}",
                path=first.path,
                field=SPLIT_TENSORS,
            )

    def raw(self, name: str):
        owner = self._owner.get(name)
        return (owner or self.parts[0]).raw(name)  # an unknown name: the part's own error

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        owner = self._owner.get(name)
        if owner is not None:
            owner.release(name, start, stop)

    def close(self) -> None:
        for gf in self.parts:
            gf.close()

    def __enter__(self) -> SplitGGUF:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SplitGGUF({str(self.path)!r}, {len(self.parts)} parts, {len(self.tensors)} tensors)"
        )


def _int(gf: GGUFFile, key: str, default: int) -> int:
    if key not in gf.metadata:
        return default
    value = gf.metadata[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FileFormatError(
            f"must be a non-negative integer, got {value!r}", path=gf.path, field=key
        )
    return value


def read_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file (v2/v3, little-endian). Any part of a split GGUF
    (`NAME-00001-of-00003.gguf`, ...) opens all its parts as one file (gguf_split.py)."""
    gf = GGUFFile(path)
    if "split.count" not in gf.metadata:
        return gf
    try:
        count = split_count(gf)
    except BaseException:
        gf.close()
        raise
    return gf if count <= 1 else SplitGGUF(gf, count)  # type: ignore[return-value]
