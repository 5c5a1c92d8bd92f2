"""Models by Hugging Face Hub name, through huggingface_hub and its cache.

`parse_ref` reads ORG/NAME[:QUANT | /FILE.gguf][@REVISION]; `fetch` turns a reference into
local files (downloading what the cache lacks, with progress, resume and SHA-256 checks);
`from_cache` does the same with no network; store.py lists, scans and removes.
"""

from __future__ import annotations

from pathlib import Path

from mlxlis.loading.hub.fetch import cache_root, fetch, from_cache
from mlxlis.loading.hub.progress import Progress, StderrProgress, default_progress
from mlxlis.loading.hub.refs import HubRef, parse_ref
from mlxlis.loading.hub.store import cached_models, remove, scanned_models, scanned_path

__all__ = [
    "HubRef",
    "Progress",
    "StderrProgress",
    "cache_root",
    "cached_models",
    "default_progress",
    "display_name",
    "fetch",
    "from_cache",
    "parse_ref",
    "remove",
    "scanned_models",
    "scanned_path",
]


def display_name(path: Path) -> str | None:
    """ORG/NAME for a snapshot folder of the Hugging Face cache
    (…/models--ORG--NAME/snapshots/COMMIT), else None."""
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--") :].replace("--", "/", 1)
    return None
