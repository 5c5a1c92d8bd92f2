"""What a server can serve, by name: each model's reference, size on disk and details, known
before it is loaded (for /v1/models, /api/tags, and the memory check before a load).

`mlxlis serve -m REF` (or `-m NAME=REF`, several times) serves what it names; without `-m`,
every model on the disk: the catalog's pulled models, the Hugging Face cache (what `mlxlis
models` lists) and the files and folders of each `--models-dir`. `--alias NAME=REF` adds a
name clients already use (a Claude model name for a local model). `--adapter
[MODEL:]NAME=PATH` lists a LoRA adapter on a served model as `MODEL:NAME` (and `NAME`, unless
a model has that name): the model with that adapter chosen for every request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mlxlis.errors import ConfigError, MlxlisError
from mlxlis.loading import catalog
from mlxlis.loading.adapters import Adapter
from mlxlis.loading.gguf import peek_metadata
from mlxlis.loading.gguf_split import SPLIT_NAME
from mlxlis.loading.hub.store import cached_models, folder_details
from mlxlis.loading.resolve import resolve

GGUF_FAMILY = "general.architecture"


@dataclass(frozen=True)
class Listing:
    name: str  # what requests name it by, and /v1/models lists
    ref: str  # what mlxlis.load opens
    size: int | None = None  # its weight files' bytes; None until a Hub model is fetched
    family: str = ""  # config.json's model_type / the GGUF's architecture
    quant: str = ""  # "Q4_K_M", "4-bit g64", "bfloat16"; "" when unknown
    format: str = ""  # "gguf", "safetensors"
    path: Path | None = None  # its files, where known without a download
    base: str = ""  # an adapter's: the name of the model it runs on ("": a model)
    adapter: str = ""  # an adapter's: its name on that model


def weights_bytes(path: Path) -> int:
    """The weights' files: a folder's safetensors, a GGUF file (every part of a split one)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return path.stat().st_size
    prefix = m["prefix"]
    return sum(
        p.stat().st_size
        for p in path.parent.iterdir()
        if p.name.startswith(prefix + "-") and p.name.endswith(f"-of-{m['count']}.gguf")
    )


def describe(name: str, ref: str, path: Path) -> Listing:
    """A listing of the files at `path`: size, format, family and quantization as the files
    say them (an unreadable header leaves the details empty; loading says what is wrong)."""
    if path.is_dir():
        _, quant, family = folder_details(path)
        return Listing(name, ref, weights_bytes(path), family, quant, "safetensors", path)
    family = quant = ""
    try:
        family = str(peek_metadata(path, [GGUF_FAMILY]).get(GGUF_FAMILY, ""))
        quant = file_type(path) or ""
    except Exception:  # noqa: BLE001, S110 — listed all the same; the load names the fault
        pass
    return Listing(name, ref, weights_bytes(path), family, quant, "gguf", path)


def file_type(path: Path) -> str | None:
    """A GGUF's file type as llama.cpp (and Ollama) name it, Q4_K_M, when the file says."""
    from gguf import LlamaFileType  # gguf-py's constants take 0.7 s to import

    ftype = peek_metadata(path, ["general.file_type"]).get("general.file_type")
    try:
        return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return None


def named(text: str, field: str = "-m") -> tuple[str, str]:
    """`NAME=REF` or `REF` -> (name, ref); a path's name is its last part."""
    name, sep, ref = text.partition("=")
    if sep and name and ref and "/" not in name and not Path(text).exists():
        return name, ref
    if sep and not (name and ref):
        raise ConfigError(f"expected NAME=REF or REF, got {text!r}", field=field)
    ref = text
    return (os.path.basename(os.path.normpath(ref)) if os.path.exists(ref) else ref), ref


def of_ref(name: str, ref: str) -> Listing:
    """A listing for `ref` (a path, a catalog name, a Hub or scanned name), its size known
    where its files are on the disk already (nothing is downloaded here)."""
    try:
        path = resolve(ref, pull=False)
    except MlxlisError:
        return Listing(name, ref)  # fetched when first loaded
    return describe(name, ref, path)


def on_disk(models_dirs: list[Path], stores: bool = True) -> list[Listing]:
    """The GGUF files and safetensors folders in each of `models_dirs` (named by file or
    folder), after (`stores`) the catalog's pulled models and the Hugging Face cache's."""
    out: list[Listing] = []
    if stores:
        out += [
            describe(name, name, catalog.model_path(name))
            for name in catalog.CATALOG
            if catalog.is_pulled(name)
        ]
        out += [
            Listing(e.name, e.name, e.size, e.family, e.quant, e.format.split()[0], e.path)
            for e in cached_models()
        ]
    for folder in models_dirs:
        if not folder.is_dir():
            raise ConfigError(f"not a folder: {folder}", field="--models-dir")
        for p in sorted(folder.iterdir()):
            first_part = SPLIT_NAME.match(p.name) is None or "-00001-of-" in p.name
            if p.is_file() and p.suffix == ".gguf" and first_part and "mmproj" not in p.name:
                out.append(describe(p.stem, str(p), p))
            elif p.is_dir() and (p / "config.json").is_file():
                out.append(describe(p.name, str(p), p))
    return out


def table(listings: list[Listing], aliases: dict[str, str]) -> dict[str, Listing]:
    """Every name a request may use -> its listing: each listing's name, its path, and the
    aliases (an alias's REF is a listed name, or a reference of its own). The first listing
    of a name, or of the same files, wins (-m before the disk's): one model, one load."""
    out: dict[str, Listing] = {}
    for x in listings:
        same = out.get(str(x.path)) if x.path is not None else None
        out.setdefault(x.name, same or x)  # the same files listed again: another name
        if x.path is not None:
            out.setdefault(str(x.path), x)
    for alias, ref in aliases.items():
        target = out.get(ref) or of_ref(ref, ref)
        out.setdefault(target.name, target)
        out[alias] = target
    return out


def adapter_listings(base: Listing, adapters: dict[str, Adapter]) -> list[Listing]:
    """A listing per adapter of `base`, named BASE:NAME: its own file's size and path, the
    base's family and quantization."""
    return [
        Listing(
            f"{base.name}:{name}",
            base.ref,
            adapter.weights.stat().st_size,
            base.family,
            base.quant,
            "lora",
            adapter.path,
            base=base.name,
            adapter=name,
        )
        for name, adapter in adapters.items()
    ]


def with_adapters(names: dict[str, Listing], adapters: dict[str, dict[str, Adapter]]) -> None:
    """Each adapter's listing added to `names` (`adapters`: model name -> adapter name ->
    adapter) as MODEL:NAME, and as NAME where no model or other adapter has that name."""
    listed = {x.name: x for x in names.values()}  # each listing once, by its own name
    short: dict[str, list[Listing]] = {}
    for model, own in adapters.items():
        for x in adapter_listings(listed[model], own):
            names[x.name] = x
            short.setdefault(x.adapter, []).append(x)
    for name, xs in short.items():
        if len(xs) == 1:
            names.setdefault(name, xs[0])
