"""llama.cpp's LoRA adapters: a GGUF file as `convert_lora_to_gguf.py` writes it, read and
checked (loading/adapters.py makes the Adapter of it).

The file: `general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha` (float32),
`general.architecture` the base's llama.cpp architecture, and per adapted module two tensors
under the base's llama.cpp tensor name, `<name>.lora_a` and `<name>.lora_b`. In ggml order
lora_a is (in, r) and lora_b (r, out), so in row-major order A is (r, in) and B (out, r):
PEFT's own orientation. llama.cpp scales by alpha / r, r being lora_b's ggml ne[0] (its
columns here). What the base's converter folds into a weight's rows (Llama's q/k permute) it
folds into B's rows too; that is undone where the base's names are known (models/lora.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from mlxlis.errors import AdapterError, MlxlisError
from mlxlis.loading.gguf import GGUFFile
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.loading.quants import convert_tensor

import mlx.core as mx

# the tensor types convert_lora_to_gguf writes (--outtype f32 / f16 / bf16 / q8_0)
FLOAT_TYPES = ("F32", "F16", "BF16", "Q8_0")
PARTS = {"lora_a": "a", "lora_b": "b"}


def read_gguf_lora(path: Path) -> tuple[dict[str, dict[str, mx.array]], float, str]:
    """(module name -> {"a": A (r, in), "b": B (out, r)} in float32, alpha, architecture),
    module names being llama.cpp's tensor names without `.weight` ("blk.0.attn_q"). Every
    failure an AdapterError naming the file and the field or tensor."""
    try:
        with read_gguf(path) as gf:
            md = gf.metadata
            _expect(md, "general.type", "adapter", path)
            _expect(md, "adapter.type", "lora", path)
            if "adapter.alora.invocation_tokens" in md:
                raise AdapterError(
                    "activated LoRA (aLoRA: applies only after its invocation tokens) is not "
                    "supported",
                    path=path,
                    field="adapter.alora.invocation_tokens",
                )
            alpha = _alpha(md.get("adapter.lora.alpha"), path)
            arch = md.get("general.architecture")
            if not isinstance(arch, str) or not arch:
                raise AdapterError(
                    "expected the base's architecture", path=path, field="general.architecture"
                )
            return _pairs(gf, path), alpha, arch
    except AdapterError:
        raise
    except MlxlisError as e:  # a truncated or malformed file: the reader names the field
        raise AdapterError(e.message, path=path, field=e.field) from None


def _expect(md: dict, key: str, want: str, path: Path) -> None:
    got = md.get(key)
    if got != want:
        raise AdapterError(
            f"expected {want!r}, got {got!r} (a llama.cpp LoRA adapter says so)",
            path=path,
            field=key,
        )


def _alpha(value: object, path: Path) -> float:
    """alpha > 0, finite (llama.cpp reads a missing one as 0 and then scales by 1 instead of
    alpha / r: a file that states none is refused rather than guessed)."""
    field = "adapter.lora.alpha"
    if value is None:
        raise AdapterError("missing (the scale is alpha / r)", path=path, field=field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"expected a finite number, got {value!r}", path=path, field=field)
    if value <= 0:
        raise AdapterError(f"must be above 0, got {value}", path=path, field=field)
    return float(value)


def _pairs(gf: GGUFFile, path: Path) -> dict[str, dict[str, mx.array]]:
    pairs: dict[str, dict[str, mx.array]] = {}
    for name, t in gf.tensors.items():
        base, _, part = name.rpartition(".")
        if part not in PARTS or not base.endswith(".weight"):
            raise AdapterError(
                "not a LoRA tensor (NAME.weight.lora_a / .lora_b)", path=path, field=name
            )
        module = base.removesuffix(".weight")
        if module == "token_embd":
            raise AdapterError("embedding adapters are not supported", path=path, field=name)
        if t.type_name not in FLOAT_TYPES:
            raise AdapterError(
                f"expected a float tensor ({', '.join(FLOAT_TYPES)}), got {t.type_name}",
                path=path,
                field=name,
            )
        if len(t.shape) != 2:
            raise AdapterError(f"expected a 2-D tensor, got {t.shape}", path=path, field=name)
        conv = convert_tensor(t, gf.raw(name), mx.float32, dequantize=True, path=str(path))
        pairs.setdefault(module, {})[PARTS[part]] = conv.weight  # (r, in) or (out, r)
    if not pairs:
        raise AdapterError("no LoRA tensors", path=path)
    return pairs
