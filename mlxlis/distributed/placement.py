"""`mlxlis inspect MODEL --split N`: where N ranks would hold a model's layers and how many
bytes of weights each would read, from the file's header alone (no weight is read);
`--tensor N`: each rank's slice of every layer (tensor.py) instead."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxlis.distributed.split import Part, plan_parts
from mlxlis.errors import LayersSplitError


def placement(
    path_or_name: str | Path, ranks: int, split: Sequence[int] | None = None
) -> tuple[Any, list[Part], int]:
    """(config, every rank's Part, the model's weight bytes) for `ranks` ranks."""
    from mlxlis.distributed import check_pipelinable

    if ranks < 1:
        raise LayersSplitError(
            f"the number of ranks must be at least 1, not {ranks}", field="--split"
        )
    cfg, sizes, path = _header(path_or_name)
    check_pipelinable(cfg, str(path))
    parts = plan_parts(sizes, cfg.num_hidden_layers, ranks, cfg.tie_word_embeddings, split)
    return cfg, parts, sum(sizes.values())


def _header(path_or_name: str | Path) -> tuple[Any, dict[str, int], Path]:
    from mlxlis.loading.resolve import resolve

    path = resolve(path_or_name)
    if path.is_file():
        from mlxlis.loading.gguf_split import read_gguf
        from mlxlis.models.from_gguf import module_sizes
        from mlxlis.models.gguf_config import config_from_gguf

        with read_gguf(path) as gf:
            shapes = {name: t.shape for name, t in gf.tensors.items()}
            cfg = config_from_gguf(gf.metadata, shapes, str(path))
            return cfg, module_sizes(gf, cfg), path
    from mlxlis.loading.safetensors import module_sizes as folder_sizes
    from mlxlis.models import config_from_hf, family
    from mlxlis.models.config import read_json

    cfg = config_from_hf(read_json(path / "config.json"), str(path / "config.json"))
    return cfg, folder_sizes(path, family(cfg.family).hf.name), path


def placement_report(
    path_or_name: str | Path, ranks: int, split: Sequence[int] | None = None
) -> dict[str, Any]:
    """The --split part of `inspect --json`: {"ranks", "weight_bytes", "parts": [{"rank",
    "layers": [first, last], "count", "bytes", "embedding", "head"}]}."""
    cfg, parts, total = placement(path_or_name, ranks, split)
    return {
        "ranks": ranks,
        "layers": cfg.num_hidden_layers,
        "weight_bytes": total,
        "parts": [
            {
                "rank": p.rank,
                "layers": [p.start, p.stop - 1],
                "count": p.stop - p.start,
                "bytes": p.nbytes,
                "embedding": p.embeds,
                "head": p.last,
            }
            for p in parts
        ],
    }


def format_placement(r: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        f"{r['layers']} layers, {r['weight_bytes'] / mib:.0f} MiB of weights over "
        f"{r['ranks']} rank{'s' if r['ranks'] != 1 else ''} (bytes as stored in the file):"
    ]
    for p in r["parts"]:
        first, last = p["layers"]
        also = [w for w, on in (("embedding", p["embedding"]), ("head", p["head"])) if on]
        with_ = f" with the {' and '.join(also)}" if also else ""
        rows.append(
            f"  rank {p['rank']}: layers {first:>3}-{last:<3} ({p['count']:>3}) "
            f"{p['bytes'] / mib:>8.0f} MiB{with_}"
        )
    return "\n".join(rows)


def tensor_report(path_or_name: str | Path, ranks: int) -> dict[str, Any]:
    """`inspect --tensor N` (from the header): {"ranks", "weight_bytes", "bytes_per_token"
    (what each rank sends per float32 token), "parts": [{"rank", "layout", "bytes"}]}: a
    rank's bytes are its share of the split tensors, its KV heads' share of k/v, and every
    norm and router (replicated)."""
    from mlxlis.distributed import check_pipelinable
    from mlxlis.distributed.tensor import bytes_per_token, plan_layout

    import mlx.core as mx

    cfg, sizes, path = _header(path_or_name)
    check_pipelinable(cfg, str(path))
    total = sum(sizes.values())
    norms = sum(n for k, n in sizes.items() if "norm" in k or ".mlp.gate." in k)  # + routers
    kv = sum(n for k, n in sizes.items() if ".k_proj." in k or ".v_proj." in k)
    parts = []
    for r in range(ranks):
        layout = plan_layout(cfg, r, ranks, str(path))
        share = (total - norms - kv) // ranks + norms + kv * len(layout.kv_heads) // layout.kv
        parts.append({"rank": r, "layout": layout.describe(), "bytes": share})
    return {
        "ranks": ranks,
        "weight_bytes": total,
        "bytes_per_token": bytes_per_token(cfg, mx.float32, ranks),
        "parts": parts,
    }


def format_tensor(r: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        f"{r['weight_bytes'] / mib:.0f} MiB of weights split across {r['ranks']} tensor ranks "
        f"(bytes as stored; each rank sends {r['bytes_per_token']} bytes per float32 token):"
    ]
    rows += [f"  {p['layout']}: {p['bytes'] / mib:.1f} MiB" for p in r["parts"]]
    return "\n".join(rows)
