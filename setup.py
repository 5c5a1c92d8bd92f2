"""Build step for the one compiled piece: the Linux CPU gemv dispatch (mlxlis/_blas_dispatch.c).

Optional: without a C compiler the package installs without it and CPU decoding runs through
MLX's plain sgemm path (slower, same results). Everything else lives in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

ext = [
    Extension(
        "mlxlis._blas_dispatch",
        sources=["mlxlis/_blas_dispatch.c"],
        extra_compile_args=["-O2"],
        libraries=["dl"],
        optional=True,
    )
]
setup(ext_modules=ext if sys.platform.startswith("linux") else [])
