"""Every environment variable mlxlis reads, in one table, and the settings they give.

`VARS` is mlxlis's own: each row is a field of the frozen `Settings`, with its parser, default
and meaning. `settings()` reads them from the process's environment once and keeps them;
`reload()` makes the next call read them again (a process that changes its own environment: the
chat command's --layers-split, the tests' monkeypatching). A bad value is an MlxlisError naming
the variable, raised by the first `settings()` after it is set.

`NATIVE` rows are read by the compiled kernels themselves (getenv in C/C++), `DEVELOPMENT` rows by
the tests and scripts, `HONOURED` rows belong to other programs (the Hugging Face Hub library,
llama.cpp, XDG, MLX's launcher, OpenBLAS) and are read where they are used; all are documented
with the rest in docs/environment.md (tests/test_settings.py holds the two to each other).
This module sits at the bottom (beside errors): runtime/blas.py reads it before mlx.core loads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, LayersSplitError, MlxlisError, PipelineError

BLAS_CHOICES = ("auto", "wheel", "system", "bundled")
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def parse_flag(text: str) -> bool:
    """`0`/`1` (also false/true, no/yes, off/on): a switch."""
    if text.strip().lower() in ON:
        return True
    if text.strip().lower() in OFF:
        return False
    raise ValueError(f"expected 0 or 1, got {text!r}")


def parse_bytes(text: str, field: str) -> int:
    """'24G', '512M', '1.5G', '1000000' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", text.upper())
    if not m:
        raise ConfigError(f"expected a size such as 24G or 512M, got {text!r}", field=field)
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_split(text: str, field: str = "--layers-split") -> list[int]:
    """'14,14' -> [14, 14]: positive integers separated by commas (the CLI's --layers-split,
    or MLXLIS_LAYERS_SPLIT: `field` names it in errors)."""
    parts = [p.strip() for p in str(text).split(",")]
    counts = []
    for p in parts:
        if not re.fullmatch(r"\d+", p):
            raise LayersSplitError(
                f"expected layer counts separated by commas (e.g. 14,14), got {text!r}",
                field=field,
            )
        if int(p) == 0:
            raise LayersSplitError(
                f"every rank needs at least one layer, got {text!r}", field=field
            )
        counts.append(int(p))
    return counts


def parse_tensor(text: str, field: str = "--tensor") -> int:
    """'2' -> 2: the ranks each layer is split across (the CLI's --tensor, or MLXLIS_TENSOR)."""
    if not re.fullmatch(r"\s*\d+\s*", str(text)) or int(text) < 1:
        raise PipelineError(f"expected a positive number of ranks, got {text!r}", field=field)
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):  # NaN is not > 0
        raise ValueError(f"must be a positive number of seconds, not {text!r}")
    return value


def _device(text: str) -> str:
    if text.lower() not in ("cpu", "gpu"):
        raise ValueError(f"must be cpu or gpu, not {text.lower()!r}")
    return text.lower()


def _blas(text: str) -> str:
    if text.lower() not in BLAS_CHOICES:
        raise ValueError(f"must be one of {', '.join(BLAS_CHOICES)}, not {text!r}")
    return text.lower()


def _folders(text: str) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser() for p in text.split(os.pathsep) if p)


def _folder(text: str) -> Path:
    return Path(text).expanduser()


@dataclass(frozen=True)
class Var:
    """One environment variable: `field` of Settings (None: not read through Settings), the
    parser of a set value, the default when unset (or empty, unless `empty_is_unset` is off),
    and one line of meaning."""

    name: str
    field: str | None
    parse: Callable[[str], Any] | None
    default: Any
    doc: str
    empty_is_unset: bool = True


VARS = (
    # where things live
    Var("MLXLIS_MODELS", "models", _folder, None, "folder catalog models are pulled into"),
    Var("MLXLIS_DATA", "data", _folder, None, "folder of the chat app's saved conversations"),
    Var(
        "MLXLIS_LMSTUDIO_MODELS",
        "lmstudio_models",
        _folders,
        None,
        "folders (os.pathsep-separated) `models --scan` lists LM Studio's GGUFs from",
        empty_is_unset=False,  # set but empty: no LM Studio folders
    ),
    Var("MLXLIS_KERNELS", "kernels", _folder, None, "folder the CPU quantized kernels build into"),
    # device and memory
    Var("MLXLIS_DEVICE", "device", _device, None, "cpu or gpu: the device MLX computes on"),
    Var(
        "MLXLIS_MAX_MEMORY",
        "max_memory",
        lambda t: parse_bytes(t, "MLXLIS_MAX_MEMORY"),
        None,
        "bytes (24G, 512M) the process may fill",
    ),
    # serving and several machines
    Var("MLXLIS_API_KEY", "api_key", str, None, "the key `mlxlis serve` requires"),
    Var(
        "MLXLIS_LAYERS_SPLIT",
        "layers_split",
        lambda t: tuple(parse_split(t, "MLXLIS_LAYERS_SPLIT")),
        None,
        "layers per rank, in rank order (50,30)",
    ),
    Var(
        "MLXLIS_TENSOR",
        "tensor",
        lambda t: parse_tensor(t, "MLXLIS_TENSOR"),
        None,
        "ranks each layer is split across (tensor parallelism under mlx.launch)",
    ),
    Var("MLXLIS_RANK_TIMEOUT", "rank_timeout", _seconds, 30.0, "seconds a rank waits for a peer"),
    # Linux CPU speed
    Var("MLXLIS_BLAS", "blas", _blas, "auto", "auto, wheel, system or bundled: the CPU BLAS"),
    Var("MLXLIS_NO_OPENBLAS", "no_openblas", bool, False, "any value: MLXLIS_BLAS=bundled"),
    Var("MLXLIS_BLAS_GEMV", "blas_gemv", parse_flag, True, "0: matrix-vector products on sgemm"),
    Var("MLXLIS_BLAS_SKINNY", "blas_skinny", parse_flag, True, "0: 2-16 row products on sgemm"),
    Var("MLXLIS_FUSED", "fused", parse_flag, True, "0: no fused C++ CPU nodes (runtime/backend)"),
    Var("MLXLIS_FAST_MATH", "fast_math", parse_flag, True, "0: no compiled exp/softmax/GLUs"),
    Var("MLXLIS_MALLOC_TUNE", "malloc_tune", parse_flag, True, "0: glibc's allocator defaults"),
    Var("MLXLIS_BUILD_KERNELS", "build_kernels", parse_flag, True, "0: never build the kernels"),
)

# read by the compiled code itself (getenv), never by Python
NATIVE = (
    Var("MLXLIS_SKINNY_THREADS", None, None, None, "the batch kernel's threads (_skinny_gemm.c)"),
    Var("QMV_ISA", None, None, None, "avx2 or scalar: the kernels' ISA (kernels/src/compute.cpp)"),
    Var("QMV_NUM_THREADS", None, None, None, "the kernels' threads (kernels/src/pool.cpp)"),
    Var("QMV_SPIN_US", None, None, None, "µs a kernel thread spins for the next job (pool.cpp)"),
    Var("QMV_YIELD_US", None, None, None, "µs it then yields before it sleeps (pool.cpp)"),
    Var("QMV_ADAPT", None, None, None, "0, or the waiting share that runs jobs alone (pool.cpp)"),
)

# read by the tests and scripts, never by mlxlis
DEVELOPMENT = (
    Var("MLXLIS_FUZZ_EXAMPLES", None, None, None, "examples per fuzz target"),
    Var("MLXLIS_VISION_MODEL", None, None, None, "a real multimodal checkpoint for the tests"),
    Var("MLXLIS_AGENT_CLIS", None, None, None, "1: the tests drive the real agent CLIs"),
    Var("MLXLIS_FINGERPRINT_MODELS", None, None, None, "where fingerprint.py builds checkpoints"),
)

# other programs' variables, honoured (or set) where they are used
HONOURED = (
    Var("HF_HOME", None, None, None, "the Hugging Face Hub library's"),
    Var("HF_HUB_CACHE", None, None, None, "the Hugging Face Hub library's"),
    Var("HF_TOKEN", None, None, None, "the Hugging Face Hub library's"),
    Var("HF_ENDPOINT", None, None, None, "the Hugging Face Hub library's"),
    Var("HF_HUB_OFFLINE", None, None, None, "the Hugging Face Hub library's"),
    Var("HF_HUB_DISABLE_PROGRESS_BARS", None, None, None, "also mlxlis's download progress"),
    Var("LLAMA_CACHE", None, None, None, "llama.cpp's cache, for `models --scan`"),
    Var("XDG_CACHE_HOME", None, None, None, "base of the default cache folders"),
    Var("XDG_DATA_HOME", None, None, None, "base of the default data folder"),
    Var("NO_COLOR", None, None, None, "Textual's: no images drawn in the chat app"),
    Var("OPENBLAS_THREAD_TIMEOUT", None, None, None, "set to 4 unless set (runtime/blas.py)"),
    Var("OPENBLAS_NUM_THREADS", None, None, None, "unless set, ranks on a host share cores"),
    Var("MLX_HOSTFILE", None, None, None, "mlx.launch's hosts: ranks on this host"),
    Var("MLX_RANK", None, None, None, "mlx.launch's: this process is a rank"),
    Var("OMPI_COMM_WORLD_SIZE", None, None, None, "MPI's: this process is a rank"),
    Var("PMI_SIZE", None, None, None, "MPI's: this process is a rank"),
)


@dataclass(frozen=True)
class Settings:
    """mlxlis's environment variables, parsed (one field per row of VARS, same defaults)."""

    models: Path | None = None
    data: Path | None = None
    lmstudio_models: tuple[Path, ...] | None = None
    kernels: Path | None = None
    device: str | None = None
    max_memory: int | None = None
    api_key: str | None = None
    layers_split: tuple[int, ...] | None = None
    tensor: int | None = None
    rank_timeout: float = 30.0
    blas: str = "auto"
    no_openblas: bool = False
    blas_gemv: bool = True
    blas_skinny: bool = True
    fused: bool = True
    fast_math: bool = True
    malloc_tune: bool = True
    build_kernels: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """The settings `env` gives; a bad value is an MlxlisError whose field is its name."""
        values = {}
        for var in VARS:
            raw = env.get(var.name)
            if raw is None or (raw == "" and var.empty_is_unset):
                continue
            try:
                values[var.field] = var.parse(raw)
            except MlxlisError:
                raise
            except ValueError as e:
                raise ConfigError(str(e), field=var.name) from None
        return cls(**values)


_current: Settings | None = None


def settings() -> Settings:
    """The process's settings, read from its environment at the first call (and after reload)."""
    global _current
    if _current is None:
        _current = Settings.from_env(os.environ)
    return _current


def reload() -> None:
    """Read the environment again at the next `settings()`."""
    global _current
    _current = None
