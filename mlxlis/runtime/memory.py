"""How much memory mlxlis may fill: `MLXLIS_MAX_MEMORY` (e.g. 24G, 512M) when set, else what the
device offers — Metal's recommended working set, a CUDA GPU's free memory (MLX's
`device_info`: NVML's system-wide figure, or CUDA's own) plus what MLX holds there already, or
on the CPU the memory available to a new allocation (Linux MemAvailable; physical RAM where
the kernel does not say); and, on Metal, the wired limit set as mlx-lm does so that a large
model's buffers are not paged out under pressure."""

from __future__ import annotations

import os
from collections.abc import Mapping

from mlxlis.runtime.device import device_name, proc_bytes
from mlxlis.settings import settings

import mlx.core as mx


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux MemAvailable), else physical RAM."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _gpu_info() -> Mapping[str, object]:
    return mx.device_info(mx.gpu) if hasattr(mx, "device_info") else mx.metal.device_info()


def _working_set() -> int:
    return int(_gpu_info().get("max_recommended_working_set_size", 0))


def offered(device: str, info: Mapping[str, object], host_available: int, active: int) -> int:
    """Bytes the machine offers to `device` ("metal", "cuda", "cpu"), given MLX's device info
    for its GPU, the host's available memory and what MLX holds (`active`): Metal's working
    set; CUDA's free memory plus `active` (free memory excludes what this process holds);
    else, or where the GPU does not say, the host's available memory plus `active`."""
    if device == "metal" and int(info.get("max_recommended_working_set_size", 0)):
        return int(info["max_recommended_working_set_size"])
    if device == "cuda" and "free_memory" in info:
        return int(info["free_memory"]) + active
    return host_available + active


def memory_budget() -> int:
    """Bytes this process may fill in all (what MLX holds already included): MLXLIS_MAX_MEMORY
    caps what the machine offers (`offered`)."""
    dev = device_name()
    info = _gpu_info() if dev != "cpu" else {}
    total = offered(dev, info, available_memory(), mx.get_active_memory())
    cap = settings().max_memory
    return total if cap is None else min(total, cap)


def wire(nbytes: int) -> None:
    """Metal: keep up to `nbytes` (the weights and caches in use) wired, within the working set,
    as mlx-lm does for models near the working set's size; nothing elsewhere."""
    if device_name() != "metal":
        return
    limit = _working_set()
    if limit:
        mx.set_wired_limit(min(nbytes, limit))
