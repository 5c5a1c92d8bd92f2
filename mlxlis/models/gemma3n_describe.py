"""Gemma 3n in `mlxlis inspect`: its AltUp residual streams, LAuReL rank and sparse MLP gates
(the report's "streams" key)."""

from __future__ import annotations

from typing import Any

from mlxlis.models.base import Description
from mlxlis.models.config import ModelConfig
from mlxlis.models.gemma3n_net import AltUpStructure


def _config(c: ModelConfig) -> dict[str, Any]:
    s = c.own(AltUpStructure)
    return {
        "streams": {
            "count": s.altup_num_inputs,
            "active": s.altup_active_idx,
            "laurel_rank": s.laurel_rank,
            "sparse_gate_layers": [i for i, x in enumerate(s.sparsity_std) if x is not None],
        }
    }


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    s = config["streams"]
    sparse = s["sparse_gate_layers"]
    text = (
        f"{s['count']} AltUp streams (stream {s['active']} active), LAuReL rank {s['laurel_rank']}"
    )
    if sparse:
        text += f", sparse MLP gates in {len(sparse)} layers ({', '.join(map(str, sparse))})"
    return [("residual", text)]


DESCRIPTION = Description(("streams",), _config, _rows)
