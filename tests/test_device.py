"""Device choice: the GPU when MLX has a usable one, else the CPU; MLXLIS_DEVICE overrides.

Proves the override and its refusals, and (on a machine with a GPU only) that the GPU default
dtype runs a real model close to the CPU float32 reference. Where no GPU is usable (Linux CPU
builds, a macOS runner without Metal) the GPU test skips and says why.
"""

from __future__ import annotations

import mlxlis
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.loading import catalog
from mlxlis.runtime import device, process

import mlx.core as mx
import numpy as np
import pytest

HAS_GPU = device.gpu_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no usable GPU here (MLX reports none)")


@pytest.fixture(autouse=True)
def restore_device():
    before = mx.default_device()
    yield
    mx.set_default_device(before)


def test_cpu_override_and_default_dtype(monkeypatch):
    monkeypatch.setenv("MLXLIS_DEVICE", "cpu")
    assert device.select_device() == "cpu"
    assert mx.default_device() == mx.cpu and device.default_dtype_name() == "float32"


def test_bad_override_is_refused(monkeypatch):
    monkeypatch.setenv("MLXLIS_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="MLXLIS_DEVICE"):
        device.select_device()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_gpu_override_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("MLXLIS_DEVICE", "gpu")
    with pytest.raises(UnsupportedError, match="no usable GPU"):
        device.select_device()


@needs_gpu
@pytest.mark.real
@pytest.mark.skipif(not catalog.is_pulled("smollm2-135m"), reason="smollm2-135m not pulled")
def test_gpu_default_dtype_close_to_cpu_float32(monkeypatch):
    monkeypatch.setenv("MLXLIS_DEVICE", "cpu")
    ref_model = mlxlis.load("smollm2-135m", "float32")
    ids = ref_model.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    ref = np.array(ref_model.logits(ids))
    monkeypatch.setenv("MLXLIS_DEVICE", "gpu")
    model = mlxlis.load("smollm2-135m")
    assert process.describe()["device"] in ("metal", "cuda")
    got = np.array(model.logits(ids))
    assert np.isfinite(got).all() and got.argmax(-1)[-1] == ref.argmax(-1)[-1]
    # float16 / bfloat16 weights and activations: the same function up to rounding
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.999


# The GPU branch as pure decisions, run here on the CPU: what MLX would report on a CUDA or Metal
# machine is an argument, the expected answers are DESIGN.md's dtype policy and MLX's own
# device_info keys (mlx/backend/cuda/device_info.cpp: free_memory, total_memory; Metal's
# max_recommended_working_set_size).


@pytest.mark.parametrize(
    "gpu, want, expected",
    [
        (None, None, ("cpu", "float32", True)),
        ("cuda", None, ("cuda", "bfloat16", False)),
        ("metal", None, ("metal", "float16", False)),
        ("cuda", "gpu", ("cuda", "bfloat16", False)),
        ("cuda", "cpu", ("cpu", "float32", True)),
        ("metal", "cpu", ("cpu", "float32", True)),
        (None, "cpu", ("cpu", "float32", True)),
    ],
)
def test_policy_picks_the_gpu_in_its_design_dtype(gpu, want, expected):
    """device.policy (what MLX reports, MLXLIS_DEVICE) -> device, dtype, CPU-only pieces on:
    the GPU whenever MLX reports one unless the variable says cpu; CUDA computes in bfloat16,
    Metal in float16, the CPU in float32 (DESIGN.md's dtype policy); the CPU-only pieces only
    on the CPU; and the backend chosen for that device is MLX's own operations off the CPU."""
    from mlxlis.runtime import backend
    from mlxlis.settings import Settings

    got = device.policy(gpu, want)
    assert (got.device, got.dtype, got.cpu_kernels) == expected
    env = Settings(fused=True, fast_math=True)
    if not got.cpu_kernels:
        assert isinstance(backend.choose(got.device, env), backend.MLX)
        assert backend.choose(got.device, env).name == "mlx"


def test_policy_refuses_gpu_where_mlx_reports_none_by_name():
    """MLXLIS_DEVICE=gpu with no GPU reported: an UnsupportedError naming the variable and
    the install that provides one, never a silent CPU run."""
    with pytest.raises(UnsupportedError, match=r"MLXLIS_DEVICE.*mlxlis\[cuda\]"):
        device.policy(None, "gpu")


def test_cpu_kernels_route_only_products_on_the_cpu():
    """runtime/kernels decides by the device the product runs on: the qmv kernel for an
    affine layout it covers on the CPU, MLX's own quantized_matmul for the same layout on a
    GPU device (whatever platform this is), and the current stream's device by default."""
    from mlxlis.runtime import kernels

    gpu, cpu = mx.Device(mx.gpu), mx.Device(mx.cpu)
    for bits, group in [(4, 32), (8, 32), (6, 16), (5, 64)]:
        assert kernels.applies(bits, group, "affine", cpu)
        assert not kernels.applies(bits, group, "affine", gpu)
    with mx.stream(mx.cpu):
        assert device.on_cpu() and kernels.applies(4, 32)
    assert not device.on_cpu(gpu) and device.on_cpu(cpu)


def test_gguf_blocks_stay_quantized_for_gpu_products():
    """A GGUF's default on a GPU device is its blocks in MLX's quantized layout (the CPU goes
    dense while the dense weights fit), decided by the device the products run on."""
    from mlxlis.models.from_gguf import dense_by_default

    assert dense_by_default(1 << 20, mx.Device(mx.cpu))
    assert not dense_by_default(1 << 20, mx.Device(mx.gpu))


@pytest.mark.parametrize(
    "dev, info, expected",
    [
        ("cuda", {"free_memory": 80 << 30, "total_memory": 85 << 30}, (80 << 30) + (2 << 30)),
        (
            "metal",
            {"max_recommended_working_set_size": 48 << 30, "memory_size": 64 << 30},
            48 << 30,
        ),
        ("cuda", {}, (16 << 30) + (2 << 30)),
        ("cpu", {}, (16 << 30) + (2 << 30)),
    ],
)
def test_memory_plan_reads_the_gpus_memory(dev, info, expected):
    """memory.offered: a CUDA GPU offers its free memory (NVML's system-wide figure, which
    counts what MLX holds as used) plus what MLX holds; Metal its recommended working set; the
    CPU, or a GPU that does not say, the host's available memory plus what MLX holds. Host
    16 GiB available, MLX holding 2 GiB."""
    from mlxlis.runtime import memory

    assert memory.offered(dev, info, 16 << 30, 2 << 30) == expected


def test_memory_budget_on_this_device_is_capped_by_the_variable(monkeypatch):
    """On this machine's device the budget is what it offers, capped by MLXLIS_MAX_MEMORY."""
    from mlxlis.runtime import memory

    monkeypatch.setenv("MLXLIS_DEVICE", "cpu")
    device.select_device()
    assert memory.memory_budget() > 1 << 30  # this machine's available memory, at least
    monkeypatch.setenv("MLXLIS_MAX_MEMORY", "512M")
    assert memory.memory_budget() == 512 << 20
