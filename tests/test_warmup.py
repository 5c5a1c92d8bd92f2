"""The install-time warm-up (mlxlis/generation/warmup.py) fills MLX's kernel cache for models
of other shapes: MLX names its compiled CPU kernels by the operations they fuse and their
dtype, not by shapes. Proved by count, not by time: in a fresh kernel folder, after the tiny
Llama warm-up, a different-sized model of the same kind generates without one new kernel."""

from __future__ import annotations

import os
import subprocess
import sys

from mlxlis.generation.warmup import TINY_CONFIGS

import pytest

WARM = "from mlxlis.generation.warmup import TINY_CONFIGS, warm_tiny; warm_tiny(TINY_CONFIGS[:1])"
GENERATE = """
import sys, mlxlis
m = mlxlis.load(sys.argv[1], "float32")
list(mlxlis.generate(m, list(range(3, 40)), max_tokens=4, stop_ids=set()))
"""


def kernels(tmp) -> set[str]:
    folder = tmp / "mlx"
    return {p.name for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


@pytest.mark.extended  # `make test-all` (13 s): two processes compiling the kernels
def test_tiny_warm_up_covers_a_model_of_another_size(tiny, tmp_path):
    folder, _ = tiny("qwen2")  # hidden, heads and vocabulary unlike the warm-up's
    assert TINY_CONFIGS[0]["model_type"] == "llama"
    env = {**os.environ, "TMPDIR": str(tmp_path), "MLXLIS_DEVICE": "cpu"}
    for code in (WARM, GENERATE):
        args = [str(folder)] if code is GENERATE else []
        if code is GENERATE:
            warmed = kernels(tmp_path)
            assert warmed, "the warm-up compiled nothing (is a C++ compiler missing?)"
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
    assert kernels(tmp_path) == warmed
