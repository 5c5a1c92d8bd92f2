"""Which BLAS MLX's Linux CPU backend calls, chosen before mlx.core is imported.

The mlx[cpu] wheel links a bundled reference BLAS (a 1024² float32 matmul: 0.26 s here, 30x
slower than OpenBLAS). Two faster ones can take its place:

- `scipy-openblas32` (a Linux dependency of mlxlis, so every install has it): OpenBLAS as a
  wheel, with its symbols renamed `scipy_cblas_*`. Loading it is not enough, since MLX asks
  for `cblas_sgemm`; the small compiled dispatch (`_blas_dispatch.c`, built at install when a
  C compiler is present) defines `cblas_sgemm`, is loaded globally before mlx.core, and
  forwards to the wheel's sgemm (and sends matrix-vector products to its sgemv).
- a system OpenBLAS (`apt-get install libopenblas0-pthread`): loaded globally, its own
  `cblas_sgemm` takes precedence; with the dispatch in front, matrix-vector products go to its
  sgemv (OpenBLAS before 0.3.27 packs the whole weight matrix for them in sgemm).

`MLXLIS_BLAS=auto|wheel|system|bundled` chooses; auto takes a system OpenBLAS of at least
`SYSTEM_PREFERRED` when one is installed, else the wheel (measured on a 2-core x86 machine,
`scripts/blas_table.py`: the system 0.3.21 decoded the catalog models 6-15% faster than the
wheel's 0.3.34, prefill equal within noise; see docs/performance.md).
`MLXLIS_BLAS_GEMV=0` keeps matrix-vector products in sgemm (and turns the dispatch off);
`MLXLIS_BLAS_SKINNY=0` keeps the products of 2..16 rows by a weight matrix (a batched decoding
step) in sgemm instead of the dispatch's own AVX2 kernel (`_skinny_gemm.c`).
Without a C compiler the wheel cannot be routed: a system OpenBLAS still can, else MLX runs its
bundled BLAS, slower, and `describe()` says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mlxlis.errors import MlxlisError
from mlxlis.settings import Settings, settings

SYSTEM_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblasp-r0.so",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
SYSTEM_PREFERRED = (0, 3, 21)  # a system OpenBLAS this recent decoded faster than the wheel


@dataclass
class BlasState:
    name: str = "platform default"  # what MLX's float32 matmuls run on, in words
    dispatch: ctypes.CDLL | None = None  # the loaded _blas_dispatch, when it routes
    notice: str | None = None  # why a faster path is not in use, for --verbose
    env: Settings = field(default_factory=Settings)  # the variables it was chosen under


state = BlasState()


def preload() -> BlasState:
    """Choose and load the BLAS (Linux only; must run before mlx.core is imported)."""
    if not sys.platform.startswith("linux"):
        state.name = "Accelerate (macOS)" if sys.platform == "darwin" else "platform default"
        return state
    if "mlx.core" in sys.modules:
        state.name = "bundled reference BLAS"
        state.notice = "mlx.core was imported before mlxlis, so no faster BLAS could be loaded"
        return state
    # OpenBLAS's threads busy-wait 2^28 cycles (~0.1 s) after each product by default, so
    # between a decoding step's few dense products they held a core the CPU kernels'
    # threads needed (runtime/kernels): with 2^4, Gemma 3 270M decoded 17.6 -> 25.7 tok/s and
    # Qwen2.5-0.5B 11.5 -> 15.8 on a 2-core x86 VM, prefill unchanged (scripts/bench_qmv.py)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        state.env = settings()
    except MlxlisError as e:  # raised again, where it can be reported, by the next settings()
        state.notice = f"{e}; the BLAS is chosen as if no mlxlis variable were set"
    env = state.env
    choice = "bundled" if env.no_openblas else env.blas  # older spelling of MLXLIS_BLAS=bundled
    misses: list[str] = []
    if choice == "auto":
        loaded = (
            _load_system(misses, SYSTEM_PREFERRED) or _load_wheel(misses) or _load_system(misses)
        )
    elif choice == "bundled":
        loaded = False
    else:
        loaded = _load_wheel(misses) if choice == "wheel" else _load_system(misses)
    if loaded:
        return state
    state.name = "bundled reference BLAS"
    if choice != "bundled":
        slow = "; ".join(misses) + " — CPU matmuls run on MLX's slow bundled BLAS"
        state.notice = f"{state.notice}; {slow}" if state.notice else slow
    return state


def _load_wheel(misses: list[str]) -> bool:
    lib_path = _wheel_library()
    if lib_path is None:
        misses.append("scipy-openblas32 is not installed")
        return False
    dispatch = _dispatch_library()
    if dispatch is None:
        misses.append(
            "the BLAS dispatch was not built (no C compiler at install), so the "
            "scipy-openblas32 wheel cannot be routed"
        )
        return False
    try:
        blas = ctypes.CDLL(str(lib_path))
        sgemm, sgemv = blas.scipy_cblas_sgemm, blas.scipy_cblas_sgemv
    except (OSError, AttributeError) as e:
        misses.append(f"scipy-openblas32 did not load ({e})")
        return False
    gemv = _gemv_wanted()
    if not _init_dispatch(dispatch, sgemm, sgemv if gemv else None):
        misses.append("the BLAS dispatch did not load (a stale build?)")
        return False
    state.name = f"OpenBLAS {_wheel_version()} (scipy-openblas32 wheel)" + _routes(gemv)
    return True


def _load_system(misses: list[str], at_least: tuple[int, ...] = ()) -> bool:
    found = ctypes.util.find_library("openblas")
    for name in ((found,) if found else ()) + SYSTEM_CANDIDATES:
        try:
            blas = ctypes.CDLL(name)  # local first: the dispatch must come before it globally
        except OSError:
            continue
        version = _openblas_version(blas)
        if version < at_least:
            misses.append(
                f"system OpenBLAS {_dotted(version)} is not known to be at least "
                f"{_dotted(at_least)}"
            )
            return False
        routed = False
        dispatch = _dispatch_library()
        if dispatch is not None and _gemv_wanted():
            try:
                routed = _init_dispatch(dispatch, blas.cblas_sgemm, blas.cblas_sgemv)
            except AttributeError:
                routed = False
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)  # promotes the loaded library to global
        state.name = f"system OpenBLAS {_dotted(version)} ({name})" + _routes(routed)
        return True
    if "no system OpenBLAS" not in misses:
        misses.append("no system OpenBLAS")
    return False


def _routes(routed: bool) -> str:
    """What the dispatch adds to the BLAS's name."""
    if not routed:
        return ""
    return " + gemv dispatch" + (" + batch kernel" if state.dispatch.mlxlis_skinny_on() else "")


def _gemv_wanted() -> bool:
    return state.env.blas_gemv


def _openblas_version(lib: ctypes.CDLL) -> tuple[int, ...]:
    """(0, 3, 21) from openblas_get_config() ("OpenBLAS 0.3.21 DYNAMIC_ARCH ..."), else ()."""
    try:
        lib.openblas_get_config.restype = ctypes.c_char_p
        words = lib.openblas_get_config().decode("ascii", "replace").split()
        return tuple(int(p) for p in words[1].split(".")[:3])
    except (AttributeError, IndexError, ValueError, OSError):
        return ()


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version)) or "(version unknown)"


def _init_dispatch(lib: ctypes.CDLL, sgemm, sgemv) -> bool:
    """Hand the dispatch its sgemm (and sgemv, or None for no matrix-vector routing), then
    make its cblas_sgemm visible to mlx.core."""
    try:
        lib.mlxlis_gemv_calls.restype = ctypes.c_long
        as_ptr = ctypes.c_void_p
        lib.mlxlis_skinny_calls.restype = ctypes.c_long
        lib.mlxlis_blas_init(
            ctypes.cast(sgemm, as_ptr),
            ctypes.cast(sgemv, as_ptr) if sgemv else None,
            ctypes.c_int(state.env.blas_skinny),
        )
        ctypes.CDLL(lib._name, mode=ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return False
    state.dispatch = lib
    return True


def _dispatch_library() -> ctypes.CDLL | None:
    from importlib.machinery import EXTENSION_SUFFIXES

    here = Path(__file__).parent
    for suffix in EXTENSION_SUFFIXES:
        path = here / f"_blas_dispatch{suffix}"
        if path.is_file():
            try:
                return ctypes.CDLL(str(path))  # local until initialised
            except OSError:
                return None
    return None


def _wheel_library() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libscipy_openblas.so"
    return lib if lib.is_file() else None


def _wheel_version() -> str:
    try:
        from importlib.metadata import version

        return ".".join(version("scipy-openblas32").split(".")[:3])
    except Exception:  # noqa: BLE001 — only a label
        return ""
