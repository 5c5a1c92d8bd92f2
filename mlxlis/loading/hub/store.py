"""The models already on the disk: the Hugging Face cache (`mlxlis models`, `mlxlis rm`) and,
with `--scan`, the GGUF files of LM Studio and llama.cpp.

Scanned folders: LM Studio's `~/.lmstudio/models` and `~/.cache/lm-studio/models` (or the
folders in $MLXLIS_LMSTUDIO_MODELS, separated by os.pathsep), llama.cpp's cache ($LLAMA_CACHE,
else `~/Library/Caches/llama.cpp` and `~/.cache/llama.cpp`). A scanned model is listed as
`lmstudio:PUBLISHER/REPO/FILE.gguf` or `llama.cpp:FILE.gguf`, the name `-m` opens.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mlxlis.errors import AmbiguousModelError, HubError, ModelNotFoundError, UnsupportedError
from mlxlis.loading.hub.fetch import cache_root, repo_folder
from mlxlis.loading.hub.refs import HubRef
from mlxlis.loading.hub.select import FOLDER_FILES, GGUFModel, choice, gguf_models, select
from mlxlis.settings import settings

FAMILY_KEY = "general.architecture"


@dataclass(frozen=True)
class Entry:
    name: str  # what `-m` takes
    format: str  # "gguf", "safetensors", "safetensors (MLX quantized)"
    quant: str  # "Q4_K_M", "4-bit g64", "bfloat16", "" when unknown
    size: int  # bytes
    family: str  # the model type / GGUF architecture, "" when unknown
    path: Path  # what it opens


def cached_models() -> list[Entry]:
    """The loadable models in the Hugging Face cache: one entry per safetensors snapshot and
    one per GGUF model (quant) in a snapshot."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_root())
    except CacheNotFound:
        return []
    out: list[Entry] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            refs = sorted(rev.refs)
            if not refs and any(r.refs for r in repo.revisions):
                continue  # an older snapshot no branch points to any more
            suffix = "" if "main" in refs else f"@{refs[0] if refs else rev.commit_hash}"
            out += _snapshot_entries(repo.repo_id, suffix, Path(rev.snapshot_path))
    return out


def _snapshot_entries(repo_id: str, suffix: str, snapshot: Path) -> list[Entry]:
    listing = {
        p.relative_to(snapshot).as_posix(): p.stat().st_size
        for p in snapshot.rglob("*")
        if p.is_file()
    }
    out = []
    top = {p for p in listing if "/" not in p}
    if "config.json" in top and any(p.endswith(".safetensors") for p in top):
        size = sum(listing[p] for p in top if p.endswith(".safetensors") or p in FOLDER_FILES)
        fmt, quant, family = folder_details(snapshot)
        out.append(Entry(repo_id + suffix, fmt, quant, size, family, snapshot))
    models = gguf_models(listing)
    for m in models:
        if len(m.files) != m.count:
            continue  # a split model with parts missing: not loadable
        out.append(_gguf_entry(choice(repo_id, m, models) + suffix, m, snapshot, listing))
    return out


def _gguf_entry(name: str, m: GGUFModel, root: Path, listing: dict[str, int]) -> Entry:
    from mlxlis.loading.gguf import peek_metadata

    first = root / m.files[0]
    try:
        family = str(peek_metadata(first, [FAMILY_KEY]).get(FAMILY_KEY, ""))
    except Exception:  # noqa: BLE001 — an unreadable file still gets listed
        family = "?"
    return Entry(name, "gguf", m.label or "", sum(listing[f] for f in m.files), family, first)


def folder_details(folder: Path) -> tuple[str, str, str]:
    """A safetensors folder's (format, quantization, family) as its config.json says them;
    the family "?" when config.json is unreadable."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "safetensors", "", "?"
    if not isinstance(cfg, dict):
        return "safetensors", "", "?"
    q = cfg.get("quantization") or cfg.get("quantization_config")
    family = str(cfg.get("model_type", ""))
    if isinstance(q, dict) and "bits" in q:
        return "safetensors (MLX quantized)", f"{q['bits']}-bit g{q.get('group_size', '?')}", family
    return "safetensors", str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), family


# --- scanned folders -------------------------------------------------------------------------


def scan_roots() -> list[tuple[str, Path]]:
    """(label, folder) of every folder `--scan` looks in, existing or not."""
    home = Path.home()
    if (folders := settings().lmstudio_models) is not None:
        lms = list(folders)
    else:
        lms = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    if os.environ.get("LLAMA_CACHE"):
        llama = [Path(os.environ["LLAMA_CACHE"]).expanduser()]
    else:
        xdg = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
        llama = [home / "Library" / "Caches" / "llama.cpp", xdg / "llama.cpp"]
    return [("lmstudio", p) for p in lms] + [("llama.cpp", p) for p in llama]


def scanned_models(extra: list[Path] | None = None) -> list[Entry]:
    """The GGUF models in the scanned folders (and in `extra` folders, named by path)."""
    out: list[Entry] = []
    roots = scan_roots() + [("", Path(p).expanduser().resolve()) for p in extra or ()]
    for label, root in roots:
        if not root.is_dir():
            continue
        listing = {
            p.relative_to(root).as_posix(): p.stat().st_size
            for p in sorted(root.rglob("*.gguf"))
            if p.is_file()
        }
        for m in gguf_models(listing):
            if len(m.files) == m.count:
                name = f"{label}:{m.files[0]}" if label else str(root / m.files[0])
                out.append(_gguf_entry(name, m, root, listing))
    return out


def scanned_path(name: str) -> Path | None:
    """The file a scanned name (`lmstudio:…`, `llama.cpp:…`) stands for; None when `name` is
    not of that form."""
    label, sep, rel = name.partition(":")
    if not sep or label not in ("lmstudio", "llama.cpp"):
        return None
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts:
        raise ModelNotFoundError("expected a path inside the scanned folder", path=name)
    roots = [root for lab, root in scan_roots() if lab == label]
    for root in roots:
        if (root / rel).is_file():
            return root / rel
    where = ", ".join(str(r) for r in roots)
    raise ModelNotFoundError(
        f"no such file in {where} (mlxlis models --scan lists them)", path=name
    )


# --- removal --------------------------------------------------------------------------------


def remove(ref: HubRef) -> tuple[int, list[str]]:
    """Delete what `ref` names from the cache: the whole repo (ORG/NAME), one revision
    (@REV), or the files of one GGUF model (:QUANT or /FILE.gguf) in every cached revision.
    Returns (bytes freed, what was removed)."""
    from huggingface_hub import scan_cache_dir

    folder = repo_folder(ref.repo_id)
    repo = (
        next((r for r in scan_cache_dir(cache_root()).repos if r.repo_path == folder), None)
        if folder.is_dir()
        else None
    )
    if repo is None:
        raise ModelNotFoundError(f"not in the Hugging Face cache ({cache_root()})", path=str(ref))
    revs = [
        r
        for r in repo.revisions
        if ref.revision is None or ref.revision in r.refs or r.commit_hash == ref.revision
    ]
    if not revs:
        raise ModelNotFoundError(f"no cached revision {ref.revision}", path=str(ref))
    if ref.quant is None and ref.filename is None:
        strategy = scan_cache_dir(cache_root()).delete_revisions(*(r.commit_hash for r in revs))
        strategy.execute()
        what = [f"{ref.repo_id}@{r.commit_hash[:12]}" for r in revs]
        return strategy.expected_freed_size, what
    return _remove_gguf(ref, revs)


def _remove_gguf(ref: HubRef, revs) -> tuple[int, list[str]]:
    freed, removed = 0, []
    for rev in revs:
        snapshot = Path(rev.snapshot_path)
        listing = {
            p.relative_to(snapshot).as_posix(): 0
            for p in snapshot.rglob("*")
            if p.is_file() or p.is_symlink()
        }
        try:
            sel = select(ref, listing)
        except AmbiguousModelError:
            raise
        except HubError:  # this revision holds no such file
            continue
        for f in sel.files:
            pointer = snapshot / f
            blob = pointer.resolve()
            pointer.unlink()
            removed.append(f"{ref.repo_id}/{f}@{rev.commit_hash[:12]}")
            if blob.is_file() and not _linked(blob, Path(rev.snapshot_path).parents[1]):
                freed += blob.stat().st_size
                blob.unlink()
    if not removed:
        raise ModelNotFoundError("no such GGUF file in the cache", path=str(ref))
    return freed, removed


def _linked(blob: Path, storage: Path) -> bool:
    """Whether a snapshot of the repo still points at `blob`."""
    return any(p.is_symlink() and p.resolve() == blob for p in (storage / "snapshots").rglob("*"))


def remove_catalog(name: str) -> int:
    from mlxlis.loading import catalog

    path = catalog.model_path(name)
    if not catalog.is_pulled(name):
        raise ModelNotFoundError("catalog model not pulled", path=name)
    if path.is_dir():  # an unpacked folder (a sentence-transformers model)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path)
        return size
    size = path.stat().st_size
    path.unlink()
    return size


def refuse_scanned(name: str) -> None:
    raise UnsupportedError(
        "a file of LM Studio or llama.cpp; mlxlis removes only what is in "
        "the Hugging Face cache or its own store",
        path=name,
    )
