"""What this process runs models on, in words: the device, the BLAS MLX's CPU matmuls call and
the kernels that run quantized products (a model's own facts are `Model.describe`'s)."""

from __future__ import annotations

from mlxlis.runtime import blas, device, kernels


def describe() -> dict[str, str]:
    """device, blas, kernels; "notice" only when a faster BLAS could not be used."""
    details = {
        "device": device.device_name(),
        "blas": blas.state.name,
        "kernels": kernels.describe() if device.on_cpu() else "MLX's own",
    }
    if blas.state.notice:
        details["notice"] = blas.state.notice
    return details
