"""LoRA adapter files, read and checked before anything applies: PEFT's folder
(`adapter_config.json` + `adapter_model.safetensors`, as `peft`'s `save_pretrained` writes it).

What PEFT's config says that changes the result is honoured or refused by name: `r` (each
module's rank is its tensors'), `lora_alpha`, `use_rslora` (alpha / √r instead of alpha / r);
DoRA, `fan_in_fan_out`, LoRA biases, per-module alphas, embedding adapters and
`modules_to_save` are refused. Dropout is a training matter, ignored at inference.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from mlxlis.bounded import read_json_file
from mlxlis.errors import AdapterError

import mlx.core as mx

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's wrapper around the base model's own module names


@dataclass(frozen=True)
class LoRA:
    """One module's adapter: a (r, in), b (out, r), the scale s (alpha / r, or alpha / √r
    with rsLoRA): y = W x + s · B (A x)."""

    a: mx.array
    b: mx.array
    scale: float


@dataclass(frozen=True)
class Adapter:
    """An adapter read from `path`: its LoRAs by the base checkpoint's module name."""

    path: Path
    layers: dict[str, LoRA]
    rank: int  # the largest
    alpha: float
    rslora: bool
    base: str | None  # the base model it was trained on, as its config says

    @property
    def key(self) -> str:
        """Names the adapter's files (path, size, modification time): cache keys include it."""
        st = (self.path / PEFT_WEIGHTS).stat()
        text = f"{self.path}|{st.st_size}|{st.st_mtime_ns}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        rs = ", rsLoRA" if self.rslora else ""
        what = f"LoRA rank {self.rank}, alpha {self.alpha:g}{rs}, {len(self.layers)} modules"
        return f"{self.path.name} ({what})"


REFUSED = {
    "use_dora": "DoRA adapters are not supported (LoRA only)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout) is not supported",
    "lora_bias": "LoRA biases are not supported",
    "alpha_pattern": "per-module alphas are not supported",
    "modules_to_save": "modules saved whole beside the adapter are not supported",
}


def read_adapter(ref: str | Path) -> Adapter:
    """A PEFT adapter folder, checked: an AdapterError naming the file and the field or tensor
    that is wrong (nothing is applied from an adapter that fails)."""
    folder = Path(ref).expanduser()
    config_path, weights = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not folder.is_dir() or not config_path.is_file():
        raise AdapterError(f"expected a folder holding {PEFT_CONFIG} (PEFT's)", path=folder)
    cfg = read_json_file(config_path, error=AdapterError, what=PEFT_CONFIG)
    if not isinstance(cfg, dict):
        raise AdapterError("expected a JSON object", path=config_path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError("only LoRA adapters apply", path=config_path, field="peft_type")
    for name, why in REFUSED.items():
        if cfg.get(name) not in (None, False, {}, []):
            raise AdapterError(why, path=config_path, field=name)
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(
            f"expected a finite number, got {alpha!r}", path=config_path, field="lora_alpha"
        )
    if alpha <= 0:
        raise AdapterError(f"must be above 0, got {alpha}", path=config_path, field="lora_alpha")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(
            f"expected true or false, got {rslora!r}", path=config_path, field="use_rslora"
        )
    if not weights.is_file():
        raise AdapterError(f"no {PEFT_WEIGHTS} beside {PEFT_CONFIG}", path=folder)
    try:
        tensors = mx.load(str(weights))
    except Exception as e:  # noqa: BLE001 — MLX's reader raises several kinds
        raise AdapterError(f"unreadable safetensors: {e}", path=weights) from None
    layers = _layers(tensors, float(alpha), rslora, weights)
    base = cfg.get("base_model_name_or_path")
    return Adapter(
        folder,
        layers,
        max(lo.a.shape[0] for lo in layers.values()),
        float(alpha),
        rslora,
        base if isinstance(base, str) else None,
    )


def _layers(
    tensors: dict[str, mx.array], alpha: float, rslora: bool, path: Path
) -> dict[str, LoRA]:
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            if f".{part}." in name and name.endswith(".weight"):
                module = name[: name.index(f".{part}.")]
                pairs.setdefault(module, {})[part] = value
                break
        else:
            raise AdapterError("not a LoRA tensor (lora_A / lora_B weights)", path=path, field=key)
    if not pairs:
        raise AdapterError("no LoRA tensors", path=path)
    out = {}
    for module, ab in sorted(pairs.items()):  # checked and reported in the file's name order
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            missing = "lora_A" if a is None else "lora_B"
            raise AdapterError(f"{missing} is missing", path=path, field=module)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a pair of rank r "
                "(r, in) and (out, r)",
                path=path,
                field=module,
            )
        r = a.shape[0]
        if r == 0:
            raise AdapterError("rank 0", path=path, field=module)
        if not (mx.issubdtype(a.dtype, mx.floating) and mx.issubdtype(b.dtype, mx.floating)):
            raise AdapterError(f"expected float tensors, got {a.dtype}", path=path, field=module)
        out[module] = LoRA(a, b, alpha / math.sqrt(r) if rslora else alpha / r)
    return out
