"""CPU quantized products that read GGUF blocks as they are stored: a custom MLX primitive
(src/: the affine layout's x @ wᵀ, AVX-512 integer dot products, AVX2/FMA or NEON, threaded
over rows, each weight read once per call for a few input rows; more rows (a prompt, a large
batch) dequantize w a block at a time into cache for AVX-512's own register-tiled product, or
elsewhere a tile at a time into BLAS sgemm),
built against the installed mlx (build.py) and loaded on first use.

`matmul` is what quantized layers call on the CPU; it falls back to MLX's own
`mx.quantized_matmul` wherever the kernel does not apply (another device, a mode or bit width
it lacks, the kernel not built). Measured on a 2-core x86 VM: see scripts/bench_qmv.py.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from mlxlis.runtime.device import on_cpu

import mlx.core as mx

BITS = (2, 3, 4, 5, 6, 8)
MAX_PRODUCTS = 4  # products of one x a node takes (src/compute.h kMaxProducts)
GROUPS = (16, 32, 64, 128)  # 16: Q6_K's sub-blocks (MLX's own products take 32+)

_module: ModuleType | None = None
_why = "not loaded yet"
_failed = False  # a build failed in this process
_probed = False  # available() looked for a build once


def load(build: bool = True, retry: bool = False) -> ModuleType | None:
    """The extension, built first when missing and `build`; None (and `why()`) when it cannot
    be had here (a failed build is not tried again in this process, nor for the same mlx and
    sources in another, unless `retry`)."""
    global _module, _why, _failed
    if _module is not None or not sys.platform.startswith("linux"):
        if _module is None:
            _why = "not used on this platform"
        return _module
    if _failed and not retry:
        return None
    from mlxlis.runtime.kernels.build import BuildError, ensure, so_path

    try:
        path = ensure(retry=retry) if build else so_path()
        if not path.is_file():
            _why = "not built (python -m mlxlis.runtime.kernels builds it)"
            return None
        spec = importlib.util.spec_from_file_location("_qmv", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (BuildError, ImportError, OSError) as e:
        _why, _failed = str(e), build
        return None
    if mod.isa() != "scalar" and not _agrees_with_scalar(mod):
        mod.set_isa("scalar")  # wrong results are never an option: the portable kernels
        _why = f"the {mod.isa()} kernels disagreed with the scalar ones here"
    _module = mod
    return mod


def available() -> ModuleType | None:
    """The extension when it is built (loaded at the first call; never builds: the fused
    operations of runtime/nodes.py use it only where a build exists)."""
    global _probed
    if _module is None and not _probed:
        _probed = True
        load(build=False)
    return _module


def _agrees_with_scalar(mod: ModuleType) -> bool:
    """The CPU's own kernels (AVX-512, AVX2, or NEON, which this project's CI cannot run)
    give the scalar kernels' results on a small random problem of every width, a decode's
    rows and a prompt's: checked once a process."""
    import numpy as np

    rng = np.random.default_rng(0)
    isa = mod.isa()
    for bits, group, m in [(b, g, m) for b in BITS for g in (16, 32) for m in (3, 20)]:
        x = rng.standard_normal((m, 128)).astype(np.float32)
        wq = rng.integers(0, 2**32, (37, 128 * bits // 32), dtype=np.uint32)
        s, b = (rng.standard_normal((37, 128 // group)).astype(np.float32) for _ in range(2))
        fast = mod.qmv_numpy(x, wq, s, b, group, bits)
        mod.set_isa("scalar")
        slow = mod.qmv_numpy(x, wq, s, b, group, bits)
        mod.set_isa(isa)
        scale = np.abs(x).sum(1, keepdims=True) * (2**bits) * 4  # Σ|w||x| bound, roughly
        if not (np.abs(fast - slow) <= 1e-5 * scale).all():
            return False
    return True


def why() -> str:
    return _why


def describe(build: bool = False) -> str:
    """Which kernels run quantized products on the CPU, in words (`build`: build them now,
    trying again after an earlier failure)."""
    mod = load(build, retry=build)
    if mod is None:
        return f"MLX's own (the mlxlis kernels: {_why})"
    prompts = {
        "own": "their own product",
        "sgemm": "dequantized tiles into sgemm",
        "decode": "the decode kernels",
    }[mod.prompt_route()]
    return f"mlxlis qmv ({mod.isa()}, {mod.num_threads()} threads; prompts: {prompts})"


def applies(
    bits: int, group_size: int, mode: str = "affine", device: mx.Device | None = None
) -> bool:
    """Whether `matmul` runs this layout through the kernel (once loaded): only for a product
    on the CPU (`device`: the one it runs on, default the current stream's); a GPU product is
    always MLX's own `mx.quantized_matmul`, on the blocks in MLX's layout."""
    return mode == "affine" and bits in BITS and group_size in GROUPS and on_cpu(device)


def matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    supers: mx.array | None = None,
) -> mx.array:
    """x @ wᵀ for w quantized (MLX's layout), in x's dtype. Affine without biases: a symmetric
    format held for these kernels only (Q6_K), bias −2^(bits−1)·scale.
    `supers` (N, K/256, 2) float16: a super-block format held for these kernels only (GGUF's
    K-quants as stored: integer scales sc and mins m, the group's scale d·sc, bias −dmin·m)."""
    if applies(bits, group_size, mode) and (mod := load()) is not None:
        return mod.qmv(x, w, scales, biases, group_size, bits, supers).astype(x.dtype)
    if supers is not None:  # another device: MLX's product on the float scales and biases
        scales, biases = super_scales_as_float(scales, biases, supers, group_size)
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode
    )


def super_scales_as_float(
    scales: mx.array, biases: mx.array | None, supers: mx.array, group_size: int
) -> tuple[mx.array, mx.array | None]:
    """A super-block format's float32 scales d·sc and biases −dmin·m, (N, K/group) each
    (biases None where none are held)."""
    per = 256 // group_size  # groups a super-block
    pair = mx.repeat(supers.astype(mx.float32), per, axis=1)  # (N, K/group, 2)
    s = pair[..., 0] * scales.astype(mx.float32)
    b = None if biases is None else -(pair[..., 1] * biases.astype(mx.float32))
    return s, b
