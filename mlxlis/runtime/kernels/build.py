"""Building the CPU kernels' extension (src/, CMakeLists.txt) against the MLX that
runs it: `python -m mlxlis.runtime.kernels` (make install runs it; a first use builds it too).

Not in setup.py: pip builds in an isolated environment that would install its own newest
mlx to compile against, while libmlx's C++ ABI and mlx.core's nanobind internals are not stable
across versions: the module must be compiled against the very mlx that imports it. So it is
built with the running interpreter's mlx headers and libmlx (the wheel ships them and its CMake
config) and cached under a key of all that matters: the mlx version and folder, the Python ABI,
the nanobind version, the machine and the sources' hash. A new mlx means a new build.

Needs (Linux only; nothing is built on macOS, where Metal has MLX's own kernels): a C++20
compiler, cmake (the system's or the `cmake` wheel), and the `nanobind` wheel whose internals
ABI equals mlx.core's (checked first). Without them the engine keeps MLX's own products.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mlxlis.settings import settings

HERE = Path(__file__).resolve().parent
SOURCES = sorted((HERE / "src").glob("*.[ch]*")) + [HERE / "CMakeLists.txt"]
MODULE = "_qmv"


class BuildError(RuntimeError):
    """Why the extension cannot be built here (said by `inspect` and `--verbose`)."""


def cache_root() -> Path:
    if (folder := settings().kernels) is not None:
        return folder
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlxlis" / "kernels"


def mlx_dir() -> Path:
    import mlx.core as mx

    return Path(mx.__file__).resolve().parent  # mlx is a namespace package: use core's folder


def _nanobind_version() -> str:
    try:
        return version("nanobind")
    except PackageNotFoundError:
        return ""


def so_path() -> Path:
    """Where this mlx + Python + nanobind + machine + sources' build lives."""
    import mlx.core as mx

    h = hashlib.sha256()
    for p in SOURCES:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for part in (mx.__version__, str(mlx_dir()), sysconfig.get_config_var("EXT_SUFFIX") or ""):
        h.update(part.encode() + b"\0")
    h.update(_nanobind_version().encode())
    key = f"mlx{mx.__version__}-{platform.machine()}-{h.hexdigest()[:16]}"
    return cache_root() / key / (MODULE + importlib.machinery.EXTENSION_SUFFIXES[0])


def nanobind_mismatch() -> str | None:
    """None when the installed nanobind shares mlx.core's internals ABI (so mx.array crosses
    between the modules), else why not. nanobind 3 keys its shared state by
    "…_a<backend ABI>_v<internals>"; that key is compiled into mlx.core."""
    try:
        import nanobind
    except ImportError:
        return "nanobind is not installed"
    root = Path(nanobind.__file__).parent
    try:
        internals = re.search(
            r"define NB_INTERNALS_VERSION (\d+)", (root / "src/nb_internals.h").read_text()
        ).group(1)
        major = re.search(
            r"define NB_BACKEND_ABI_MAJOR (\d+)",
            (root / "include/nanobind/nb_backend.h").read_text(),
        ).group(1)
    except (OSError, AttributeError):
        return f"nanobind {_nanobind_version()} is not laid out as nanobind 3"
    core = next(mlx_dir().glob("core*.so"), None)
    key = f"_a{major}_v{internals}".encode()
    if core is None or key not in core.read_bytes():
        return f"nanobind {_nanobind_version()} ({key.decode()}) is not the one mlx was built with"
    return None


def _cmake() -> str:
    try:  # the PyPI wheel first: a known version
        import cmake

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        found = shutil.which("cmake")
        if found is None:
            raise BuildError("cmake not found (pip install cmake)") from None
        return found


def build(target: Path, verbose: bool = False) -> Path:
    """Configure and compile in a fresh temporary folder; the module renamed into `target`."""
    if not sys.platform.startswith("linux"):
        raise BuildError("built on Linux only (Metal has MLX's own quantized kernels)")
    if why := nanobind_mismatch():
        raise BuildError(why)
    cmake = _cmake()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxlis-kernels-") as tmp:
        run = dict(check=True, capture_output=not verbose, text=True)
        configure = [
            *(cmake, "-S", str(HERE), "-B", tmp, *gen),
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMLX_ROOT={mlx_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        try:
            subprocess.run(configure, **run)
            subprocess.run([cmake, "--build", tmp, "-j", str(os.cpu_count() or 1)], **run)
        except (subprocess.CalledProcessError, OSError) as e:
            out = getattr(e, "stdout", "") or ""
            err = getattr(e, "stderr", "") or str(e)
            raise BuildError(f"the build failed: {(out + err).strip()[-600:]}") from None
        part = target.with_name(target.name + f".part{os.getpid()}")
        shutil.copy2(Path(tmp) / target.name, part)
        os.replace(part, target)  # atomic: a concurrent loader sees all of it or nothing
    return target


def ensure(verbose: bool = False, retry: bool = False) -> Path:
    """The module's path, built first if missing (one builder per key; others wait). A build
    that failed is not tried again for the same key (its reason is kept beside it) unless
    `retry` (`python -m mlxlis.runtime.kernels`)."""
    target = so_path()
    if target.is_file():
        return target
    if not settings().build_kernels:
        raise BuildError("not built, and MLXLIS_BUILD_KERNELS=0")
    failed = target.parent / "failed.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        if failed.is_file() and not retry:
            raise BuildError(failed.read_text())
        if verbose:
            print("building the CPU quantized kernels (once)…", file=sys.stderr)
        try:
            build(target, verbose=False)
        except BuildError as e:
            failed.write_text(str(e))
            raise
        failed.unlink(missing_ok=True)
    return target
