"""How much memory mlxlis may fill: `MLXLIS_MAX_MEMORY` (e.g. 24G, 512M) when set, else the
GPU's recommended working set (Metal) or the memory available to a new allocation (Linux
MemAvailable; physical RAM where the kernel does not say); and, on Metal, the wired limit set
as mlx-lm does so that a large model's buffers are not paged out under pressure."""

from __future__ import annotations

import os
import re

from mlxlis.errors import ConfigError
from mlxlis.runtime.device import device_name, proc_bytes

import mlx.core as mx

ENV = "MLXLIS_MAX_MEMORY"


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux MemAvailable), else physical RAM."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def parse_bytes(text: str, field: str) -> int:
    """'24G', '512M', '1.5G', '1000000' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", text.upper())
    if not m:
        raise ConfigError(f"expected a size such as 24G or 512M, got {text!r}", field=field)
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _working_set() -> int:
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return int(info.get("max_recommended_working_set_size", 0))


def memory_budget() -> int:
    """Bytes this process may fill in all (what MLX holds already included): MLXLIS_MAX_MEMORY
    caps what the machine offers — Metal's working set, or what is free plus what MLX holds."""
    offered = _working_set() if device_name() == "metal" else 0
    offered = offered or available_memory() + mx.get_active_memory()
    raw = os.environ.get(ENV)
    return min(offered, parse_bytes(raw, ENV)) if raw else offered


def wire(nbytes: int) -> None:
    """Metal: keep up to `nbytes` (the weights and caches in use) wired, within the working set,
    as mlx-lm does for models near the working set's size; nothing elsewhere."""
    if device_name() != "metal":
        return
    limit = _working_set()
    if limit:
        mx.set_wired_limit(min(nbytes, limit))
