"""A Hub reference to local files, through huggingface_hub and its cache.

Online: one listing call (`HfApi.model_info`, with each file's size and LFS SHA-256) picks the
files (select.py); those already in the snapshot are used as they are, the others downloaded
into the same cache transformers and mlx-lm use (HF_HOME / HF_HUB_CACHE; models--ORG--NAME/
blobs, snapshots/COMMIT, refs/REVISION). Offline (HF_HUB_OFFLINE) or with the Hub unreachable,
the snapshot of the revision is read from the cache with no network call at all.

LFS files over plain HTTP are written here, not by `hf_hub_download`: huggingface_hub 2.x deletes
a partial download (its temporary name is unique per process), so an interrupted multi-GB file
would start again from zero. Here the partial file is the blob's `.incomplete`, kept on
Ctrl+C or a dropped connection, resumed with a Range request by the next run, and its SHA-256
checked against the Hub's before it becomes the blob; `hf_hub_download` then links the blob into
the snapshot (it finds it present). Xet-stored files take the hub's own Xet transfer when hf_xet
is installed and are checked after it. The hub checks no hash itself.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

from mlxlis.errors import (
    DiskFullError,
    HubError,
    IntegrityError,
    MlxlisError,
    NotCachedError,
    RepoAccessError,
)
from mlxlis.loading.hub.progress import Progress, bar_class
from mlxlis.loading.hub.refs import COMMIT, HubRef
from mlxlis.loading.hub.select import INDEX, Selection, select

LIBRARY = {"library_name": "mlxlis"}


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder(repo_id: str) -> Path:
    """The repo's folder in the cache (huggingface_hub's layout)."""
    return cache_root() / ("models--" + repo_id.replace("/", "--"))


def fetch(
    ref: HubRef, progress: Progress | None = None, vision: bool = True, adapter: bool = False
) -> Path:
    """The local path of what `ref` names (a snapshot folder or a GGUF file), downloading
    what the cache lacks (`vision` False: not a GGUF's mmproj; `adapter`: a LoRA adapter's
    files, select.py). Offline, or with the Hub unreachable, from the cache alone."""
    import httpx2  # the Hub library's HTTP client: how an unreachable endpoint shows
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        return from_cache(ref, "HF_HUB_OFFLINE is set", adapter)
    try:
        info = HfApi(**LIBRARY).model_info(ref.repo_id, revision=ref.rev, files_metadata=True)
    except httpx2.TransportError as e:  # no network, or the endpoint is down: as the hub does
        reason = f"{constants.ENDPOINT} cannot be reached ({type(e).__name__})"
        return from_cache(ref, reason, adapter)
    except Exception as e:  # noqa: BLE001 — the hub's HTTP errors, mapped to one line each
        status = getattr(getattr(e, "response", None), "status_code", 0) or 0
        if status >= 500 or status == 429:  # the Hub is down or busy: the cache, as the hub does
            return from_cache(ref, f"{constants.ENDPOINT} answered HTTP {status}", adapter)
        raise hub_error(e, ref) from None
    siblings = {s.rfilename: s for s in info.siblings or ()}
    listing = {name: s.size for name, s in siblings.items()}
    commit = info.sha
    if not commit or not COMMIT.match(commit):
        raise HubError(f"the Hub gave no commit for revision {ref.rev}", path=str(ref))
    storage = repo_folder(ref.repo_id)
    bar = bar_class(progress) if progress is not None else None
    sel = select(ref, listing, vision=vision, adapter=adapter)
    if sel.needs_index:
        _fetch_files(ref, commit, sel.files, siblings, bar)
        sel = select(ref, listing, _shards(storage / "snapshots" / commit / INDEX), vision)
    _fetch_files(ref, commit, sel.files, siblings, bar)
    _write_ref(storage, ref.rev, commit)
    return _target(storage / "snapshots" / commit, sel, ref)


def from_cache(ref: HubRef, reason: str, adapter: bool = False) -> Path:
    """What `ref` names in the cache (`adapter`: a LoRA adapter's files), with no network
    call; NotCachedError saying what is missing and how to fetch it."""
    storage = repo_folder(ref.repo_id)
    fix = "load it once with network access" if adapter else f"mlxlis pull {ref}"
    hint = f"{reason}; fetch it with network access: {fix}"
    commit = ref.rev if COMMIT.match(ref.rev) else _read_ref(storage, ref.rev)
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        what = "the repo" if not storage.is_dir() else f"revision {ref.rev} of the repo"
        raise NotCachedError(
            f"{what} is not in the Hugging Face cache ({cache_root()}); {hint}", path=str(ref)
        )
    listing = {
        p.relative_to(snapshot).as_posix(): p.stat().st_size
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    }
    sel = select(ref, listing, adapter=adapter)
    if sel.needs_index:
        shards = _shards(snapshot / INDEX)
        lacking = sorted(set(shards) - listing.keys())
        if lacking:
            raise NotCachedError(
                f"the cached snapshot lacks {', '.join(lacking)}; {hint}", path=str(ref)
            )
        sel = select(ref, listing, shards)
    return _target(snapshot, sel, ref)


def hub_error(e: Exception, ref: HubRef) -> MlxlisError:
    """One clear line for an error from huggingface_hub."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = str(ref)
    if isinstance(e, MlxlisError):
        return e
    if isinstance(e, GatedRepoError):
        return RepoAccessError(
            f"gated repo: accept its terms at https://huggingface.co/{ref.repo_id} and set "
            "HF_TOKEN (or run `hf auth login`) with a token of that account",
            path=where,
        )
    if isinstance(e, RepositoryNotFoundError):
        return RepoAccessError(
            "no such model repo on the Hugging Face Hub (nor a file or folder here); if it is "
            "private, set HF_TOKEN (or run `hf auth login`)",
            path=where,
        )
    if isinstance(e, RevisionNotFoundError):
        return RepoAccessError(f"the repo has no revision {ref.rev}", path=where)
    if isinstance(e, RemoteEntryNotFoundError):
        return HubError("a file the listing names is missing on the Hub", path=where)
    if isinstance(e, LocalEntryNotFoundError):
        return NotCachedError(
            f"not in the Hugging Face cache and the Hub cannot be reached; "
            f"fetch it with network access: mlxlis pull {ref}",
            path=where,
        )
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return HubError(f"the Hub answered HTTP {status}", path=where)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return DiskFullError(f"no space left on the device of {cache_root()}", path=where)
    name = type(e).__name__
    return HubError(
        f"download failed ({name}: {str(e).splitlines()[0] if str(e) else name}); "
        "run again to resume",
        path=where,
    )


def _target(snapshot: Path, sel: Selection, ref: HubRef) -> Path:
    path = snapshot / sel.target if sel.target else snapshot
    if not path.exists():
        raise NotCachedError(
            f"{sel.target or 'the snapshot'} is not in the cache; mlxlis pull {ref}", path=str(ref)
        )
    return path


def _shards(index: Path) -> list[str]:
    from mlxlis import limits
    from mlxlis.bounded import read_json_file
    from mlxlis.errors import FileFormatError

    data = read_json_file(index, limits.INDEX_JSON_MAX_BYTES, FileFormatError, what=INDEX)
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise FileFormatError(
            "invalid index (needs a weight_map object of file names)",
            path=index,
            field="weight_map",
        )
    return sorted(set(wmap.values()))


def _read_ref(storage: Path, rev: str) -> str | None:
    try:
        commit = (storage / "refs" / rev).read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.match(commit) else None


def _write_ref(storage: Path, rev: str, commit: str) -> None:
    """refs/REV -> commit, as the hub writes it, so an offline run finds this revision."""
    if COMMIT.match(rev) or _read_ref(storage, rev) == commit:
        return
    path = storage / "refs" / rev
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, path)


def _fetch_files(ref: HubRef, commit: str, files: tuple[str, ...], siblings: dict, bar) -> None:
    from huggingface_hub import hf_hub_download

    snapshot = repo_folder(ref.repo_id) / "snapshots" / commit
    for name in files:
        if (snapshot / name).is_file():
            continue  # in the cache already (a pointer resolves only to a complete blob)
        lfs = siblings[name].lfs
        try:
            if lfs is None:  # small git files: the hub's download as it is
                hf_hub_download(ref.repo_id, name, revision=commit, tqdm_class=bar, **LIBRARY)
            else:
                _fetch_lfs(ref, commit, name, lfs.sha256, lfs.size, bar)
        except (KeyboardInterrupt, MlxlisError):
            raise
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, ref) from None


def _fetch_lfs(ref: HubRef, commit: str, name: str, sha256: str, size: int, bar) -> None:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    url = hf_hub_url(ref.repo_id, name, revision=commit)
    meta = get_hf_file_metadata(url, **LIBRARY)  # HEAD: where the bytes are, and their hash
    if meta.etag != sha256 or (meta.size is not None and meta.size != size):
        raise HubError(
            f"the Hub's listing and its headers disagree on {name} (SHA-256 {sha256[:12]}… "
            f"vs ETag {str(meta.etag)[:12]}…)",
            path=str(ref),
        )
    storage = repo_folder(ref.repo_id)
    blob = storage / "blobs" / sha256
    if meta.xet_file_data is not None and _xet_available(constants):
        path = hf_hub_download(ref.repo_id, name, revision=commit, tqdm_class=bar, **LIBRARY)
        _verify(blob, sha256, name, ref, pointer=Path(path))
        return
    if not blob.is_file():
        _download_blob(meta.location, url, blob, sha256, size, name, ref, bar)
    hf_hub_download(ref.repo_id, name, revision=commit, **LIBRARY)  # links the blob


def _xet_available(constants) -> bool:
    """Whether the Hub library will fetch a Xet-stored file through hf_xet (the test it uses
    itself is private: `utils._runtime.is_xet_available`; this is the same one)."""
    import importlib.util

    return importlib.util.find_spec("hf_xet") is not None and not constants.HF_HUB_DISABLE_XET


def _download_blob(
    location: str, url: str, blob: Path, sha256: str, size: int, name: str, ref: HubRef, bar
) -> None:
    # the Hub library's own streaming GET, lock and headers: hf_hub_download resumes only its
    # own temporary file and checks no SHA-256, and this download must do both (and say so)
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    part = blob.with_name(blob.name + ".incomplete")
    lock = blob.parents[2] / ".locks" / blob.parents[1].name / f"{sha256}.lock"  # the hub's
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.is_file():  # another process finished it while this one waited
            return
        have = part.stat().st_size if part.is_file() else 0
        if have > size:  # not a prefix of this file
            part.unlink()
            have = 0
        free = shutil.disk_usage(blob.parent).free
        if free < size - have:
            raise DiskFullError(
                f"{name} needs {size - have} more bytes, {free} are free on the "
                f"device of {blob.parent}",
                path=str(ref),
            )
        headers = build_hf_headers(**LIBRARY)
        if _origin(location) != _origin(url):  # a signed CDN URL: the token stays on the Hub
            headers.pop("authorization", None)
        try:
            with open(part, "ab") as f:  # appends after the bytes a previous run got
                http_get(
                    location,
                    f,
                    resume_size=have,
                    headers=headers,
                    expected_size=size,
                    displayed_filename=name,
                    tqdm_class=bar,
                )
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskFullError(
                    f"no space left writing {name} ({part.stat().st_size} of "
                    f"{size} bytes kept; free space and run again to resume)",
                    path=str(ref),
                ) from None
            raise
        _verify(part, sha256, name, ref)
        os.replace(part, blob)


def _verify(path: Path, sha256: str, name: str, ref: HubRef, pointer: Path | None = None) -> None:
    """The file's SHA-256 must be the Hub's; otherwise it is deleted (and its pointer)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    if digest.hexdigest() == sha256:
        return
    path.unlink(missing_ok=True)
    if pointer is not None:
        pointer.unlink(missing_ok=True)
    raise IntegrityError(
        f"{name}: SHA-256 {digest.hexdigest()} differs from the Hub's {sha256}; "
        "the download was deleted, run again to fetch it anew",
        path=str(ref),
    )


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urlparse(url)
    return u.scheme, (u.hostname or "").lower(), u.port
