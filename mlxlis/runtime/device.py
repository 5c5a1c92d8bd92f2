"""Device and dtype policy, and the process-wide settings an application opts into.

The device: the GPU when MLX has one that works (Metal on macOS, CUDA on Linux with the
`mlxlis[cuda]` install), else the CPU; `MLXLIS_DEVICE=cpu|gpu` overrides, and `gpu` where MLX
reports none is refused by name. GitHub's macOS runners, for one, may expose no usable Metal
device. The dtype: Metal -> float16 (fast, and reductions upcast; seeds/003 L-5), CUDA ->
bfloat16 (float32's exponent range, so no residual stream overflows, e.g. Gemma's 1.04e5, at
float16's tensor-core speed on the NVIDIA parts MLX's CUDA backend targets), CPU -> float32
(MLX's CPU float16 matmul is emulated and ~30x slower; float32 goes through BLAS, see blas.py).
`policy` is that decision as a pure function of what MLX reports and the variable; the CPU-only
pieces (the BLAS routing's products, runtime/kernels, the fused nodes, fastmath) ask `on_cpu`
of the device their operation runs on, never of the platform.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

from mlxlis.settings import settings


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
    if not sys.platform.startswith("linux") or not settings().malloc_tune:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    mapped = mallopt(m_mmap_threshold, 32 << 20)
    trimmed = mallopt(m_trim_threshold, 256 << 20)
    return bool(mapped and trimmed)


def trim_malloc() -> bool:
    """glibc: give the free pages of every heap back to the kernel now (after a model is
    unloaded: its buffers below the trim threshold stay in the process otherwise)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


def setup_process() -> None:
    """What the mlxlis commands (the CLI and the chat app) set for their own process: the
    allocator tuning below. A library user may call it too; `import mlxlis` changes nothing
    process-wide apart from choosing the BLAS (blas.py)."""
    tune_malloc()


DEFAULT_DTYPE = {"metal": "float16", "cuda": "bfloat16", "cpu": "float32"}


@dataclass(frozen=True)
class Policy:
    """What runs: `device` "cpu", "metal" or "cuda", its default `dtype`, and whether the
    CPU-only pieces (BLAS routing, runtime/kernels, fused nodes, fastmath) take part."""

    device: str
    dtype: str
    cpu_kernels: bool


def policy(gpu: str | None, want: str | None) -> Policy:
    """The device and dtype for the GPU MLX reports (`gpu`: "metal", "cuda" or None) and
    MLXLIS_DEVICE (`want`: None, "cpu" or "gpu")."""
    from mlxlis.errors import UnsupportedError

    if want == "gpu" and gpu is None:
        raise UnsupportedError(
            "MLXLIS_DEVICE=gpu but MLX reports no usable GPU here (on Linux + NVIDIA: "
            "pip install 'mlxlis[cuda]')",
            field="MLXLIS_DEVICE",
        )
    use = "cpu" if want == "cpu" or gpu is None else gpu
    return Policy(use, DEFAULT_DTYPE[use], use == "cpu")


def gpu_kind() -> str | None:
    """The GPU MLX can run on here: "metal", "cuda", or None."""
    import mlx.core as mx

    try:
        return "metal" if mx.metal.is_available() else "cuda" if _is_cuda() else None
    except Exception:  # noqa: BLE001 — a backend that cannot answer has no usable GPU
        return None


def gpu_available() -> bool:
    return gpu_kind() is not None


def select_device() -> str:
    """Make MLX's default device the one `policy` picks ("gpu" or "cpu") and return it."""
    import mlx.core as mx

    chosen = policy(gpu_kind(), settings().device)  # a bad MLXLIS_DEVICE is refused there
    mx.set_default_device(mx.cpu if chosen.device == "cpu" else mx.gpu)
    return "cpu" if chosen.device == "cpu" else "gpu"


def device_name() -> str:
    """The device MLX's operations run on now (its default stream's): cpu, metal or cuda."""

    if on_cpu():
        return "cpu"
    return "cuda" if _is_cuda() else "metal"


def on_cpu(device=None) -> bool:
    """Whether an operation on `device` (an mx.Device; default: the device of the stream
    operations run on now, which `with mx.stream(...)` changes) runs on the CPU."""
    import mlx.core as mx

    return (device or mx.default_device()).type == mx.cpu


def _is_cuda() -> bool:
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


DTYPES = ("float32", "float16", "bfloat16")


def default_dtype_name() -> str:
    return DEFAULT_DTYPE[device_name()]


def resolve_dtype(name: str | None):
    """mx.Dtype for a name ('float16', 'fp16', 'bf16', ...) or the device default for None."""
    from mlxlis.errors import UnsupportedError

    import mlx.core as mx

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
