"""The operations model code runs around the matrix products (RMSNorm, RoPE, attention, the
gated activations, exact GELU, the attention's softmax), behind one seam chosen once.

`select(device, settings)` picks the backend when a model is loaded (api.load, the warm-up);
`current()` is the one chosen, picked on first use from the device and settings of that moment
for code that runs a network without loading one (the tests, the scripts). Model code calls
runtime/fused.py's functions, which forward to it, and reads `current()` itself (attention).

- `MLX`: MLX's own operations. Metal and CUDA (fast there), and the CPU with both of the
  variables below off.
- `CPU`: runtime/nodes.py's single C++ nodes (unless MLXLIS_FUSED=0) and fastmath's compiled
  exp/softmax/GLUs (unless MLXLIS_FAST_MATH=0, or MLX cannot compile here). A node falls back
  per call only for what it cannot take (a dtype other than float32, a non-boolean mask; a
  prompt's queries while nodes.PROMPTS is off), or while the kernels are not built: a
  quantized load builds them after this choice, so `kernels.available()` is asked per call
  (a module global once probed).
"""

from __future__ import annotations

from typing import Protocol

from mlxlis.runtime import fastmath, nodes
from mlxlis.runtime.device import device_name, on_cpu
from mlxlis.settings import Settings, settings

import mlx.core as mx
import mlx.nn as nn


class Backend(Protocol):
    name: str
    # softmax is fastmath's: attention computes its scores explicitly (in query blocks for a
    # prompt) instead of calling MLX's fused attention, whose CPU softmax is ~4x slower
    fast_math: bool

    def rms_norm(self, x: mx.array, weight: mx.array | None, eps: float) -> mx.array: ...

    def rope(
        self,
        x: mx.array,
        dims: int,
        *,
        traditional: bool,
        base: float | None,
        scale: float,
        offset: int | mx.array,
        freqs: mx.array | None = None,
        heads_last: bool = False,
    ) -> mx.array: ...

    def attend(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        mask: str | mx.array | None,
        heads_last: bool = False,
    ) -> mx.array | None: ...

    def gated(self, act: str, gate: mx.array, up: mx.array) -> mx.array: ...

    def gelu(self, x: mx.array) -> mx.array: ...

    def softmax(self, x: mx.array) -> mx.array: ...


PLAIN_GATED = {"silu": lambda g, u: nn.silu(g) * u, "gelu_tanh": lambda g, u: nn.gelu_approx(g) * u}
FAST_GATED = {"silu": fastmath.swiglu, "gelu_tanh": fastmath.geglu_tanh}


class MLX:
    """MLX's own operations."""

    name = "mlx"
    fast_math = False

    def rms_norm(self, x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
        return mx.fast.rms_norm(x, weight, eps)

    def rope(self, x, dims, *, traditional, base, scale, offset, freqs=None, heads_last=False):
        if heads_last:
            x = x.transpose(0, 2, 1, 3)
        return mx.fast.rope(
            x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
        )

    def attend(self, q, k, v, scale, mask, heads_last=False) -> mx.array | None:
        return None  # the caller's MLX operations

    def gated(self, act: str, gate: mx.array, up: mx.array) -> mx.array:
        return PLAIN_GATED[act](gate, up)

    def gelu(self, x: mx.array) -> mx.array:
        return nn.gelu(x)

    def softmax(self, x: mx.array) -> mx.array:
        return mx.softmax(x, axis=-1, precise=True)


class CPU(MLX):
    """The C++ nodes where `nodes` and the input fits, fastmath's kernels where `fast_math`,
    else MLX's operations; each only for an operation on the CPU (a GPU stream, e.g. under
    `with mx.stream(mx.gpu)`, gets MLX's operations: nodes.py and `_fast` ask its device)."""

    def __init__(self, nodes: bool, fast_math: bool):
        self.nodes, self.fast_math = nodes, fast_math
        self.name = "+".join(n for n, on in (("fused", nodes), ("fastmath", fast_math)) if on)

    def rms_norm(self, x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
        if self.nodes and (out := nodes.rms_norm(x, weight, eps)) is not None:
            return out
        return super().rms_norm(x, weight, eps)

    def rope(self, x, dims, *, traditional, base, scale, offset, freqs=None, heads_last=False):
        args = dict(traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
        if self.nodes and (out := nodes.rope(x, dims, **args, heads_last=heads_last)) is not None:
            return out
        return super().rope(x, dims, **args, heads_last=heads_last)

    def attend(self, q, k, v, scale, mask, heads_last=False) -> mx.array | None:
        return nodes.attend(q, k, v, scale, mask, heads_last) if self.nodes else None

    def gated(self, act: str, gate: mx.array, up: mx.array) -> mx.array:
        if self.nodes and (out := nodes.gated(act, gate, up)) is not None:
            return out
        return (FAST_GATED if self._fast() else PLAIN_GATED)[act](gate, up)

    def gelu(self, x: mx.array) -> mx.array:
        return fastmath.gelu(x) if self._fast() else super().gelu(x)

    def softmax(self, x: mx.array) -> mx.array:
        return fastmath.softmax(x) if self._fast() else super().softmax(x)

    def _fast(self) -> bool:
        return self.fast_math and on_cpu()


_chosen: Backend | None = None


def choose(device: str, env: Settings) -> Backend:
    """The backend for `device` ("cpu", "metal", "cuda") under `env`, chosen by nothing else:
    the CPU-only pieces only for "cpu" (device.policy's `cpu_kernels`)."""
    fast = env.fast_math and device == "cpu" and fastmath.compiles()
    if device != "cpu" or not (env.fused or fast):
        return MLX()
    return CPU(env.fused, fast)


def select(device: str | None = None, env: Settings | None = None) -> Backend:
    """Choose the backend for `device` (default: MLX's default device's) under `env` (default:
    the process's settings), for every later `current()`; returns it."""
    global _chosen
    _chosen = choose(device or device_name(), env or settings())
    return _chosen


def current() -> Backend:
    """The backend chosen by the last `select`, or chosen now for the device and settings."""
    return _chosen if _chosen is not None else select()


def reset() -> None:
    """Forget the choice: the next `current()` chooses again."""
    global _chosen
    _chosen = None
