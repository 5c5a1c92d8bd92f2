"""Which BLAS MLX's Linux CPU matmuls run on (mlxlis/blas.py), each case in a fresh process.

Proves: by default a recent system OpenBLAS is used when installed, else the scipy-openblas32
wheel, routed in through the dispatch (no system package needed); MLXLIS_BLAS picks one;
without the compiled dispatch (no C compiler at install) everything still works on MLX's
bundled BLAS, with products equal to numpy's, and `--verbose` says so in one line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlxlis
from mlxlis.runtime import blas

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU BLAS")

PROBE = """
import numpy as np
import mlxlis
from mlxlis.runtime import blas
import mlx.core as mx
rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 96), np.float32), rng.standard_normal((96, 48), np.float32)
v = rng.standard_normal((1, 96), np.float32)
got = np.array(mx.array(a) @ mx.array(b)), np.array(mx.array(v) @ mx.array(b))
ref = a.astype(np.float64) @ b, v.astype(np.float64) @ b
bound = 96 * 2**-23 * (np.abs(a) @ np.abs(b)).max() * 2
ok = all(np.abs(g - r).max() <= bound for g, r in zip(got, ref))
print(blas.state.name, "|", blas.state.notice, "|", ok, "|", mlxlis.__file__)
"""


def probe(env: dict, cwd: Path | None = None) -> list[str]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return [part.strip() for part in res.stdout.strip().split("|")]


def test_auto_takes_a_recent_system_openblas_else_the_wheel():
    pytest.importorskip("scipy_openblas32")
    if not list(Path(mlxlis.__file__).parent.glob("_blas_dispatch*.so")):
        pytest.skip("the dispatch was not built here (no C compiler)")
    name, notice, ok, _ = probe({"MLXLIS_BLAS": "auto"})
    assert notice == "None" and ok == "True"
    system = probe({"MLXLIS_BLAS": "system"})[0]
    version = re.match(r"system OpenBLAS ([0-9.]+) ", system)
    if version and tuple(map(int, version[1].split("."))) >= blas.SYSTEM_PREFERRED:
        assert name == system
    else:
        assert name.startswith("OpenBLAS") and "scipy-openblas32" in name, name


def test_wheel_on_request():
    pytest.importorskip("scipy_openblas32")
    if not list(Path(mlxlis.__file__).parent.glob("_blas_dispatch*.so")):
        pytest.skip("the dispatch was not built here (no C compiler)")
    name, notice, ok, _ = probe({"MLXLIS_BLAS": "wheel"})
    assert "scipy-openblas32" in name and "+ gemv dispatch" in name
    assert notice == "None" and ok == "True"


def test_bundled_on_request():
    name, notice, ok, _ = probe({"MLXLIS_BLAS": "bundled"})
    assert name == "bundled reference BLAS" and notice == "None" and ok == "True"


@pytest.fixture
def package_without_dispatch(tmp_path) -> Path:
    """A copy of the mlxlis package as an install without a C compiler leaves it."""
    src = Path(mlxlis.__file__).parent
    shutil.copytree(src, tmp_path / "mlxlis", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return tmp_path


def test_without_the_dispatch_everything_works_and_says_so(package_without_dispatch, tiny):
    root = package_without_dispatch
    folder, _ = tiny("llama")
    name, notice, ok, where = probe({"MLXLIS_BLAS": "wheel", "PYTHONPATH": str(root)}, cwd=root)
    assert where.startswith(str(root))  # the copy, not the installed package
    assert name == "bundled reference BLAS" and ok == "True"
    assert "not built" in notice and "slow bundled BLAS" in notice
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxlis",
            "-m",
            str(folder),
            "--no-chat",
            "--max-tokens",
            "3",
            "--verbose",
            "Hello",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
        env={**os.environ, "MLXLIS_BLAS": "wheel", "PYTHONPATH": str(root)},
    )
    assert res.returncode == 0, res.stderr
    notices = [line for line in res.stderr.splitlines() if "notice:" in line]
    assert len(notices) == 1 and "not built" in notices[0], res.stderr
