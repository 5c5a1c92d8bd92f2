"""Build step for the one compiled piece: the Linux CPU BLAS dispatch
(mlxlis/runtime/_blas_dispatch.c and its batch kernel, _skinny_gemm.c).

Optional: without a C compiler the package installs without it and CPU decoding runs through
MLX's plain sgemm path (slower, same results). Everything else lives in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

ext = [
    Extension(
        "mlxlis.runtime._blas_dispatch",
        sources=["mlxlis/runtime/_blas_dispatch.c", "mlxlis/runtime/_skinny_gemm.c"],
        depends=["mlxlis/runtime/_skinny_gemm.h"],
        extra_compile_args=["-O2"],
        libraries=["dl", "pthread"],
        optional=True,
    )
]
setup(ext_modules=ext if sys.platform.startswith("linux") else [])
