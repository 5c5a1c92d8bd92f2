"""The multi-token-prediction (MTP) block of Qwen3.5 / Qwen3.6 checkpoints (`mtp.*`), a drafter
of the token after the next one. As vLLM (qwen3_5_mtp.py), SGLang (qwen3_5_mtp.py) and
llama.cpp (src/models/qwen35.cpp, graph_mtp) run it, for the pair (x_{t+1}, g_t):

  e = pre_fc_norm_embedding(embed(x_{t+1}))     the target's own embedding table
  h = pre_fc_norm_hidden(g_t)                   g_t: the target's last-layer output at t AFTER
                                                its final norm (llama.cpp: "post-norm hidden
                                                state feeds both the LM head and the MTP")
  u = fc(concat(e, h))                          (2·hidden -> hidden), the embedding half first
  u = layers[0](u)                              one gated full-attention Qwen3.5 block (the
                                                target's RoPE; a KV cache of its own)
  o = norm(u)                                   -> logits through the target's head (tied:
                                                its embedding): the distribution of x_{t+2}
The draft after that chains on o: the pair (x_{t+2}, o) gives x_{t+3}, and so on. All three
references add no embedding or head of its own (llama.cpp reads optional `nextn.embed_tokens` /
`nextn.shared_head_head` copies, which Qwen's converter never writes). The norms are x̂·(1 + w).

Checkpoints: Hugging Face folders keep the block under `mtp.` (`mtp_num_hidden_layers`, 1 in
every released model); llama.cpp (conversion/qwen.py, _QwenMtpMixin) writes it as block
N = the model's layer count: a normal full-attention block `blk.N.*` plus `blk.N.nextn.eh_proj`
(fc), `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` (norm), 1 added to every norm.
"""

from __future__ import annotations

import re
from dataclasses import replace

from mlxlis.cache import KVCache, KVFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.experts import ExpertSource, SparseMoE
from mlxlis.models.hybrid import HybridLayer
from mlxlis.models.layers import norm
from mlxlis.models.mtp_load import target_head
from mlxlis.models.network import Network
from mlxlis.models.rope import Rope

import mlx.core as mx
import mlx.nn as nn

# checkpoint prefixes of the block (text-only and multimodal folders)
HF_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")
# llama.cpp's nextn tensors of block N -> ours (the block's other tensors are a decoder layer's)
GGUF_NEXTN = {
    "eh_proj": "fc",
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "shared_head_norm": "norm",
}
GGUF_NEXTN_COPIES = ("embed_tokens", "shared_head_head")  # the target's own, when present
_HF_LAYER = re.compile(r"^(?:model\.(?:language_model\.)?)?mtp\.layers\.(\d+)\.")


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config for the block's one layer: full attention, experts where the
    target's layers have them."""
    return cfg.with_(
        num_hidden_layers=1,
        layer_types=("full_attention",),
        moe=replace(cfg.moe, sparse_layers=(True,)) if cfg.moe else None,
    )


class MTPBlock(nn.Module):
    """(B, T, hidden) embeddings of x_{t+1} and normed target states g_t -> (B, T, hidden)
    states o_t after the block's final norm (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        one = block_config(cfg)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = norm(one, d)
        self.pre_fc_norm_hidden = norm(one, d)
        self.layers = [
            HybridLayer(one, Rope(cfg.attention.rotary_dim or cfg.head_dim, cfg.rope), 0)
        ]
        self.norm = norm(one, d)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[KVCache]) -> mx.array:
        e = self.pre_fc_norm_embedding(embeds)
        h = self.pre_fc_norm_hidden(hidden)
        u = self.fc(mx.concatenate([e, h], axis=-1))  # (B, T, 2·hidden) -> (B, T, hidden)
        mask = "causal" if u.shape[1] > 1 else None  # aligned to the newest keys of the cache
        u = self.layers[0](u, mask, cache[0])
        return self.norm(u)

    def make_cache(self, kv: KVFormat | None = None) -> list[KVCache]:
        return [KVCache(kv)]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names -> ours: the block's tensors without their prefix, the rest gone."""
        out = {}
        for name, arr in weights.items():
            for prefix in HF_PREFIXES:
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = arr
                    break
        return out

    def expert_stacks(self) -> dict[str, ExpertSource]:
        mlp = self.layers[0].mlp
        return mlp.expert_stacks("layers.0.mlp") if isinstance(mlp, SparseMoE) else {}

    def project(self, out: mx.array, net: Network) -> mx.array:
        """The target's head (the block has none of its own)."""
        return target_head(out, net)


def hf_block_layers(names: list[str]) -> int:
    """How many MTP layers a folder's tensor names hold (0: no block)."""
    if not any(n.endswith("mtp.fc.weight") for n in names):
        return 0
    return len({m.group(1) for n in names if (m := _HF_LAYER.match(n))})


def gguf_name(name: str, first: int, block_name) -> str | None:
    """Our name for a GGUF tensor of the block at `first` (None: not the block's, or a copy
    of the target's). `block_name`: the family's GGUF name -> module name of a decoder layer."""
    parts = name.split(".")
    if parts[0] != "blk" or not parts[1].isdigit() or int(parts[1]) != first:
        return None
    if parts[2] == "nextn":
        if parts[3] in GGUF_NEXTN_COPIES:
            return None
        return f"{GGUF_NEXTN[parts[3]]}.{parts[4]}" if parts[3] in GGUF_NEXTN else None
    ours = block_name(name)
    prefix = f"model.layers.{first}."
    return "layers.0." + ours[len(prefix) :] if ours and ours.startswith(prefix) else None


def is_mtp_norm(name: str) -> bool:
    """The block's zero-centred norms (llama.cpp adds 1 to each)."""
    return name.endswith(("norm.weight", "_norm_embedding.weight", "_norm_hidden.weight"))
