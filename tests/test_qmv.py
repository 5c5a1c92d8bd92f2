"""The CPU quantized kernels (mlxlis/runtime/kernels) against independent references.

Reference: float64 numpy on the dequantized weights (the codes unpacked from MLX's packed
words in numpy, w = scale·q + bias in float64) times x. The bound, per output element, is the
classic one of a float32 dot product of length K, on the magnitudes of both terms of each
weight (the kernels sum scale·q·x and bias·x separately per group), plus K steps of 2⁻¹⁴⁹
(float32's absolute resolution among subnormals):

    |qmv − ref| ≤ K · 2⁻²⁴ · Σ_k (|scale·q_k| + |bias|) · |x_k| + K · 2⁻¹⁴⁹

Second reference: MLX's own `mx.quantized_matmul` on the same arrays, within twice the bound
(groups of 32 and more: MLX has no group of 16, which holds Q6_K's sub-blocks).
Every bit width × group size, shapes whose rows are not a multiple of a task or a tile, 1–16
input rows through the decode kernels (decode and the server's batched decode), prompt rows
(the prefill paths: the x86 kernels' own product, dequantized tiles into sgemm elsewhere),
threads 1–3, each instruction set this CPU runs, and a forked child.

The AVX-512 kernels multiply integers: each 4 consecutive x are written as 24-bit integers
under one power of two (an error of at most 2⁻²³ of the 4's largest |x|, about float32's own
rounding of it), the sums of code × integer are exact; the same bound holds for them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlxlis  # noqa: F401  (the BLAS routing first, as the engine runs)
from mlxlis.loading.binding import quantize_like
from mlxlis.models.quantized import Kernels, QuantizedLinear
from mlxlis.runtime import kernels

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"qmv not built: {kernels.why()}")
ISAS = [i for i in ("avx512", "avx2", "neon", "scalar") if ext is not None and ext.set_isa(i)]
if ext is not None:
    ext.set_isa("auto")
EPS32 = 2.0**-24


def unpack_codes(wq: np.ndarray, bits: int, k: int) -> np.ndarray:
    """(N, K) codes from MLX's packing: a row is one little-endian bit stream, code j at bit
    j·bits (numpy's own bit unpacking: no code shared with the kernels)."""
    n = wq.shape[0]
    as_bits = np.unpackbits(wq.view(np.uint8).reshape(n, -1), axis=1, bitorder="little")
    as_bits = as_bits[:, : k * bits].reshape(n, k, bits).astype(np.int64)
    return (as_bits << np.arange(bits)).sum(axis=2)


def make(n, k, bits, group, m, seed=0, sb_dtype=mx.float32):
    rng = np.random.default_rng(seed)
    if group == 16:  # MLX does not quantize to groups of 16 (Q6_K's): codes packed by numpy
        codes = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
        as_bits = np.unpackbits(codes[..., None], axis=2, bitorder="little")[..., :bits]
        packed = np.packbits(as_bits.reshape(n, -1), axis=1, bitorder="little")
        wq = mx.array(packed.view("<u4"))
        s = mx.array(rng.uniform(1e-3, 2e-2, (n, k // 16)).astype(np.float32))
        b = mx.array(-(2 ** (bits - 1)) * np.array(s))
    else:
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.1)
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    s, b = s.astype(sb_dtype), b.astype(sb_dtype)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    mx.eval(wq, s, b, x)
    return x, wq, s, b


def reference(x, wq, s, b, group, bits):
    """(float64 x @ wᵀ, its float32 rounding bound) per output element."""
    k = x.shape[-1]
    q = unpack_codes(np.array(wq), bits, k).astype(np.float64)
    scale = np.repeat(np.array(s.astype(mx.float32), np.float64), group, axis=1)
    bias = np.repeat(np.array(b.astype(mx.float32), np.float64), group, axis=1)
    xs = np.array(x, np.float64)
    mag = np.abs(xs) @ (np.abs(scale * q) + np.abs(bias)).T
    return xs @ (scale * q + bias).T, k * EPS32 * mag + k * 2.0**-149  # + subnormals' steps


def check(y, ref, bound, what=""):
    err = np.abs(np.array(y, np.float64) - ref)
    assert y.shape == ref.shape and (err <= bound).all(), f"{what}: {(err / bound).max():.3g}×"


def grid(bits, group, rows, threads):
    ext.set_prefill(17)  # rows up to 16 through the decode kernels on every ISA
    for isa in ISAS:
        assert ext.set_isa(isa)
        try:
            for i, (n, kb) in enumerate([(1, 32), (7, 64), (37, 96), (130, 256), (515, 384)]):
                k = max(group, kb // group * group)
                for m in rows:
                    for th in threads:
                        ext.set_num_threads(th)
                        x, wq, s, b = make(n, k, bits, group, m, seed=i * 100 + m)
                        y = ext.qmv(x, wq, s, b, group, bits)
                        ref, bound = reference(x, wq, s, b, group, bits)
                        what = f"{isa} N={n} K={k} M={m} bits={bits} g={group} threads={th}"
                        check(y, ref, bound, what)
                        if group == 16:  # Q6_K's: held without biases (−2^(bits−1)·scale);
                            y = ext.qmv(x, wq, s, None, group, bits)  # not MLX's group size
                            check(y, ref, bound, what + " no biases")
                            continue
                        theirs = mx.quantized_matmul(
                            x, wq, s, b, transpose=True, group_size=group, bits=bits
                        )
                        check(theirs, ref, 2 * bound, "mx.quantized_matmul " + what)
        finally:
            ext.set_isa("auto")
            ext.set_num_threads(0)
            ext.set_prefill()


@pytest.mark.parametrize("bits", kernels.BITS)
@pytest.mark.parametrize("group", kernels.GROUPS)
def test_every_width_and_group_matches_float64_and_mlx(bits, group):
    """Within the bound of float64 and of mx.quantized_matmul: rows 1, 7, 16, threads 1 and
    3, odd N, K not a multiple of 64 or 128 where the group allows."""
    grid(bits, group, rows=(1, 7, 16), threads=(1, 3))


@pytest.mark.extended
@pytest.mark.parametrize("bits", kernels.BITS)
@pytest.mark.parametrize("group", kernels.GROUPS)
def test_every_row_count_and_thread_count(bits, group):
    """The same, every row count 1–16 × threads 1–3 (make test-all)."""
    grid(bits, group, rows=range(1, 17), threads=(1, 2, 3))


@pytest.mark.parametrize("sb_dtype", [mx.float16, mx.bfloat16])
def test_half_precision_scales(sb_dtype):
    try:
        for isa in ISAS:
            assert ext.set_isa(isa)
            for bits, group, m in [
                (b, g, m) for b in (4, 5, 8) for g in kernels.GROUPS for m in (3, 17)
            ]:
                x, wq, s, b = make(301, 288 // group * group, bits, group, m, sb_dtype=sb_dtype)
                ref, bound = reference(x, wq, s, b, group, bits)
                y = ext.qmv(x, wq, s, b, group, bits)  # 17 rows: the prefill path
                check(y, ref, bound, f"{isa} {sb_dtype} {bits}-bit g={group} M={m}")
    finally:
        ext.set_isa("auto")


def test_x_of_any_magnitude():
    """Neighbours 40 orders of magnitude apart, zeros, subnormals and whole runs of them (the
    AVX-512 kernels write every 4 x as integers under one power of two): within the bound."""
    rng = np.random.default_rng(5)
    k = 160
    mag = 10.0 ** rng.integers(-20, 21, (4, k))
    xs = rng.standard_normal((4, k)) * mag
    xs[0, ::3] = 0.0
    xs[1, 1::4] = 1e-40  # subnormal in float32
    xs[2, 64:128] = 0.0  # a whole block
    xs[3, :] = 1e-41 * rng.standard_normal(k)
    x = mx.array(xs.astype(np.float32))
    try:
        for isa in ISAS:
            assert ext.set_isa(isa)
            for bits, group in [(4, 32), (6, 16), (8, 32), (5, 64)]:
                _, wq, s, b = make(37, k // group * group, bits, group, 1)
                xk = x[:, : k // group * group]
                ref, bound = reference(xk, wq, s, b, group, bits)
                check(ext.qmv(xk, wq, s, b, group, bits), ref, bound, f"{isa} {bits}-bit")
    finally:
        ext.set_isa("auto")


def test_inf_and_nan_in_x_come_out_as_in_float():
    """An inf or NaN in x gives a non-finite result wherever float64 does (the integer
    kernels cannot hold them as digits: they come through its lane's sum, the bias term);
    other rows of the same call stay within the bound."""
    x, wq, s, b = make(53, 128, 4, 32, 3)
    xs = np.array(x)
    xs[0, 5], xs[1, 77] = np.inf, np.nan
    x = mx.array(xs)
    with np.errstate(invalid="ignore"):
        ref, bound = reference(x, wq, s, b, 32, 4)
    try:
        for isa in ISAS:
            assert ext.set_isa(isa)
            y = np.array(ext.qmv(x, wq, s, b, 32, 4), np.float64)
            assert (np.isfinite(y) == np.isfinite(ref)).all(), isa
            assert not np.isfinite(y[:2]).any(), isa
            check(mx.array(y[2:]), ref[2:], bound[2:], isa)
    finally:
        ext.set_isa("auto")


@pytest.mark.parametrize("m", [17, 64])
@pytest.mark.parametrize("bits,group", [(4, 32), (5, 64), (8, 128), (3, 32), (6, 16)])
def test_prefill_dequantizes_tiles_into_sgemm(m, bits, group):
    """17+ rows: tiles of w dequantized into BLAS sgemm (a tile that does not divide N
    too) by every ISA (the x86 ones' own product set aside), within the same bound; the
    counters say that path ran."""
    assert ext.sgemm_address() != 0, "no cblas_sgemm found"
    x, wq, s, b = make(211, max(group, 320 // group * group), bits, group, m)
    ref, bound = reference(x, wq, s, b, group, bits)
    try:
        for isa, tile in [(i, t) for i in ISAS for t in (0, 48)]:
            assert ext.set_isa(isa)
            ext.set_prefill(17, tile, gemm=False)
            before = ext.counters()["prefill"]
            check(ext.qmv(x, wq, s, b, group, bits), ref, bound, f"{isa} M={m} tile={tile}")
            assert ext.counters()["prefill"] == before + 1
            if group == 16:  # held without biases
                check(ext.qmv(x, wq, s, None, group, bits), ref, bound, f"{isa} no biases")
    finally:
        ext.set_prefill()
        ext.set_isa("auto")


GEMM_ISAS = [i for i in ISAS if ext.set_isa(i) and ext.prompt_route() == "own"]
if ext is not None:
    ext.set_isa("auto")


@pytest.mark.parametrize("bits,group", [(4, 32), (5, 64), (8, 128), (3, 32), (6, 16), (2, 16)])
def test_prompt_rows_through_the_isas_own_product(bits, group):
    """The prompt product of AVX-512 and AVX2 (w dequantized 128 columns at a time into
    cache, register tiles of weight rows × panels of x's rows: 64 rows in 4 vectors, 24 in 3):
    10 rows (where it takes over from the decode kernels) to 202, so that a last panel of
    every width meets every tile shape, and 600 (more than a task's group of ~512 rows; few
    weight rows also split x's panels among tasks), N not a multiple of a tile's rows nor of a
    task's, K not a multiple of the 128-column block, threads 1–3, and groups of 16 held
    without biases: within the float64 bound; the counters say that product ran. Each output
    is one float32 dot product summed in order, so both ISAs give the same bits."""
    if not GEMM_ISAS:
        pytest.skip("no AVX2 on this CPU")
    try:
        for n, k in [(211, 352), (24, 128), (5, 64)]:
            k = max(group, k // group * group)
            for m, th in [(10, 1), (29, 2), (40, 3), (63, 1), (84, 2), (202, 3), (600, 2)]:
                ext.set_num_threads(th)
                x, wq, s, b = make(n, k, bits, group, m, seed=n + m)
                ref, bound = reference(x, wq, s, b, group, bits)
                ys = []
                for isa in GEMM_ISAS:
                    assert ext.set_isa(isa)
                    what = f"{isa} N={n} K={k} M={m} threads={th}"
                    before = ext.counters()["gemm"]
                    ys.append(np.array(ext.qmv(x, wq, s, b, group, bits)))
                    assert ext.counters()["gemm"] == before + 1
                    check(mx.array(ys[-1]), ref, bound, what)
                    if group == 16:  # Q6_K's: held without biases
                        y = ext.qmv(x, wq, s, None, group, bits)
                        check(y, ref, bound, what + " no biases")
                assert all(np.array_equal(y, ys[0]) for y in ys), f"N={n} K={k} M={m}"
    finally:
        ext.set_isa("auto")
        ext.set_num_threads(0)


def test_a_prompt_without_blas_runs_the_fused_kernels():
    """No sgemm: 40 rows go through the decode kernels (counted as the fallback), within the
    bound, by every ISA; K long enough that the integer kernels' scratch for x (4.5 MiB) is
    released after the call, and a decode step after it still right."""
    address = ext.sgemm_address()
    x, wq, s, b = make(5, 38400, 4, 32, 40)
    ref, bound = reference(x, wq, s, b, 32, 4)
    x1, ref1, bound1 = x[:1], ref[:1], bound[:1]
    try:
        ext.set_sgemm(0)
        ext.set_prefill(gemm=False)  # (AVX-512 and AVX2 have a prompt product of their own)
        for isa in ISAS:
            assert ext.set_isa(isa)
            before = ext.counters()["prefill_fallback"]
            check(ext.qmv(x, wq, s, b, 32, 4), ref, bound, f"{isa} no BLAS")
            assert ext.counters()["prefill_fallback"] == before + 1
            check(ext.qmv(x1, wq, s, b, 32, 4), ref1, bound1, f"{isa} after")
    finally:
        ext.set_sgemm(address)
        ext.set_prefill()
        ext.set_isa("auto")


def test_inputs_of_any_layout_in_a_compiled_graph():
    """A transposed x or scales, a float16 x, leading batch axes, inside mx.compile and many
    products evaluated at once: the same results."""
    x, wq, s, b = make(65, 128, 4, 32, 6)
    ref, bound = reference(x, wq, s, b, 32, 4)
    check(ext.qmv(mx.array(np.array(x).T.copy()).T, wq, s, b, 32, 4), ref, bound, "x.T")
    check(ext.qmv(x, wq, mx.array(np.array(s).T.copy()).T, b, 32, 4), ref, bound, "s.T")
    y3 = ext.qmv(x.reshape(2, 3, 128), wq, s, b, 32, 4)
    check(y3.reshape(6, 65), ref, bound, "3-D x")
    ref16, bound16 = reference(x.astype(mx.float16).astype(mx.float32), wq, s, b, 32, 4)
    check(ext.qmv(x.astype(mx.float16), wq, s, b, 32, 4), ref16, bound16, "float16 x")
    f = mx.compile(lambda x: ext.qmv(x * 1.0, wq, s, b, 32, 4) + 0.0)
    check(f(x), ref, bound, "compiled")
    lazy = [ext.qmv(x, wq, s, b, 32, 4) for _ in range(8)]
    mx.eval(lazy)
    for y in lazy:
        check(y, ref, bound, "lazy")


def make_super(n, k, bits, group, m, seed=0):
    """A super-block format (K-quants as stored): random codes, integer scales (uint8 0..63 with
    uint8 mins, or int8 without, as Q4_K/Q5_K and Q6_K), float16 (d, dmin) per 256 weights;
    and the same weights in MLX's layout, float32 d·sc and −dmin·m computed here by numpy."""
    rng = np.random.default_rng(seed)
    g = k // group
    codes = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    as_bits = np.unpackbits(codes[..., None], axis=2, bitorder="little")[..., :bits]
    wq = mx.array(np.packbits(as_bits.reshape(n, -1), axis=1, bitorder="little").view("<u4"))
    signed = group == 16
    sc = rng.integers(-128 if signed else 0, 128 if signed else 64, (n, g))
    sc = sc.astype(np.int8 if signed else np.uint8)
    mins = None if signed else rng.integers(0, 64, (n, g)).astype(np.uint8)
    kd = rng.uniform(1e-4, 2e-3, (n, k // 256, 2)).astype(np.float16)
    pair = np.repeat(kd.astype(np.float32), 256 // group, axis=1)
    s = pair[..., 0] * sc.astype(np.float32)
    b = -(2.0 ** (bits - 1)) * s if signed else -(pair[..., 1] * mins.astype(np.float32))
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    stored = (mx.array(sc), None if mins is None else mx.array(mins), mx.array(kd))
    return x, wq, stored, mx.array(s), mx.array(b.astype(np.float32))


@pytest.mark.parametrize("bits,group", [(4, 32), (5, 32), (6, 16)])
def test_super_block_formats_equal_the_float_scales_layout(bits, group):
    """K-quants held as stored (integer scales, a float16 (d, dmin) per 256 weights): every
    ISA, decode rows 1-16 and prefill rows, equal the same weights with float32 scales d·sc
    and biases −dmin·m (the layout the kernels are proven on above) bit for bit, since the
    kernels form those same products; and within the float64 reference's bound. A row longer
    than the AVX-512 kernels expand on the stack (2048 groups) goes to the AVX2 ones."""
    ext.set_prefill(17)  # rows 1-9 through the decode kernels, 17 through the prompt paths
    try:
        for n, k in [(37, 768), (3, 256), (2, 2049 * 32 // 256 * 256 + 256)]:
            for m in (1, 3, 9, 17):
                x, wq, stored, s, b = make_super(n, k, bits, group, m, seed=n + m)
                ref, bound = reference(x, wq, s, b, group, bits)
                # MLX's layout for other devices (kernels.matmul off the CPU): the same floats
                s2, b2 = kernels.super_scales_as_float(*stored, group)
                assert np.array_equal(np.array(s2), np.array(s))
                assert (b2 is None) == (group == 16)
                assert b2 is None or np.array_equal(np.array(b2), np.array(b))
                for isa in ISAS:
                    assert ext.set_isa(isa)
                    sc, mins, kd = stored
                    decoded = ext.counters()["decode"]
                    y = ext.qmv(x, wq, sc, mins, group, bits, kd)
                    mx.eval(y)
                    decoded = ext.counters()["decode"] > decoded
                    if isa == "avx512" and k // group > 2048 and decoded:
                        assert ext.set_isa("avx2")  # where such a row goes
                    plain = ext.qmv(x, wq, s, None if mins is None else b, group, bits)
                    what = f"{isa} N={n} K={k} M={m} bits={bits}"
                    assert np.array_equal(np.array(y), np.array(plain)), what
                    check(y, ref, bound, what)
    finally:
        ext.set_prefill()
        ext.set_isa("auto")


def test_super_block_formats_refuse_what_they_cannot_be():
    x, wq, (sc, mins, kd), s, b = make_super(4, 512, 4, 32, 1)
    bad = [
        (x, wq, sc, mins, 64, 4, kd),  # groups of 64
        (x, wq, s, b, 32, 4, kd),  # float scales with super-block pairs
        (x, wq, sc.astype(mx.int32), mins, 32, 4, kd),
        (x, wq, sc, mins, 32, 4, kd.astype(mx.float32)),
        (x, wq, sc, mins, 32, 4, kd[:, :1]),
        (x, wq, sc, mins.astype(mx.int8), 32, 4, kd),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            ext.qmv(*args)
    ints = mx.zeros((4, 9), mx.uint8)  # K = 288: not whole super-blocks
    with pytest.raises(ValueError, match="multiple of 256"):
        ext.qmv(mx.zeros((1, 288)), mx.zeros((4, 36), mx.uint32), ints, ints, 32, 4, kd)


def test_bad_arguments_are_refused():
    x, wq, s, b = make(8, 64, 4, 32, 1)
    for args in ((x, wq, s, b, 32, 7), (x, wq, s, b, 48, 4), (x[:, :32], wq, s, b, 32, 4)):
        with pytest.raises(ValueError):
            ext.qmv(*args)
    with pytest.raises(ValueError):
        ext.qmv(x, wq, s[:, :1], b, 32, 4)


def test_quantized_layers_use_it_and_match_mlx():
    """A model's QuantizedLinear (as a loader builds it: Kernels) runs the kernel on the CPU
    for a decode step and a prompt, with MLX's own product's result within the bound; a mode
    the kernels lack (mxfp4) goes to MLX's own."""
    net = nn.Sequential(nn.Linear(256, 96, bias=True), nn.Linear(96, 64, bias=False))
    scaled = dict.fromkeys(["layers.0.scales", "layers.1.scales"])
    quantize_like(net, scaled, {"group_size": 32, "bits": 5}, quantizer=Kernels())
    assert all(type(layer) is QuantizedLinear for layer in net.layers)
    mx.random.seed(0)
    for m in (1, 40):
        x = mx.random.normal((m, 256))
        before = ext.counters()
        y = net.layers[0](x)
        mx.eval(y)
        after = ext.counters()
        assert sum(after.values()) == sum(before.values()) + 1
        assert after["prefill_fallback"] == before["prefill_fallback"]
        layer = net.layers[0]
        ref, bound = reference(x, layer.weight, layer.scales, layer.biases, 32, 5)
        check(y - layer.bias, ref, bound + 1e-6, f"M={m}")
    fp4 = Kernels().quantize(
        nn.Linear(64, 32, bias=False), dict(group_size=32, bits=4, mode="mxfp4")
    )
    before = ext.counters()
    want = mx.quantized_matmul(
        mx.ones((1, 64)), fp4.weight, fp4.scales, None, True, 32, 4, mode="mxfp4"
    )
    got = fp4(mx.ones((1, 64)))
    mx.eval(got, want)
    assert mx.array_equal(got, want).item()
    assert ext.counters()["decode"] == before["decode"]


FORK = r"""
import os, sys
import numpy as np
import mlxlis  # noqa: F401
import mlx.core as mx
from mlxlis.runtime import kernels
ext = kernels.load()
d = np.load(sys.argv[1])
args, ref, bound = [d["x"], d["wq"], d["s"], d["b"]], d["ref"], d["bound"]
ext.set_num_threads(int(sys.argv[2]))
ok = lambda y: bool((np.abs(np.asarray(y, np.float64) - ref) <= bound).all())
assert ok(ext.qmv_numpy(*args, 32, 4))  # the parent's pool is running now
r, w = os.pipe()
if os.fork() == 0:
    good = all(ok(ext.qmv_numpy(*args, 32, 4)) for _ in range(3))  # the child's own pool
    good = good and ok(np.array(ext.qmv(*[mx.array(a) for a in args], 32, 4)))  # and MLX
    os.write(w, b"ok" if good else b"bad")
    os._exit(0 if good else 1)
os.close(w)
_, status = os.wait()
assert os.read(r, 8) == b"ok" and os.WEXITSTATUS(status) == 0
assert ok(ext.qmv_numpy(*args, 32, 4))  # the parent's pool still works
print("ok")
"""


@pytest.mark.parametrize("threads", [1, 3])
def test_a_forked_child_runs_its_own_threads(tmp_path, threads):
    """The pool runs in the parent, then fork(): the child builds its own and gets the same
    results (through MLX too); the parent's still works. In a fresh interpreter: MLX cannot
    evaluate in a child forked after its parent evaluated, so the parent uses the kernels
    through their numpy entry before forking."""
    x, wq, s, b = make(4864, 896, 4, 32, 2)
    ref, bound = reference(x, wq, s, b, 32, 4)
    path = tmp_path / "data.npz"
    np.savez(path, x=np.array(x), wq=np.array(wq), s=np.array(s), b=np.array(b))
    with np.load(path) as d:
        assert np.array_equal(d["wq"], np.array(wq))
    np.savez(
        path, x=np.array(x), wq=np.array(wq), s=np.array(s), b=np.array(b), ref=ref, bound=bound
    )
    res = subprocess.run(
        [sys.executable, "-c", FORK, str(path), str(threads)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_a_failed_build_is_said_and_not_tried_again(tmp_path, monkeypatch):
    """Where the kernels cannot be built (here: the build raises as a missing compiler does),
    the reason is kept beside the key: the next loads say it without building again, until a
    retry (`python -m mlxlis.runtime.kernels`)."""
    from mlxlis.runtime.kernels import build

    monkeypatch.setenv("MLXLIS_KERNELS", str(tmp_path))
    calls = []

    def fail(target, verbose=False):
        calls.append(target)
        raise build.BuildError("no C++ compiler (test)")

    monkeypatch.setattr(build, "build", fail)
    for retry in (False, False, True):
        with pytest.raises(build.BuildError, match="no C"):
            build.ensure(retry=retry)
    assert len(calls) == 2
    assert (build.so_path().parent / "failed.txt").read_text() == "no C++ compiler (test)"


def test_an_embedding_with_float16_scales_looks_up_float32_rows():
    """binding.kept_narrow keeps an embedding's float16 scales beside float32 compute (the
    tied head's product reads them as float32): its lookup widens the rows' scales, so the
    rows are exactly those of the same scales stored as float32, where MLX's dequantize with
    float16 scales would compute, and round, in float16."""
    table = nn.Embedding(64, 256)
    table.weight = mx.random.normal((64, 256), key=mx.random.key(3))
    narrow = Kernels(mx.float32).quantize(table, {"group_size": 32, "bits": 8})  # a loader's
    narrow.scales, narrow.biases = (
        narrow.scales.astype(mx.float16),
        narrow.biases.astype(mx.float16),
    )
    wide = table.to_quantized(group_size=32, bits=8)
    wide.scales, wide.biases = narrow.scales.astype(mx.float32), narrow.biases.astype(mx.float32)
    ids = mx.array([[0, 5, 63, 5]])
    got = narrow(ids)
    assert got.dtype == mx.float32 and mx.array_equal(got, wide(ids)).item()
    assert not mx.array_equal(nn.QuantizedEmbedding.__call__(narrow, ids), got).item()


def test_several_products_of_one_x_as_one_node_equal_each_alone():
    """Self-consistency (each product alone is proven against the references above): a
    layer's projections of one x as one node (`qmv_many`, what `models.quantized.products`
    runs for q/k/v and gate/up) give each product's own bits, on every ISA, for the mixes a
    GGUF holds (K-quants with integer scales beside Q6_K's groups of 16 and plain float16
    scales, 8-bit codes), decode rows (one job over all the products' rows, small products
    included) and prompt rows (each product's own path), on 1-3 threads."""
    k = 512
    parts = []
    for i, (n, bits, group) in enumerate([(96, 4, 32), (40, 6, 16), (72, 4, 32), (200, 8, 32)]):
        if group == 16 or i == 0:  # stored as a K-quant: integer scales, (d, dmin) pairs
            _, wq, (sc, mins, kd), _, _ = make_super(n, k, bits, group, 1, seed=i)
            parts.append((wq, sc, mins, group, bits, kd))
        else:
            _, wq, s, b = make(n, k, bits, group, 1, seed=i, sb_dtype=mx.float16)
            parts.append((wq, s, b, group, bits, None))
    threads = ext.num_threads()
    try:
        for isa in ISAS:
            assert ext.set_isa(isa)
            for m, th in [(1, 1), (1, 2), (3, 3), (8, 2), (40, 2)]:
                ext.set_num_threads(th)
                x = mx.array(np.random.default_rng(m).standard_normal((m, k)).astype(np.float32))
                alone = [ext.qmv(x, *p) for p in parts]
                many = ext.qmv_many(x, *(list(col) for col in zip(*parts, strict=True)))
                mx.eval(alone, many)
                for i, (a, b) in enumerate(zip(alone, many, strict=True)):
                    assert np.array_equal(np.array(a), np.array(b)), f"{isa} M={m} part {i}"
    finally:
        ext.set_num_threads(threads)
        ext.set_isa("auto")
    with pytest.raises(ValueError, match="between 1 and 4 products"):
        ext.qmv_many(x, *(list(col) * 2 for col in zip(*parts[:3], strict=True)))
