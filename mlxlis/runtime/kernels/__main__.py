"""`python -m mlxlis.runtime.kernels`: build (or find) the CPU kernels and say which run."""

import sys

from mlxlis.runtime import kernels

if __name__ == "__main__":
    if not sys.platform.startswith("linux"):
        print("qmv: nothing to build here (Metal runs MLX's own quantized kernels)")
        sys.exit(0)
    print(f"qmv: {kernels.describe(build=True)}")
