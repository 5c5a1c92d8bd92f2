"""What a family module declares (`Family`, with a record per format: `HFFormat`,
`GGUFFormat`, `MLXFormat`, `Export`), and the GGUF metadata reader its parsers use.

A family module (llama.py, gemma.py, qwen3.py, ...) builds one `Family` per model family it
implements; `models/__init__.py` lists them. Everything the loaders, `convert` and `inspect`
know about a family comes from here, so adding one touches no other module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.models.config import ModelConfig

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# A convention undone at load: (applies to this module tensor name?, transform(arr, cfg, part)),
# `part` being "weight" | "scales" | "biases" | "bias" (the array being transformed).
Convention = tuple[Callable[[str], bool], Callable[[mx.array, ModelConfig, str], mx.array]]

RopeFreqsHook = Callable[[ModelConfig, mx.array], tuple[ModelConfig, "mx.array | None"]]

# llama.cpp's names for the tensors outside the blocks (every family shares them)
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's block tensor names -> module names under model.layers.{i}, the Llama layout
GGUF_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# a multimodal checkpoint's text model (transformers 5's `model.language_model.*`, the hub's
# older `language_model.model.*`) under the text model's own names: HFFormat.renames
LANGUAGE_MODEL_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def _no_keys(cfg: ModelConfig) -> dict[str, Any]:
    return {}


def _no_rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    return []


@dataclass(frozen=True)
class Description:
    """What `mlxlis inspect` says of a family beyond the shared keys: its own keys under the
    report's "config" (`keys`, null for every other family: the report's shape is one for
    all), their values for a config, and the text rows that say them (from the report)."""

    keys: tuple[str, ...] = ()
    config: Callable[[ModelConfig], dict[str, Any]] = _no_keys
    rows: Callable[[dict[str, Any]], list[tuple[str, str]]] = _no_rows


@dataclass(frozen=True)
class Projector:
    """How a family's vision tower is stored in llama.cpp's mmproj files (mmproj.py): the
    projector type the file states, and what builds the tower and its image processing from
    the file's metadata and tensors (path, metadata, tensors, cfg, tokenizer, the text
    GGUF's metadata, dtype) -> multimodal.Vision."""

    kind: str
    build: Callable[..., Any]


@dataclass(frozen=True)
class HFFormat:
    """How a family reads Hugging Face's format: config.json and safetensors checkpoints."""

    model_types: tuple[str, ...]  # config.json model_type values read as this family
    # config.json dict + the shared fields (config.base_config) -> the family's ModelConfig
    parse: Callable[[dict, ModelConfig, str], ModelConfig]
    # config.json keys the shared parser needs that this family's configs may omit
    defaults: dict[str, Any] = field(default_factory=dict)
    # config.json -> what the shared parser reads, where the family says it otherwise (Gemma
    # 3n: intermediate_size per layer); `parse` still reads the file's own keys
    base: Callable[[dict], dict] | None = None
    # checkpoint name prefixes renamed to ours, and prefixes dropped (e.g. a vision tower)
    renames: tuple[tuple[str, str], ...] = ()
    dropped: tuple[str, ...] = ()

    def name(self, name: str) -> str | None:
        """A checkpoint tensor name under our module names; None for a dropped tensor."""
        if name.startswith(self.dropped):
            return None
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name


@dataclass(frozen=True)
class GGUFFormat:
    """How a family reads llama.cpp's GGUF files: metadata and tensor names."""

    archs: tuple[str, ...]  # GGUF general.architecture values read as this family
    # GGUF: the shared fields + metadata -> the family's ModelConfig
    parse: Callable[[ModelConfig, GGUFMeta], ModelConfig]
    block: dict[str, str] = field(default_factory=lambda: dict(GGUF_LLAMA_BLOCK))
    conventions: tuple[Convention, ...] = ()  # undone on GGUF tensors, in this order
    # GGUF tensors the model does not use (e.g. a multi-token-prediction head), by name + config
    ignored: Callable[[str, ModelConfig], bool] | None = None
    # GGUF names the block/top tables cannot express (a family's own mapping, tried first)
    names: Callable[[str], str | None] | None = None
    # `{arch}.*` keys llama.cpp reads per layer that `parse` reads whole (the shared fields
    # take layer 0's value)
    per_layer_keys: tuple[str, ...] = ()
    # a `rope_freqs` tensor the family can state as config instead (then `convert` can write
    # it): (cfg, factors) -> (cfg, the factors still needed or None)
    rope_freqs: RopeFreqsHook | None = None
    # a GGUF tensor that stacks on axis 0 what the checkpoint keeps as one module per index
    # (Gemma 3n's altup_proj): GGUF name -> the modules' tensor name, "{}" the index
    stacked: dict[str, str] = field(default_factory=dict)
    # GGUF tensors that are config, not parameters (Phi-3's rope_factors_long / _short):
    # their names, and (cfg, {name: values}) -> cfg once they are read
    config_tensors: tuple[str, ...] = ()
    tensor_config: Callable[[ModelConfig, dict[str, mx.array]], ModelConfig] | None = None

    def module_name(self, gguf_name: str) -> str | None:
        """The module tensor name for a GGUF tensor, or None when no row takes it. A row keyed
        `name.part` (or a bare `name`, for tensors llama.cpp writes without a suffix) maps to
        a whole parameter path; a row keyed `name` maps to a module whose `part` it feeds. A
        stacked tensor (`stacked`) names its first module."""
        if gguf_name in self.config_tensors:
            return None
        if gguf_name in self.stacked:
            return self.stacked[gguf_name].format(0)
        if self.names is not None and (own := self.names(gguf_name)) is not None:
            return own
        m = _BLOCK_RE.match(gguf_name)
        if m:
            i, key, part = m.groups()
            if f"{key}.{part}" in self.block:
                return f"model.layers.{int(i)}.{self.block[f'{key}.{part}']}"
            target = self.block.get(key)
            return f"model.layers.{int(i)}.{target}.{part}" if target else None
        m = _BARE_RE.match(gguf_name)
        if m and f"{m.group(2)}." in self.block:
            return f"model.layers.{int(m.group(1))}.{self.block[m.group(2) + '.']}"
        m = _TOP_RE.match(gguf_name)
        if m:
            key, part = m.groups()
            target = GGUF_TOP.get(key)
            return f"{target}.{part}" if target else None
        return None


@dataclass(frozen=True)
class MLXFormat:
    """How a family reads safetensors saved by mlx-lm after its sanitize: tensors of these name
    suffixes come in its layout (transposed by these axes into ours), and these conventions
    undo what it folded into the values; the layout is the sign a folder was saved so."""

    layouts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    conventions: tuple[Convention, ...] = ()


@dataclass(frozen=True)
class Export:
    """What `convert` writes: config.json's model_type / architectures, and the family's own
    keys."""

    model_type: str = ""
    architecture: str = ""
    config: Callable[[ModelConfig], dict[str, Any]] = _no_keys
    wrapper: str = ""  # write config.json as this wrapper type around a text_config
    prefix: str = ""  # write the tensors under this prefix (the wrapper's language model)
    # or renamed, the first (old prefix, new prefix) that matches (Gemma 3n: model.language_model.)
    renames: tuple[tuple[str, str], ...] = ()
    # modules `convert` writes again under another name, for readers that require them
    # (Gemma 3n's KV-shared layers' unused K/V, which mlx-lm loads): cfg -> {copy: source}
    copies: Callable[[ModelConfig], dict[str, str]] | None = None
    # a tensor as `convert` writes it, where readers expect another layout than the module's:
    # (name, array) -> array (Qwen3-Next: mlx-lm's sanitized layout)
    layout: Callable[[str, mx.array], mx.array] | None = None
    # the tensors `convert` writes, regrouped where the reader keeps them otherwise (Qwen4-Exp:
    # transformers' fused experts, as no MLX reader has the type): params -> params
    regroup: Callable[[dict[str, mx.array]], dict[str, mx.array]] | None = None

    def name(self, name: str) -> str:
        """The name `convert` writes a module tensor under."""
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return self.prefix + name


@dataclass(frozen=True)
class Family:
    """Everything about one model family, as data and small functions: its own parts, and how
    each format names, shapes and configures them."""

    name: str  # ModelConfig.family
    hf: HFFormat
    gguf: GGUFFormat
    network: type[nn.Module]  # built as network(cfg, family, **loader extras)
    export: Export = Export()
    mlx: MLXFormat = MLXFormat()
    # a multimodal folder's way of seeing: (folder, config.json, tokenizer, dtype) ->
    # multimodal.Vision, or None for a text-only folder
    vision: Callable[[Path, dict, Any, Any], Any] | None = None
    describe: Description = Description()  # its own part of `inspect`
    # a tiny config.json of the family's own keys (model_type, layers, what its blocks need),
    # whose random network `make install` runs to compile kernels no other family's run does
    # (generation/warmup.py adds the sizes); None: the others' cover it
    warmup: dict[str, Any] | None = None
    mmproj: Projector | None = None  # its tower in llama.cpp's mmproj files, if it sees
    # its own multi-token-prediction head as a drafter, loaded on first use: (model, this
    # family) -> a network.DraftHead, or network.NoDraftHead saying why the model has none
    mtp: Callable[[Any, Family], Any] | None = None
    # an assistant: its network (a network.Assistant) drafts for a target from the target's
    # state (network.TargetView), not from tokens alone
    assists: bool = False
    # "decoder" (a Network: logits, caches, generation) or "encoder" (an
    # encoder.EncoderNetwork: hidden states of a padded batch, embedded or scored by
    # embedding.py; its folders load through from_encoder.py)
    kind: str = "decoder"

    def undo(
        self,
        name: str,
        arr: mx.array,
        cfg: ModelConfig,
        part: str,
        conventions: tuple[Convention, ...] | None = None,
    ) -> mx.array:
        """Apply every convention (default: the GGUF ones) that matches module tensor `name`."""
        for applies, fn in self.gguf.conventions if conventions is None else conventions:
            if applies(name):
                arr = fn(arr, cfg, part)
        return arr


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([^.]+)\.(weight|bias)$")
_BARE_RE = re.compile(r"^blk\.(\d+)\.([^.]+)$")  # e.g. Qwen3.5's blk.N.ssm_a

_MISSING = object()


class GGUFMeta:
    """Typed reads of `{arch}.*` metadata keys, each error naming the file and the key; the
    tensor shapes by GGUF name (`shapes`), for what a file says only by its tensors."""

    def __init__(
        self,
        md: dict[str, Any],
        arch: str,
        path: str,
        shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        self.md, self.arch, self.path = md, arch, path
        self.shapes = shapes or {}

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.key(name) in self.md

    def get(self, name: str, default: Any = _MISSING, kind: type = int) -> Any:
        full = self.key(name)
        value = self.md.get(full, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ConfigError("required metadata key missing", path=self.path, field=full)
            return default
        if isinstance(value, np.ndarray):  # per-layer arrays: we need them uniform
            if value.size == 0 or not (value == value.flat[0]).all():
                raise UnsupportedError(
                    "per-layer values that differ are not supported", path=self.path, field=full
                )
            value = value.flat[0].item()
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)  # inf / NaN: int() would raise
        if not ok or (kind is int and float(value) != int(value)):
            raise ConfigError(
                f"expected a {kind.__name__}, got {value!r}", path=self.path, field=full
            )
        return kind(value)
