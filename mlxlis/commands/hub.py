"""`mlxlis pull`, `mlxlis models` and `mlxlis rm` over the catalog, the Hugging Face cache and
the scanned folders (the CLI parses the arguments; these do the work and print)."""

from __future__ import annotations

import sys
from pathlib import Path

from mlxlis.errors import ModelNotFoundError
from mlxlis.loading import catalog
from mlxlis.loading.hub.progress import StderrProgress, human


def pull(names: list[str]) -> int:
    """Fetch each model without running it; no names: the catalog's default set (entries
    marked `on_demand` are fetched only when named)."""
    from mlxlis.loading.resolve import resolve

    for name in names or catalog.default_names():
        if name in catalog.CATALOG:
            catalog.main([name])
            continue
        if _parse(name) is None:
            raise ModelNotFoundError(
                "not a catalog name nor a Hugging Face repo (ORG/NAME)", path=name
            )
        print(f"{name}: {resolve(name, progress=StderrProgress())}", flush=True)
    return 0


def models(scan: bool, extra: list[Path]) -> int:
    """The catalog, the loadable models in the Hugging Face cache and, with `scan`, the GGUF
    files of LM Studio and llama.cpp: each under the name `-m` takes."""
    from mlxlis.loading.hub.fetch import cache_root
    from mlxlis.loading.hub.store import cached_models, scan_roots, scanned_models

    print("catalog (mlxlis pull NAME):")
    for name, e in catalog.CATALOG.items():
        state = "pulled" if catalog.is_pulled(name) else "not pulled"
        print(f"  {name:<20} {e.family:<7} {state:<11} {e.description}")
    print(f"Hugging Face cache ({cache_root()}):")
    _table(cached_models(), "  (none; mlxlis pull ORG/NAME fetches one)")
    if scan or extra:
        where = ", ".join(str(p) for _, p in scan_roots()) + "".join(f", {p}" for p in extra)
        print(f"on the disk ({where}):")
        _table(scanned_models(extra), "  (no GGUF file found)")
    return 0


def rm(names: list[str]) -> int:
    """Remove each model from the Hugging Face cache (or a pulled catalog model)."""
    from mlxlis.loading.hub.store import refuse_scanned, remove, remove_catalog, scanned_path

    for name in names:
        if name in catalog.CATALOG:
            freed = remove_catalog(name)
            print(f"removed {name} ({human(freed)})")
            continue
        if scanned_path(name) is not None:
            refuse_scanned(name)
        ref = _parse(name)
        if ref is None:
            raise ModelNotFoundError(
                "not a catalog name nor a Hugging Face repo (ORG/NAME)", path=name
            )
        freed, what = remove(ref)
        print(f"removed {', '.join(what)} ({human(freed)} freed)")
    return 0


def _parse(name: str):
    from mlxlis.loading.hub.refs import parse_ref

    return parse_ref(name)


def _table(entries, empty: str) -> None:
    if not entries:
        print(empty)
        return
    width = max(len(e.name) for e in entries)
    for e in entries:
        print(
            f"  {e.name:<{width}}  {e.format:<27} {e.quant:<12} {human(e.size):>9}  "
            f"{e.family or '?'}"
        )
    sys.stdout.flush()
