"""mlxlis.loading.quants: every GGUF type against gguf-py's dequantizer (reference parity).

Quantized types are packed for MLX, then unpacked by MLX itself (`mx.dequantize`) and compared
bit for bit with `gguf.quants.dequantize` in float32. Why exact is the right bar: fp16 d times
a ≤ 6-bit scale and a ≤ 8-bit code is exact in fp32, so scale·q + bias rounds once, exactly
where gguf-py's formula rounds. The packing itself is also checked against `mx.quantize`.
"""

from __future__ import annotations

import math

from mlxlis.errors import FileFormatError, UnsupportedQuantError
from mlxlis.loading import catalog, quants
from mlxlis.loading.gguf import GGML_TYPES, GGUFTensor
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.quants import AFFINE_HELD, QUANTIZABLE, convert_tensor, pack_codes

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

F16_FIELDS = {  # byte offsets of the fp16 scale fields inside one block
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "IQ4_NL": [0],
}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
# sane fp16 scales, including zero, -0, a subnormal and large values
SPECIAL = np.array([0.0, -0.0, 6e-8, 3e-5, -1.5, 1000.0], dtype=np.float32)


def tensor(type_name: str, shape: tuple[int, ...]) -> GGUFTensor:
    type_id = GGMLQuantizationType[type_name].value
    _, block, size = GGML_TYPES[type_id]
    return GGUFTensor(
        "blk.0.test.weight", type_id, type_name, shape, 0, math.prod(shape) // block * size
    )


def random_raw(t: GGUFTensor, seed: int = 0) -> np.ndarray:
    """Random block bytes whose fp16 fields hold sane scales (no inf / nan)."""
    rng = np.random.default_rng(seed)
    _, _, size = GGML_TYPES[t.ggml_type]
    blocks = rng.integers(0, 256, (t.nbytes // size, size), dtype=np.uint8)
    for off in F16_FIELDS.get(t.type_name, []):
        d = rng.standard_normal(len(blocks)).astype(np.float32) * 0.02
        d[: len(SPECIAL)] = SPECIAL[: len(d)]
        blocks[:, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference(t: GGUFTensor, raw: np.ndarray) -> np.ndarray:
    rows = math.prod(t.shape[:-1])
    qtype = GGMLQuantizationType(t.ggml_type)
    return gguf_dequantize(raw.reshape(rows, -1), qtype).reshape(t.shape)


def unpacked(c: quants.Converted) -> np.ndarray:
    """What the model will compute with: MLX's own dequantization of our packing, float16
    scales and biases widened to float32 as the products read them."""
    if c.scales is None:
        return np.array(c.weight.astype(mx.float32))
    if c.super_scales is not None:  # K-quants as stored: the group's d·sc and −dmin·m
        kd = np.array(c.super_scales).astype(np.float32)
        kd = np.repeat(kd, 256 // c.group_size, axis=1)  # (rows, groups, 2)
        s = kd[..., 0] * np.array(c.scales).astype(np.float32)
        b = None if c.biases is None else -(kd[..., 1] * np.array(c.biases).astype(np.float32))
        return numpy_dequantized(c, s, b)
    wide = [
        a.astype(mx.float32) if a is not None and a.dtype == mx.float16 else a
        for a in (c.scales, c.biases)
    ]
    w = mx.dequantize(c.weight, *wide, group_size=c.group_size, bits=c.bits, mode=c.mode)
    return np.array(w.astype(mx.float32))


def numpy_dequantized(c: quants.Converted, s: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """c's codes unpacked by numpy, times the group scales s, plus the biases b (None: the
    symmetric −2^(bits−1)·s), in float32 as the kernels' dequantized tiles."""
    rows, k = c.weight.shape[0], c.weight.shape[1] * 32 // c.bits
    as_bits = np.unpackbits(np.array(c.weight).view(np.uint8), axis=1, bitorder="little")
    q = (as_bits.reshape(rows, k, c.bits) << np.arange(c.bits, dtype=np.uint8)).sum(2)
    s = np.repeat(s, c.group_size, axis=1)
    b = -(2.0 ** (c.bits - 1)) * s if b is None else np.repeat(b, c.group_size, axis=1)
    return q.astype(np.float32) * s + b


@pytest.fixture
def small_chunks(monkeypatch):
    """Convert in chunks of 2 rows so the multi-chunk path runs on small tensors."""
    monkeypatch.setattr(quants, "CHUNK_ELEMENTS", 1024)


@pytest.mark.parametrize("name", sorted(AFFINE_HELD))
def test_quantized_random_blocks_bit_exact(name: str, small_chunks):
    """Reference parity: random blocks -> our MLX packing -> mx.dequantize == gguf-py, fp32."""
    t = tensor(name, (8, 512))
    raw = random_raw(t)
    c = convert_tensor(t, raw, mx.float32)
    assert (c.bits, c.group_size) == (BITS[name], 32)
    assert c.weight.dtype == mx.uint32 and c.weight.shape == (8, 512 * BITS[name] // 32)
    assert c.scales.shape == c.biases.shape == (8, 16)
    # float16 where it holds every scale and bias exactly (quants.HALF_EXACT), else float32
    half = name in quants.HALF_EXACT and c.scales.dtype == mx.float16
    assert c.scales.dtype == c.biases.dtype == (mx.float16 if half else mx.float32)
    ref = reference(t, raw)
    assert np.array_equal(unpacked(c), ref)
    forced = convert_tensor(t, raw, mx.float32, dequantize=True)
    assert forced.scales is None and np.array_equal(unpacked(forced), ref)


def test_float16_scales_only_where_every_value_survives(small_chunks):
    """Q8_0's scales d and biases −128·d are held in float16 only when every one round-trips
    (checked a chunk at a time): one d of 1000 in the last row (−128 000 overflows float16)
    keeps the whole tensor's in float32, bit-exact either way."""
    t = tensor("Q8_0", (160, 512))  # 2560 scales: 3 chunks of the check
    blocks = random_raw(t).reshape(-1, 34)
    d = np.linspace(-0.05, 0.05, len(blocks)).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    for big in (False, True):
        if big:
            blocks[-1, 0:2] = np.frombuffer(np.float16(1000.0).tobytes(), np.uint8)
        c = convert_tensor(t, blocks.reshape(-1), mx.float32)
        assert c.scales.dtype == c.biases.dtype == (mx.float32 if big else mx.float16)
        assert np.array_equal(unpacked(c), reference(t, blocks.reshape(-1)))


def test_mxfp4_blocks_are_mlx_mxfp4_bit_exact():
    """Reference parity: random MXFP4 blocks (every code; exponents from 2⁻²⁰ to 2¹⁰) ->
    MLX's mxfp4 (codes reordered, the exponent byte as the scale) -> mx.dequantize ==
    gguf-py's dequantizer, fp32; and gguf-py's quantizer's blocks of N(0, 1) too."""
    t = tensor("MXFP4", (4, 2, 256))
    raw = random_raw(t).reshape(-1, 17)
    raw[:, 0] = np.random.default_rng(2).integers(107, 138, len(raw))
    c = convert_tensor(t, raw.reshape(-1), mx.float32)
    assert (c.bits, c.group_size, c.mode, c.biases) == (4, 32, "mxfp4", None)
    assert c.weight.shape == (4, 2, 32) and c.scales.shape == (4, 2, 8)
    assert c.scales.dtype == mx.uint8
    assert np.array_equal(unpacked(c), reference(t, raw.reshape(-1)))
    w = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    made = gguf_quantize(w, GGMLQuantizationType.MXFP4).reshape(-1)
    t = tensor("MXFP4", (6, 256))
    assert np.array_equal(unpacked(convert_tensor(t, made, mx.float32)), reference(t, made))
    forced = convert_tensor(t, made, mx.float32, dequantize=True)
    assert forced.scales is None and np.array_equal(unpacked(forced), reference(t, made))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_from_gguf_quantize_bit_exact(name: str):
    """Reference parity on realistic blocks made by gguf-py's own quantizer from N(0, 1)."""
    w = np.random.default_rng(1).standard_normal((6, 256)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType[name]).reshape(-1)
    t = tensor(name, (6, 256))
    assert np.array_equal(unpacked(convert_tensor(t, raw, mx.float32)), reference(t, raw))


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_packing_matches_mx_quantize(bits: int):
    """Reference parity with MLX's packer: integer weights spanning 0..2^b-1 in every group
    quantize losslessly, and `mx.quantize` packs their codes into exactly our uint32 words."""
    rng = np.random.default_rng(bits)
    w = rng.integers(0, 2**bits, (4, 128)).astype(np.float32)
    w[:, 0::32], w[:, 1::32] = 0, 2**bits - 1
    wq, scales, biases = mx.quantize(mx.array(w), group_size=32, bits=bits)
    s = np.repeat(np.array(scales), 32, axis=1)  # MLX may pick scale −1, bias 2^b−1
    codes = np.rint((w - np.repeat(np.array(biases), 32, axis=1)) / s).astype(np.uint8)
    assert np.array_equal(codes * s + np.repeat(np.array(biases), 32, axis=1), w)
    assert np.array_equal(np.array(wq), pack_codes(codes, bits))


@pytest.mark.parametrize(
    "name,bits,group,scales",
    [("Q4_K", 4, 32, "uint8"), ("Q5_K", 5, 32, "uint8"), ("Q6_K", 6, 16, "int8")],
)
def test_k_quants_held_as_stored_bit_exact(name, bits, group, scales, small_chunks):
    """Reference parity: K-quants held as the file holds them (the CPU kernels' super-block
    layout: codes, each group's integer scale sc and min m, each 256 weights' float16 d and
    dmin), taken as d·sc·q − dmin·m by numpy, equal gguf-py bit for bit; only when asked and
    not dense. Q4_K/Q5_K's d·sc and −dmin·m equal the float32 scales and biases of MLX's
    layout (what the kernels compute them as: test_qmv proves their products equal)."""
    t = tensor(name, (8, 512))
    raw = random_raw(t)
    c = convert_tensor(t, raw, mx.float32, sub_blocks=True)
    assert (c.bits, c.group_size) == (bits, group)
    assert c.weight.shape == (8, 512 * bits // 32) and c.scales.shape == (8, 512 // group)
    assert c.scales.dtype == getattr(mx, scales) and c.super_scales.dtype == mx.float16
    assert c.super_scales.shape == (8, 2, 2)
    assert (c.biases is None) == (name == "Q6_K")
    assert np.array_equal(unpacked(c), reference(t, raw))
    if name != "Q6_K":  # MLX's layout: float32 scales and biases
        plain = convert_tensor(t, raw, mx.float32)
        kd = np.repeat(np.array(c.super_scales).astype(np.float32), 8, axis=1)
        assert np.array_equal(kd[..., 0] * np.array(c.scales), np.array(plain.scales))
        assert np.array_equal(-(kd[..., 1] * np.array(c.biases)), np.array(plain.biases))
    else:
        assert convert_tensor(t, raw, mx.float32).scales is None  # dense without the kernels
    assert convert_tensor(t, raw, mx.float32, dequantize=True, sub_blocks=True).scales is None


@pytest.mark.parametrize("name", ["Q6_K", "Q2_K", "Q3_K", "IQ4_NL"])
def test_dense_types_bit_exact(name: str, small_chunks):
    """Reference parity: our Q6_K/Q2_K/Q3_K dequantizers (and the gguf-py fallback used for
    IQ4_NL) give gguf-py's values bit for bit, as dense fp32."""
    t = tensor(name, (8, 512))
    raw = random_raw(t)
    c = convert_tensor(t, raw, mx.float32)
    assert c.scales is None and c.weight.dtype == mx.float32 and c.weight.shape == (8, 512)
    assert np.array_equal(unpacked(c), reference(t, raw))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "F64"])
def test_float_types(name: str):
    """F32/F16/BF16 equal gguf-py's reading of the same bytes (F64: numpy's); casts to fp16 and
    bf16 equal MLX's own cast of that reference (self-consistency of the cast only)."""
    t = tensor(name, (3, 40))
    w = np.random.default_rng(2).standard_normal(t.shape) * 3
    bf16 = (w.astype("<f4").view("<u4") >> 16).astype("<u2")  # truncated to bf16 bits
    arrays = {"F32": w.astype("<f4"), "F16": w.astype("<f2"), "F64": w.astype("<f8"), "BF16": bf16}
    raw = arrays[name].view(np.uint8)
    ref = w.astype(np.float32) if name == "F64" else reference(t, raw.reshape(-1))
    assert np.array_equal(unpacked(convert_tensor(t, raw.reshape(-1), mx.float32)), ref)
    for dt in (mx.float16, mx.bfloat16):
        got = convert_tensor(t, raw.reshape(-1), dt).weight
        assert got.dtype == dt and mx.array_equal(got, mx.array(ref).astype(dt)).item()


def test_compute_dtypes_keep_uint32_codes_and_cast_scales():
    """fp16/bf16: codes unchanged, scales/biases cast once from fp32. Q4_K scales d·sc carry
    up to 17 significant bits, so in fp16 (11) or bf16 (8) they round: close, not exact."""
    t = tensor("Q4_K", (4, 256))
    raw = random_raw(t)
    ref = reference(t, raw)
    exact = convert_tensor(t, raw, mx.float32)
    for dt, tol in ((mx.float16, 2**-10), (mx.bfloat16, 2**-7)):
        c = convert_tensor(t, raw, dt)
        assert c.scales.dtype == c.biases.dtype == dt
        assert mx.array_equal(c.weight, exact.weight).item()
        assert np.abs(unpacked(c) - ref).max() <= tol * np.abs(ref).max()


def test_one_dim_and_three_dim_tensors():
    """1-D quantized tensors (norms, biases) come out dense; 3-D keep their leading dims."""
    t1 = tensor("Q8_0", (64,))
    raw1 = random_raw(t1)
    c1 = convert_tensor(t1, raw1, mx.float32)
    assert c1.scales is None and np.array_equal(unpacked(c1), reference(t1, raw1))
    t3 = tensor("Q4_0", (2, 3, 64))
    raw3 = random_raw(t3)
    c3 = convert_tensor(t3, raw3, mx.float32)
    assert c3.weight.shape == (2, 3, 8) and c3.scales.shape == (2, 3, 2)
    assert np.array_equal(unpacked(c3), reference(t3, raw3))


def test_unsupported_types_name_type_and_tensor():
    """I32 has no dequantizer anywhere; an id unknown to ggml is refused the same way."""
    t = tensor("I32", (2, 4))
    with pytest.raises(UnsupportedQuantError, match="I32") as info:
        convert_tensor(t, np.zeros(t.nbytes, np.uint8), mx.float32, path="m.gguf")
    assert info.value.field == t.name and "m.gguf" in str(info.value)
    unknown = GGUFTensor("x.weight", 200, "UNKNOWN_200", (2, 32), 0, 0)
    with pytest.raises(UnsupportedQuantError, match="200") as info:
        convert_tensor(unknown, np.zeros(0, np.uint8), mx.float32, path="m.gguf")
    assert info.value.field == "x.weight"


def test_raw_of_the_wrong_size_is_refused():
    t = tensor("Q4_0", (2, 32))
    with pytest.raises(FileFormatError, match="raw bytes"):
        convert_tensor(t, np.zeros(t.nbytes - 1, np.uint8), mx.float32)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_real_tensors_bit_exact(name: str):
    """Reference parity on real weights: the smallest tensor of each type in the model, packed
    (or dense) by us and unpacked by MLX, equals gguf-py's dequantization in fp32."""
    if not catalog.is_pulled(name):
        pytest.skip(f"{name} not pulled (make models)")
    with read_gguf(catalog.model_path(name)) as f:
        smallest: dict[str, GGUFTensor] = {}
        for t in f.tensors.values():
            best = smallest.get(t.type_name)
            if best is None or t.nbytes < best.nbytes:
                smallest[t.type_name] = t
        for t in smallest.values():
            raw = f.raw(t.name)
            c = convert_tensor(t, raw, mx.float32, path=str(f.path))
            quantized = t.type_name in QUANTIZABLE and len(t.shape) > 1
            assert (c.scales is not None) == quantized, t.name
            assert np.array_equal(unpacked(c), reference(t, raw)), (t.name, t.type_name)
            if t.type_name in quants.SUPER_HELD and len(t.shape) == 2:  # the kernels' layout
                c = convert_tensor(t, raw, mx.float32, path=str(f.path), sub_blocks=True)
                assert c.super_scales is not None, t.name
                assert np.array_equal(unpacked(c), reference(t, raw)), (t.name, t.type_name)


@pytest.mark.parametrize(
    "name,dequantize,stored",
    [
        ("Q5_0", False, False),
        ("Q4_K", False, False),
        ("Q8_0", True, False),
        ("Q6_K", False, False),
        ("Q4_K", False, True),
    ],
)
def test_threaded_chunks_equal_serial(
    name: str, dequantize: bool, stored: bool, small_chunks, monkeypatch
):
    """Self-consistency: a tensor's chunks converted on 3 threads (machines with > 2 cores)
    give the same bits as on one, and `done` is told of every raw byte exactly once
    (`stored`: the kernels' super-block layout)."""
    t = tensor(name, (16, 512))
    raw = random_raw(t)
    serial = convert_tensor(t, raw, mx.float32, dequantize=dequantize, sub_blocks=stored)
    monkeypatch.setattr(quants, "_workers", lambda: 3)
    spans: list[tuple[int, int]] = []
    threaded = convert_tensor(
        t,
        raw,
        mx.float32,
        dequantize=dequantize,
        done=lambda i, j: spans.append((i, j)),
        sub_blocks=stored,
    )
    pairs = [(serial.weight, threaded.weight), (serial.scales, threaded.scales)]
    pairs += [(serial.biases, threaded.biases), (serial.super_scales, threaded.super_scales)]
    for a, b in pairs:
        assert (a is None) == (b is None) and (a is None or mx.array_equal(a, b).item())
    spans.sort()
    assert len(spans) > 3 and spans[0][0] == 0 and spans[-1][1] == t.nbytes
    assert all(j == k for (_, j), (k, _) in zip(spans, spans[1:], strict=False))
