"""How much memory mlxlis may fill: `MLXLIS_MAX_MEMORY` (e.g. 24G, 512M) when set, else the
GPU's recommended working set (Metal) or the memory available to a new allocation (Linux
MemAvailable; physical RAM where the kernel does not say); and, on Metal, the wired limit set
as mlx-lm does so that a large model's buffers are not paged out under pressure."""

from __future__ import annotations

import os

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


def _working_set() -> int:
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return int(info.get("max_recommended_working_set_size", 0))


def memory_budget() -> int:
    """Bytes this process may fill in all (what MLX holds already included): MLXLIS_MAX_MEMORY
    caps what the machine offers — Metal's working set, or what is free plus what MLX holds."""
    offered = _working_set() if device_name() == "metal" else 0
    offered = offered or available_memory() + mx.get_active_memory()
    cap = settings().max_memory
    return offered if cap is None else min(offered, cap)


def wire(nbytes: int) -> None:
    """Metal: keep up to `nbytes` (the weights and caches in use) wired, within the working set,
    as mlx-lm does for models near the working set's size; nothing elsewhere."""
    if device_name() != "metal":
        return
    limit = _working_set()
    if limit:
        mx.set_wired_limit(min(nbytes, limit))
