"""LoRA adapter files, read and checked before anything applies: PEFT's folder
(`adapter_config.json` + `adapter_model.safetensors`, as `peft`'s `save_pretrained` writes it)
and mlx-lm's (`adapter_config.json` + `adapters.safetensors`, as `mlx_lm.lora` writes it).

What PEFT's config says that changes the result is honoured or refused by name: `r` (each
module's rank is its tensors'), `lora_alpha`, `use_rslora` (alpha / √r instead of alpha / r);
DoRA, `fan_in_fan_out`, LoRA biases, per-module alphas, embedding adapters and
`modules_to_save` are refused. mlx-lm's: `fine_tune_type` "lora" (DoRA and full fine-tunes
refused), `lora_parameters.scale` the multiplier itself, its `lora_a` (in, r) and `lora_b`
(r, out) the transposes of PEFT's. Dropout is a training matter, ignored at inference.
llama.cpp's GGUF adapters: loading/lora_gguf.py. A Hugging Face repo name (ORG/NAME, or
ORG/NAME/FILE.gguf) is fetched as models are (loading/hub), adapter files only.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mlxlis.bounded import read_json_file
from mlxlis.errors import AdapterError
from mlxlis.loading.lora_gguf import read_gguf_lora

import mlx.core as mx

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MLX_LM_WEIGHTS = "adapters.safetensors"
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
    weights: Path  # its tensors' file
    layers: dict[str, LoRA]
    rank: int  # the largest
    scale: str  # how its scale is stated: "alpha 16", "alpha 16, rsLoRA", "scale 20"
    base: str | None  # the base model it was trained on, as its config says
    # how `layers` names modules: "hf" (the base checkpoint's, Family.hf.name maps them) or
    # "gguf" (llama.cpp's tensor names, Family.gguf.module_name; B rows in llama.cpp's layout)
    naming: str = "hf"
    arch: str | None = None  # a GGUF adapter's general.architecture (llama.cpp's base arch)
    multiplier: float = 1.0  # on every module's scale (`scaled`: --adapter-scale)

    @property
    def key(self) -> str:
        """Names the adapter's files (path, size, modification time) and its multiplier:
        cache keys include it."""
        st = self.weights.stat()
        text = f"{self.weights}|{st.st_size}|{st.st_mtime_ns}"
        if self.multiplier != 1.0:
            text += f"|x{self.multiplier!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def scaled(self, factor: float) -> Adapter:
        """The adapter with every module's scale times `factor` (llama.cpp's --lora-scaled)."""
        layers = {n: replace(lora, scale=lora.scale * factor) for n, lora in self.layers.items()}
        return replace(self, layers=layers, multiplier=self.multiplier * factor)

    def describe(self) -> str:
        times = f" ×{self.multiplier:g}" if self.multiplier != 1.0 else ""
        what = f"LoRA rank {self.rank}, {self.scale}{times}, {len(self.layers)} modules"
        return f"{self.path.name} ({what})"


REFUSED = {
    "use_dora": "DoRA adapters are not supported (LoRA only)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout) is not supported",
    "lora_bias": "LoRA biases are not supported",
    "alpha_pattern": "per-module alphas are not supported",
    "modules_to_save": "modules saved whole beside the adapter are not supported",
}


def read_adapter(ref: str | Path) -> Adapter:
    """A PEFT or mlx-lm adapter folder, a llama.cpp GGUF adapter file, or a Hugging Face repo
    name of one, checked: an AdapterError naming the file and the field or tensor that is
    wrong (nothing is applied from an adapter that fails)."""
    folder = _local(ref)
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        return _gguf(folder)
    config_path = folder / PEFT_CONFIG
    if not folder.is_dir() or not config_path.is_file():
        raise AdapterError(
            f"expected a folder holding {PEFT_CONFIG} (PEFT's or mlx-lm's) or a llama.cpp "
            "adapter .gguf",
            path=folder,
        )
    cfg = read_json_file(config_path, error=AdapterError, what=PEFT_CONFIG)
    if not isinstance(cfg, dict):
        raise AdapterError("expected a JSON object", path=config_path)
    if (folder / MLX_LM_WEIGHTS).is_file() and not (folder / PEFT_WEIGHTS).is_file():
        return _mlx_lm(folder, cfg, config_path)
    return _peft(folder, cfg, config_path)


def _local(ref: str | Path) -> Path:
    """The path `ref` names: itself when it exists (or is no Hub name), else the adapter's
    files fetched from the Hub into its cache (offline: from the cache alone), as for models."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    from mlxlis.loading import hub

    name = hub.parse_ref(str(ref))
    if name is None or name.quant is not None:
        return path
    return hub.fetch(name, hub.default_progress(), vision=False, adapter=True)


def _gguf(path: Path) -> Adapter:
    pairs, alpha, arch = read_gguf_lora(path)
    layers = _layers(pairs, lambda r: alpha / r, path, transposed=False)  # llama.cpp: alpha / r
    return Adapter(
        path, path, layers, _rank(layers), f"alpha {alpha:g}", None, naming="gguf", arch=arch
    )


def _peft(folder: Path, cfg: dict, config_path: Path) -> Adapter:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError("only LoRA adapters apply", path=config_path, field="peft_type")
    for name, why in REFUSED.items():
        if cfg.get(name) not in (None, False, {}, []):
            raise AdapterError(why, path=config_path, field=name)
    alpha = _positive(cfg.get("lora_alpha"), config_path, "lora_alpha")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(
            f"expected true or false, got {rslora!r}", path=config_path, field="use_rslora"
        )
    weights = folder / PEFT_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"no {PEFT_WEIGHTS} beside {PEFT_CONFIG}", path=folder)

    def scale(r: int) -> float:
        return alpha / math.sqrt(r) if rslora else alpha / r

    pairs = _pairs(_tensors(weights), weights, ("lora_A", "lora_B"), PEFT_PREFIX)
    layers = _layers(pairs, scale, weights, transposed=False)
    base = cfg.get("base_model_name_or_path")
    how = f"alpha {alpha:g}" + (", rsLoRA" if rslora else "")
    return Adapter(folder, weights, layers, _rank(layers), how, _text(base))


def _mlx_lm(folder: Path, cfg: dict, config_path: Path) -> Adapter:
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        what = "DoRA adapters" if kind == "dora" else f"{kind!r} fine-tunes"
        raise AdapterError(
            f"{what} are not supported (LoRA only)", path=config_path, field="fine_tune_type"
        )
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError("expected an object", path=config_path, field="lora_parameters")
    multiplier = _positive(params.get("scale"), config_path, "lora_parameters.scale")
    weights = folder / MLX_LM_WEIGHTS
    pairs = _pairs(_tensors(weights), weights, ("lora_a", "lora_b"), "")
    layers = _layers(pairs, lambda r: multiplier, weights, transposed=True)
    return Adapter(
        folder, weights, layers, _rank(layers), f"scale {multiplier:g}", _text(cfg.get("model"))
    )


def _positive(value: object, path: Path, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"expected a finite number, got {value!r}", path=path, field=field)
    if value <= 0:
        raise AdapterError(f"must be above 0, got {value}", path=path, field=field)
    return float(value)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _rank(layers: dict[str, LoRA]) -> int:
    return max(lo.a.shape[0] for lo in layers.values())


def _tensors(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as e:  # noqa: BLE001 — MLX's reader raises several kinds
        raise AdapterError(f"unreadable safetensors: {e}", path=path) from None


def _pairs(
    tensors: dict[str, mx.array], path: Path, parts: tuple[str, str], prefix: str
) -> dict[str, dict[str, mx.array]]:
    """Module name -> {"a": tensor, "b": tensor}, from PEFT's `M.lora_A.weight` or mlx-lm's
    `M.lora_a`; any other tensor is refused by name."""
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        name = key.removeprefix(prefix)
        for part, which in zip(parts, "ab", strict=True):
            if prefix and f".{part}." in name and name.endswith(".weight"):
                pairs.setdefault(name[: name.index(f".{part}.")], {})[which] = value
                break
            if not prefix and name.endswith(f".{part}"):
                pairs.setdefault(name[: -len(part) - 1], {})[which] = value
                break
        else:
            want = " / ".join(parts)
            raise AdapterError(f"not a LoRA tensor ({want})", path=path, field=key)
    if not pairs:
        raise AdapterError("no LoRA tensors", path=path)
    return pairs


def _layers(
    pairs: dict[str, dict[str, mx.array]],
    scale: Callable[[int], float],
    path: Path,
    transposed: bool,
) -> dict[str, LoRA]:
    """Each module's LoRA, A (r, in) and B (out, r) (mlx-lm keeps their transposes), checked:
    both present, a pair of one rank above 0, floats."""
    out = {}
    for module, ab in sorted(pairs.items()):  # checked and reported in the file's name order
        a, b = ab.get("a"), ab.get("b")
        if a is None or b is None:
            missing = "A" if a is None else "B"
            raise AdapterError(f"its lora_{missing} is missing", path=path, field=module)
        if a.ndim != 2 or b.ndim != 2:
            raise AdapterError("expected 2-D lora tensors", path=path, field=module)
        if transposed:  # mlx-lm: lora_a (in, r), lora_b (r, out)
            a, b = a.T, b.T
        if a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"A {tuple(a.shape)} and B {tuple(b.shape)} are not a pair of rank r "
                "((r, in) and (out, r))",
                path=path,
                field=module,
            )
        r = a.shape[0]
        if r == 0:
            raise AdapterError("rank 0", path=path, field=module)
        if not (mx.issubdtype(a.dtype, mx.floating) and mx.issubdtype(b.dtype, mx.floating)):
            raise AdapterError(f"expected float tensors, got {a.dtype}", path=path, field=module)
        out[module] = LoRA(a, b, scale(r))
    # read now: a lazy array read on this thread cannot be evaluated on another's stream
    mx.eval([(lo.a, lo.b) for lo in out.values()])
    return out
