"""Device and dtype policy, and the CPU BLAS.

Metal -> float16 (fast, and reductions upcast), CUDA -> bfloat16, CPU -> float32
(MLX's CPU float16 matmul is emulated and ~30x slower; float32 goes through BLAS).

On Linux the mlx[cpu] wheel resolves BLAS symbols at load time; a system OpenBLAS loaded with
RTLD_GLOBAL *before* mlx.core is imported takes precedence over the slow bundled reference BLAS
(measured: 1024² fp32 matmul 0.26 s -> 0.009 s on a 2-core x86 machine). Matrix-vector
products (decoding) additionally go through sgemv via the small compiled dispatch in
_blas_dispatch.c when it was built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_BLAS_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblasp-r0.so",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

blas_in_use: str = "platform default"
gemv_dispatch: ctypes.CDLL | None = None  # mlxlis/_blas_dispatch.c, when built and loaded


def preload_blas() -> str:
    """Load a system OpenBLAS globally (Linux only, before mlx.core). Returns a description.

    With the compiled gemv dispatch (built at install when a C compiler is present), it is
    loaded globally first so that MLX's cblas_sgemm resolves to it; it sends matrix-vector
    products to OpenBLAS's sgemv (1.75x decode on a 135M model here) and the rest to sgemm.
    MLXLIS_BLAS_GEMV=0 leaves it out.
    """
    global blas_in_use, gemv_dispatch
    if not sys.platform.startswith("linux") or os.environ.get("MLXLIS_NO_OPENBLAS"):
        blas_in_use = "Accelerate (macOS)" if sys.platform == "darwin" else "bundled"
        return blas_in_use
    if "mlx.core" in sys.modules:
        blas_in_use = "bundled (mlx.core was imported before mlxlis; OpenBLAS not preloaded)"
        return blas_in_use
    found = ctypes.util.find_library("openblas")
    for name in ((found,) if found else ()) + _BLAS_CANDIDATES:
        try:
            blas = ctypes.CDLL(name)  # local first: the dispatch must come before it globally
        except OSError:
            continue
        gemv_dispatch = _load_gemv_dispatch(blas)
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)  # promotes the loaded library to global
        blas_in_use = f"OpenBLAS ({name})" + (" + gemv dispatch" if gemv_dispatch else "")
        return blas_in_use
    blas_in_use = "bundled reference BLAS (install libopenblas0 for ~30x faster CPU matmul)"
    return blas_in_use


def _load_gemv_dispatch(blas: ctypes.CDLL) -> ctypes.CDLL | None:
    if os.environ.get("MLXLIS_BLAS_GEMV", "1") == "0":
        return None
    from importlib.machinery import EXTENSION_SUFFIXES
    from pathlib import Path

    here = Path(__file__).parent
    for suffix in EXTENSION_SUFFIXES:
        path = here / f"_blas_dispatch{suffix}"
        if not path.is_file():
            continue
        try:
            sgemm, sgemv = blas.cblas_sgemm, blas.cblas_sgemv
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            lib.mlxlis_gemv_calls.restype = ctypes.c_long
            as_ptr = ctypes.c_void_p
            lib.mlxlis_blas_init(ctypes.cast(sgemm, as_ptr), ctypes.cast(sgemv, as_ptr))
        except (OSError, AttributeError):  # not built for this platform, or a stale build
            return None
        return lib
    return None


def tune_malloc() -> bool:
    """glibc: serve allocations up to 32 MiB from the heap and return the heap's free top to
    the kernel only past 256 MiB, instead of mapping fresh pages for each large buffer and
    unmapping them on free.

    MLX's compiled CPU kernels allocate their (B, T, ·) outputs anew on every call; with glibc's
    defaults each one was new memory from the kernel: 14 000 page faults per call on a 4M-element
    exp, half its time, on this (virtual) machine. The price: freed buffers stay in the process
    for reuse (what is freed below a live allocation is never returned). Peak memory is
    unchanged in the loads measured. MLXLIS_MALLOC_TUNE=0 leaves glibc's defaults.
    """
    if not sys.platform.startswith("linux") or os.environ.get("MLXLIS_MALLOC_TUNE") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    mapped = mallopt(m_mmap_threshold, 32 << 20)
    trimmed = mallopt(m_trim_threshold, 256 << 20)
    return bool(mapped and trimmed)


def device_name() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    if dev.type == mx.gpu:
        return "cuda" if _is_cuda() else "metal"
    return "cpu"


def _is_cuda() -> bool:
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


DTYPES = ("float32", "float16", "bfloat16")


def default_dtype_name() -> str:
    return {"metal": "float16", "cuda": "bfloat16", "cpu": "float32"}[device_name()]


def resolve_dtype(name: str | None):
    """mx.Dtype for a name ('float16', 'fp16', 'bf16', ...) or the device default for None."""
    import mlx.core as mx

    from .errors import UnsupportedError

    aliases = {
        "fp32": "float32",
        "f32": "float32",
        "fp16": "float16",
        "f16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
    }
    name = aliases.get(name, name) if name else default_dtype_name()
    if name not in DTYPES:
        raise UnsupportedError(
            f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})", field="dtype"
        )
    return getattr(mx, name)


def proc_bytes(path: str, key: str) -> int | None:
    """A "Key:  N kB" line of a Linux /proc file (meminfo, self/status) in bytes, else None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory_bytes() -> int:
    """Peak MLX memory (device allocator) or the process peak RSS, whichever is larger."""
    import resource

    import mlx.core as mx

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = rss if sys.platform == "darwin" else rss * 1024
    try:
        return max(int(mx.get_peak_memory()), rss)
    except AttributeError:
        return rss
