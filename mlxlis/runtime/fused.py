"""The operations model code calls around the matrix products, each forwarded to the backend
chosen once for the device and settings (runtime/backend.py): on the CPU, mlxlis's single C++
nodes (runtime/nodes.py) and compiled kernels (runtime/fastmath.py); elsewhere, or with both
turned off (MLXLIS_FUSED=0, MLXLIS_FAST_MATH=0), MLX's own operations."""

from __future__ import annotations

from mlxlis.runtime.backend import current

import mlx.core as mx


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """mx.fast.rms_norm(x, weight, eps)."""
    return current().rms_norm(x, weight, eps)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    heads_last: bool = False,
) -> mx.array:
    """mx.fast.rope(x, …): x (B, heads, T, head_dim), from `offset` (an int, or one per row).
    `heads_last`: x is (B, T, heads, head_dim), as the projections give it; the result is
    still (B, heads, T, head_dim)."""
    return current().rope(
        x,
        dims,
        traditional=traditional,
        base=base,
        scale=scale,
        offset=offset,
        freqs=freqs,
        heads_last=heads_last,
    )


def attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: str | mx.array | None,
    heads_last: bool = False,
) -> mx.array | None:
    """One node for the attention of a few queries (runtime/nodes.py's `attend`), or None where
    the backend has none for these inputs (the caller computes it)."""
    return current().attend(q, k, v, scale, mask, heads_last)


def gated(act: str, gate: mx.array, up: mx.array) -> mx.array:
    """act(gate)·up for `act` "silu" or "gelu_tanh"."""
    return current().gated(act, gate, up)


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, x·(1 + erf(x/√2))/2: nn.gelu, or fastmath's compiled erf on the CPU."""
    return current().gelu(x)
