"""A sentence-transformers folder, read as data: the modules it chains (modules.json), each
module's config and weights, the prompts (config_sentence_transformers.json) and the maximum
input length. What the models layer makes of it (pooling, Dense, normalisation) is theirs.

modules.json lists the modules in order: a Transformer at the folder's root, then a Pooling
(1_Pooling/config.json), optional Dense modules (N_Dense/config.json + model.safetensors) and a
Normalize. Module types are matched by their class name, so sentence-transformers 2.x paths
(`sentence_transformers.models.Pooling`) and 6.x ones
(`sentence_transformers.sentence_transformer.modules.pooling.Pooling`) read alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxlis.bounded import read_json_file
from mlxlis.errors import ConfigError, UnsupportedError, UnsupportedFormatError
from mlxlis.loading.safetensors import load_tensors

import mlx.core as mx

MODULES = "modules.json"
PROMPTS = "config_sentence_transformers.json"
KNOWN = ("Transformer", "Pooling", "Dense", "Normalize")


@dataclass(frozen=True)
class DenseFile:
    """One Dense module: its config.json dict and its tensors (linear.weight, linear.bias)."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, mx.array]


@dataclass(frozen=True)
class SentenceFolder:
    """What a sentence-transformers folder states beside the transformer's own files."""

    folder: Path
    pooling: dict[str, Any] | None = None  # 1_Pooling/config.json
    pooling_path: Path | None = None
    dense: tuple[DenseFile, ...] = ()
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence_bert_config.json, else the tokenizer's
    # a CrossEncoder's activation on its logits as a torch class path (6.x writes it here)
    activation_fn: str | None = None


def _object(path: Path) -> dict[str, Any]:
    data = read_json_file(path)
    if not isinstance(data, dict):
        raise ConfigError("expected a JSON object", path=path)
    return data


def _dense(folder: Path) -> DenseFile:
    config = _object(folder / "config.json")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        if (folder / "pytorch_model.bin").is_file():
            raise UnsupportedFormatError(
                "a Dense module stored only as pytorch_model.bin (a pickle, never loaded): "
                "save it as model.safetensors",
                path=folder / "pytorch_model.bin",
            )
        raise UnsupportedFormatError("the Dense module has no model.safetensors", path=folder)
    return DenseFile(folder, config, load_tensors(folder))


def max_seq_length(folder: Path) -> int | None:
    """The longest input sentence-transformers feeds the transformer: sentence_bert_config.json's
    max_seq_length where it says one, else tokenizer_config.json's model_max_length (where
    sentence-transformers 6.x keeps it); None where neither does."""
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        p = folder / name
        if p.is_file():
            value = _object(p).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1:
                return int(min(value, 1 << 30))  # transformers writes 1e30 for "no limit"
    return None


def read_sentence_folder(folder: Path) -> SentenceFolder | None:
    """The folder's sentence-transformers layout, or None for a plain Hugging Face folder (no
    modules.json). A module type not in KNOWN is refused naming modules.json and its index."""
    modules_path = folder / MODULES
    if not modules_path.is_file():
        return None
    limit = max_seq_length(folder)
    modules = read_json_file(modules_path)
    if not isinstance(modules, list):
        raise ConfigError("expected a JSON list", path=modules_path)
    pooling = pooling_path = None
    dense: list[DenseFile] = []
    normalize = False
    for i, m in enumerate(modules):
        where = f"[{i}].type"
        if not isinstance(m, dict) or not isinstance(m.get("type"), str):
            raise ConfigError("expected an object with a type", path=modules_path, field=where)
        kind = m["type"].rsplit(".", 1)[-1]
        sub = folder / str(m.get("path", ""))
        if kind not in KNOWN:
            raise UnsupportedError(
                f"module {m['type']!r} is not implemented (known: {', '.join(KNOWN)})",
                path=modules_path,
                field=where,
            )
        if sub.resolve() != folder.resolve() and folder.resolve() not in sub.resolve().parents:
            raise ConfigError(
                "a module path leaves the folder", path=modules_path, field=f"[{i}].path"
            )
        if kind == "Pooling":
            pooling_path = sub / "config.json"
            pooling = _object(pooling_path)
        elif kind == "Dense":
            dense.append(_dense(sub))
        elif kind == "Normalize":
            normalize = True
    prompts: dict[str, str] = {}
    default = activation = None
    if (folder / PROMPTS).is_file():
        doc = _object(folder / PROMPTS)
        raw = doc.get("prompts") or {}
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise ConfigError(
                "expected an object of strings", path=folder / PROMPTS, field="prompts"
            )
        prompts = dict(raw)
        default = doc.get("default_prompt_name")
        activation = doc.get("activation_fn")
        if default is not None and default not in prompts:
            raise ConfigError(
                f"default prompt {default!r} is not among the prompts",
                path=folder / PROMPTS,
                field="default_prompt_name",
            )
    return SentenceFolder(
        folder, pooling, pooling_path, tuple(dense), normalize, prompts, default, limit, activation
    )
