"""Sizes of `mlxlis convert` output against the GGUF and against `mlx_lm.convert -q`.

usage: python scripts/convert_sizes.py NAME [NAME ...]   (catalog names; run `make bench` first:
the 4-bit mlx-lm conversion starts from the bench's fp16 copy in ~/.cache/mlxlis/bench)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mlxlis import load
from mlxlis.commands.convert import convert
from mlxlis.loading import catalog

from mlx.utils import tree_flatten


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main(names: list[str]) -> None:
    from mlx_lm import convert as mlx_lm_convert

    root = Path(tempfile.mkdtemp(prefix="mlxlis-sizes-"))
    for name in names:
        ours = convert(name, root / f"{name}-mlxlis", dtype="float32")
        model = load(ours, "float32", dequantize=False)
        in_memory = sum(v.nbytes for _, v in tree_flatten(model.net.parameters()))
        fp16 = catalog.store_dir().parent / "bench" / f"{name}-float16"
        theirs = root / f"{name}-mlx-lm-q4"
        mlx_lm_convert(str(fp16), str(theirs), quantize=True, q_bits=4, q_group_size=64)
        print(
            f"{name}: GGUF {catalog.model_path(name).stat().st_size / 1e6:.0f} MB | "
            f"mlxlis convert {safetensors_bytes(ours) / 1e6:.0f} MB on disk, "
            f"{in_memory / 1e6:.0f} MB in memory | mlx_lm.convert -q (4-bit, g64) "
            f"{safetensors_bytes(theirs) / 1e6:.0f} MB on disk",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:] or catalog.default_names())
