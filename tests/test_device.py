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
