"""DeepSeek V3's multi-token-prediction layer (the "next-n" layer; GLM-4.5 / 4.6 / 4.7 ship the
same), a drafter for `--speculative mtp` (mtp_load.py) for the families that compose it. As
the DeepSeek-V3 report (§2.2) defines it and vLLM (deepseek_mtp.py), SGLang (deepseek_nextn.py)
and llama.cpp (src/models/glm4-moe.cpp, graph_mtp) run it, for the pair (x_{t+1}, g_t), g_t the
target's last-layer output after its final norm:

  u = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(g_t)))   (2·hidden -> hidden), the
                                                             embedding half first
  u = layer(u)                                               one decoder layer of the family
                                                             (its attention, over a cache of
                                                             its own, and its experts)
  o = shared_head.norm(u)                                    -> logits shared_head.head(o)
The next draft chains on o. `embed` is the target's table (checkpoints hold a copy as the
layer's `embed_tokens`, not read); the head is the layer's own `shared_head.head` where the file
has it (the released checkpoints do), else the target's, as llama.cpp falls back. Norms x̂·w.
vLLM also zeroes the embedding at position 0; SGLang and llama.cpp do not, nor does this.

Checkpoints: `model.layers.{L}.*`, L = num_hidden_layers (`num_nextn_predict_layers` of them,
1 in every released model). GGUF: llama.cpp's GLM-4.5 converter writes the layer as block L,
`blk.L.*` a decoder block plus `blk.L.nextn.{eh_proj, enorm, hnorm, shared_head_norm,
shared_head_head, embed_tokens}` (its DeepSeek V2/V3 converter drops the layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mlxlis.models.base import Family
from mlxlis.models.config import ModelConfig
from mlxlis.models.experts import ExpertSource
from mlxlis.models.grouped_experts import GroupedMoE
from mlxlis.models.layers import Cache, norm
from mlxlis.models.model import Model
from mlxlis.models.mtp_load import BlockFormat, MTPHead, drafter, target_head
from mlxlis.models.network import Network
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

OWN = ("enorm", "hnorm", "eh_proj", "shared_head")  # the layer's tensors outside its block
COPIES = ("embed_tokens",)  # the target's own table, copied into the layer
# llama.cpp's nextn tensors -> ours
GGUF_NEXTN = {
    "eh_proj": "eh_proj",
    "enorm": "enorm",
    "hnorm": "hnorm",
    "shared_head_norm": "shared_head.norm",
    "shared_head_head": "shared_head.head",
}
_HF_FC = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")

# the family's decoder layer, built as layer(one-layer config, RoPE, 0)
LayerMaker = Callable[[ModelConfig, Rope, int], nn.Module]


class SharedHead(nn.Module):
    """The layer's final norm, and its own head where the file has one."""

    def __init__(self, cfg: ModelConfig, own_head: bool):
        super().__init__()
        self.norm = norm(cfg, cfg.hidden_size)
        if own_head:
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class NextNBlock(nn.Module):
    """(B, T, hidden) embeddings of x_{t+1} and normed target states g_t -> (B, T, hidden)
    states o_t after shared_head.norm (the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: LayerMaker,
        caches: Callable[[ModelConfig], list[Cache]],
        own_head: bool,
    ):
        super().__init__()
        d = cfg.hidden_size
        one = block_config(cfg)
        self.enorm = norm(cfg, d)
        self.hnorm = norm(cfg, d)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        a = cfg.attention
        rope = Rope(a.rotary_dim or cfg.head_dim, cfg.rope, None, a.rope_interleaved)
        self.layer = layer(one, rope, 0)
        self.shared_head = SharedHead(cfg, own_head)
        self._one, self._caches = one, caches  # underscores: plain data, not parameters
        self._prefix = f"model.layers.{cfg.num_hidden_layers}."

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[Cache]) -> mx.array:
        e = self.enorm(embeds)
        h = self.hnorm(hidden)
        u = self.eh_proj(mx.concatenate([e, h], axis=-1))  # (B, T, 2·hidden) -> (B, T, hidden)
        mask = "causal" if u.shape[1] > 1 else None  # aligned to the newest keys of the cache
        u = self.layer(u, mask, cache[0])
        return self.shared_head.norm(u)

    def make_cache(self) -> list[Cache]:
        return self._caches(self._one)

    def project(self, out: mx.array, net: Network) -> mx.array:
        """The layer's own head, else the target's."""
        if "head" in self.shared_head:
            return self.shared_head.head(out)
        return target_head(out, net)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """model.layers.{L}.* -> ours (the decoder block's tensors under `layer.`), the copy of
        the target's embedding and every other tensor gone."""
        out = {}
        for name, arr in weights.items():
            if not name.startswith(self._prefix):
                continue
            rest = name[len(self._prefix) :]
            top = rest.split(".", 1)[0]
            if top not in COPIES:
                out[rest if top in OWN else f"layer.{rest}"] = arr
        return out

    def expert_stacks(self) -> dict[str, ExpertSource]:
        mlp = self.layer.mlp
        return mlp.expert_stacks("layer.mlp") if isinstance(mlp, GroupedMoE) else {}


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config for the one layer: experts where the target's later layers have
    them (the layer comes after them all)."""
    moe = cfg.moe
    sparse = moe is not None and any(moe.sparse_layers)
    return cfg.with_(
        num_hidden_layers=1, moe=replace(moe, sparse_layers=(sparse,)) if moe else None
    )


def hf_layers(names: list[str]) -> int:
    """How many next-n layers a folder's tensor names hold (each has an eh_proj)."""
    return len({m.group(1) for n in names if (m := _HF_FC.match(n))})


def gguf_name(name: str, first: int, block_name: Callable[[str], str | None]) -> str | None:
    """Our name for a GGUF tensor of the layer at `first` (None: not the layer's, or a copy of
    the target's). `block_name`: the family's GGUF name -> module name of a decoder layer."""
    parts = name.split(".")
    if parts[0] != "blk" or parts[1] != str(first):
        return None
    if parts[2] == "nextn":
        ours = GGUF_NEXTN.get(parts[3])
        return f"{ours}.{parts[4]}" if ours and len(parts) == 5 else None
    full = block_name(name)
    prefix = f"model.layers.{first}."
    return f"layer.{full[len(prefix) :]}" if full and full.startswith(prefix) else None


def nextn_drafter(
    layer: LayerMaker,
    caches: Callable[[ModelConfig], list[Cache]],
    gguf_reason: str = "converted without it, e.g. --no-mtp",
) -> Callable[[Any, Family], MTPHead]:
    """A family's `mtp` for its next-n layer: `layer` builds the layer's decoder block,
    `caches` that block's caches (from the one-layer config); `gguf_reason`: why a GGUF of the
    family may lack the layer."""

    def build(model: Model) -> NextNBlock:
        n = model.config.num_hidden_layers
        heads = (f"model.layers.{n}.shared_head.head.", f"blk.{n}.nextn.shared_head_head.")
        own = any(s.startswith(heads) for s in model.skipped)  # the layer's own head
        return NextNBlock(model.config, layer, caches, own)

    return drafter(BlockFormat(build, hf_layers, gguf_name, COPIES, None, gguf_reason))
