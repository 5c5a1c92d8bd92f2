"""Qwen4-Exp in `mlxlis inspect`: its hyper-connection residual streams, its n-gram embedding
layers and its QSA budget (the report's "hyper_connections" key)."""

from __future__ import annotations

from typing import Any

from mlxlis.models.base import Description
from mlxlis.models.config import ModelConfig
from mlxlis.models.qwen4_exp_parts import Qwen4ExpStructure


def _config(c: ModelConfig) -> dict[str, Any]:
    s = c.own(Qwen4ExpStructure)
    return {
        "hyper_connections": {
            "count": s.hc_count,
            "rank": s.hc_lowrank,
            "ple_layers": list(s.ple_layers),
            "ngram_size": s.ngram_size,
            "qsa": {
                "budget": s.indexer_budget,
                "block": s.indexer_compress_ratio,
                "heads": s.indexer_n_heads,
            },
        }
    }


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    h = config["hyper_connections"]
    text = f"{h['count']} hyper-connection streams (mix rank {h['rank']})"
    if h["ple_layers"]:
        layers = ", ".join(map(str, h["ple_layers"]))
        text += f", 2..{h['ngram_size']}-gram embeddings in layers {layers}"
    q = h["qsa"]
    qsa = f"the best {q['budget']} tokens in blocks of {q['block']} ({q['heads']} index heads)"
    return [("residual", text), ("attention", qsa + " plus the query's own block")]


DESCRIPTION = Description(("hyper_connections",), _config, _rows)
