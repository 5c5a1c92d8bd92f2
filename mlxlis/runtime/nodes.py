"""RMSNorm, RoPE, attention and the gated activations as single CPU nodes
(runtime/kernels/src/fused*.cpp, built with the quantized kernels), for the per-token work around
the matrix products.

Why: MLX's CPU backend runs `mx.fast.rope` and `mx.fast.rms_norm` as chains of small
operations there, at ~7–13 µs each however small the data. Measured on a 2-core x86 VM for a
decode step's shapes: RoPE 134 µs → 6 µs, RMSNorm 52 → 6, the attention of one query over
130 keys 167 → 24, SwiGLU 79 → 13; SmolLM2-135M spent ~25 ms of a 35 ms step in such chains.
A prompt's chunk: MLX's products through BLAS with the softmax, mask and block concatenation
between them on one thread (~1.1 of 2 cores busy) against one node on all cores that keeps a
key block's scores at a time; Qwen2.5-0.5B's heads, 512 queries over 4096 keys: 1.1 s → 0.13 s.

Each function here takes MLX's own operation's arguments and returns None wherever the kernel
does not apply to them (a dtype other than float32, a mask that is not boolean) or is not
built: the CPU backend (runtime/backend.py, the only caller, chosen for the
CPU unless MLXLIS_FUSED=0) then runs MLX's operation. Results agree with MLX's within float32
rounding (the order of sums differs); RoPE's inverse frequencies are transformers' float32
formula, 1 / base^(2i/d)."""

from __future__ import annotations

from types import ModuleType

from mlxlis.runtime import kernels
from mlxlis.runtime.device import on_cpu

import mlx.core as mx

MAX_QUERIES = 16  # attention: more queries (a prompt's chunk) take the kernel's blocked form
PROMPTS = True  # prompt chunks' attention by the blocked kernel; False: MLX's (BLAS) products
ACTS = {"silu": 0, "gelu_tanh": 1}


def _kernels(*arrays: mx.array) -> ModuleType | None:
    """The extension when the operation runs on the CPU, every array is float32 and it is
    built, else None (a GPU stream runs MLX's operation whatever backend was chosen)."""
    if not on_cpu() or any(a.dtype != mx.float32 for a in arrays):
        return None
    return kernels.available()


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array | None:
    """mx.fast.rms_norm(x, weight, eps)."""
    if (k := _kernels(x, *([] if weight is None else [weight]))) is not None:
        return k.rms_norm(x, weight, eps)
    return None


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
) -> mx.array | None:
    """mx.fast.rope(x, …): x (B, heads, T, head_dim), from `offset` (an int, or one per row).
    `heads_last`: x is (B, T, heads, head_dim), as the projections give it; the result is
    still (B, heads, T, head_dim) (the kernel transposes as it turns: no node for it)."""
    fit = x.ndim == 4 and (freqs is None) != (base is None)
    if fit and (k := _kernels(x, *([] if freqs is None else [freqs]))) is not None:
        many = isinstance(offset, mx.array)
        return k.rope(
            x,
            dims,
            traditional,
            0.0 if base is None else base,
            scale,
            0 if many else offset,
            offset.reshape(-1) if many else None,
            freqs,
            x.shape[2] if heads_last else 0,
        )
    return None


def attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: str | mx.array | None,
    heads_last: bool = False,
) -> mx.array | None:
    """softmax((q·scale)·kᵀ, masked)·v (q (B, H, T, D), k and v (B, Hkv, S, ·), `mask`
    "causal" aligned to the newest keys, or boolean broadcasting to (B, 1, T, S)): (B, H, T,
    Dv), or (B, T, H·Dv) if `heads_last`. Up to MAX_QUERIES queries (a decode step, a
    verification) one query at a time; more (a prompt's chunk, unless PROMPTS is off) in
    blocks of queries against blocks of keys with a streaming softmax, on all cores."""
    if q.shape[2] > MAX_QUERIES and not PROMPTS:
        return None
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        return None
    if (kern := _kernels(q, k, v)) is None:
        return None
    causal = isinstance(mask, str)
    return kern.attend(q, k, v, scale, causal, None if causal else mask, heads_last)


def gated(act: str, gate: mx.array, up: mx.array) -> mx.array | None:
    """act(gate)·up for `act` in ACTS, or None where the kernel does not apply."""
    if gate.shape != up.shape or (k := _kernels(gate, up)) is None:
        return None
    return k.gated(gate, up, ACTS[act])
