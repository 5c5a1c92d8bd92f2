"""Gemma 4 assistant (HF `gemma4_assistant`, e.g. google/gemma-4-e2b-it-assistant): a small
drafter that reads its Gemma 4 target's state instead of running on its own caches.

One drafting step at position p (transformers' SinglePositionMultiTokenCandidateGenerator):
  x = pre_projection([target's scaled embedding of the token at p ; a backbone state])
  layers: Gemma 4 blocks whose attention is all KV-shared: each layer's queries (RoPE at p)
          attend over the target's keys/values of the last layer of its own type with K/V,
          without a causal mask (every given key; a sliding layer the newest window + 1)
  h = norm(x); logits = lm_head(h) (or the ordered-embedding head below), no softcap;
  the next step's backbone state = post_projection(h), at the same position p.
The first step's backbone state is the target's last hidden state after its final norm.
Ordered embeddings (`use_ordered_embeddings`): the vocabulary is cut into `num_centroids`
clusters of ids (`token_ordering`, a permutation); the top `centroid_intermediate_top_k`
clusters by `centroids(h)` get their exact logits, every other id min(those) − 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlxlis.cache import KVFormat
from mlxlis.errors import ConfigError, MlxlisError, UnsupportedError
from mlxlis.models import gemma4
from mlxlis.models.base import Export, Family, GGUFFormat, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.gemma4_net import FULL, SLIDING, Gemma4Layer, RMSNorm, Structure
from mlxlis.models.network import SharedKV
from mlxlis.models.rope import proportional_rope

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxlis.cache import Cache

# config.json keys outside text_config (models/__init__.py keeps them when it flattens)
OUTER_KEYS = (
    "backbone_hidden_size",
    "use_ordered_embeddings",
    "num_centroids",
    "centroid_intermediate_top_k",
)


@dataclass(frozen=True)
class AssistantStructure(Structure):
    """Gemma 4's structure (every layer KV-shared: kv_source −1) plus the assistant's own."""

    backbone_hidden_size: int = 1536
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    """transformers' Gemma4AssistantConfig (its validate_architecture refusals included)."""
    for key, bad in (
        ("hidden_size_per_layer_input", lambda v: v not in (0, None)),
        ("enable_moe_block", bool),
        ("use_double_wide_mlp", bool),
    ):
        if bad(cfg.get(key, 256 if key == "hidden_size_per_layer_input" else False)):
            raise UnsupportedError("a Gemma 4 assistant has none", path=path, field=key)
    text = gemma4.parse_hf({**cfg, "num_kv_shared_layers": 0}, base, path)
    n = text.num_hidden_layers

    def pos(key: str, default: int) -> int:
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"expected a positive integer, got {v!r}"[:200], path=path, field=key)
        return v

    structure = AssistantStructure(
        **{**text.own(Structure).__dict__, "kv_source": (-1,) * n},
        backbone_hidden_size=pos("backbone_hidden_size", 1536),
        use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
        num_centroids=pos("num_centroids", 2048),
        centroid_top_k=pos("centroid_intermediate_top_k", 32),
    )
    s = structure
    if s.use_ordered_embeddings and (
        text.vocab_size % s.num_centroids or s.centroid_top_k > s.num_centroids
    ):
        raise ConfigError(
            f"{text.vocab_size} ids in {s.num_centroids} clusters, top {s.centroid_top_k}",
            path=path,
            field="num_centroids",
        )
    norms = replace(text.norms, final_logit_softcapping=None)
    return replace(text, family_config=structure, norms=norms)


class MaskedEmbedder(nn.Module):
    """transformers' Gemma4AssistantMaskedEmbedder: logits of the ids of the top-k clusters."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s = cfg.own(AssistantStructure)
        self.top_k, self.clusters = s.centroid_top_k, s.num_centroids
        self.centroids = nn.Linear(cfg.hidden_size, s.num_centroids, bias=False)
        self.token_ordering = mx.zeros((cfg.vocab_size,), mx.int64)  # a permutation of the ids

    def __call__(self, h: mx.array, head: mx.array) -> mx.array:
        """h (B, L, hidden), head (vocab, hidden) -> logits (B, L, vocab)."""
        b, t, d = h.shape
        scores = self.centroids(h)  # (B, L, clusters)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        ids = self.token_ordering.astype(mx.int32).reshape(self.clusters, -1)[top]
        ids = ids.reshape(b, t, -1)  # (B, L, top_k · ids per cluster)
        rows = head[ids.reshape(-1)].reshape(b, t, -1, d)
        picked = (h[..., None, :] @ rows.swapaxes(-1, -2))[..., 0, :]  # (B, L, top_k · ids)
        floor = picked.min() - 1.0  # over the whole batch, as transformers
        out = mx.full((b, t, head.shape[0]), floor, dtype=picked.dtype)
        return mx.put_along_axis(out, ids, picked, axis=-1)


class AssistantModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ropes: dict[str, object]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # the tied head only
        self.layers = [
            Gemma4Layer(cfg, i, ropes[SLIDING if cfg.is_sliding(i) else FULL])
            for i in range(cfg.num_hidden_layers)
        ]
        self.norm = RMSNorm(cfg.hidden_size, cfg.norms.eps)


class Gemma4Assistant(nn.Module):
    """(B, 1, 2·backbone) inputs at position p, the target's keys/values by layer type ->
    (logits (B, 1, vocab), the next backbone state (B, 1, backbone))."""

    heads = True

    def __init__(self, cfg: ModelConfig, family: Family):
        super().__init__()
        self.config, s = cfg, cfg.own(AssistantStructure)
        self._family = family
        ropes = {
            FULL: proportional_rope(
                s.full_rope_dims, cfg.rope.theta, s.full_rotated, s.full_rope_factor, None, ""
            ),
            SLIDING: proportional_rope(
                s.local_rope_dims,
                cfg.attention.rope_local.theta,
                s.local_rotated,
                s.local_rope_factor,
                None,
                "",
            ),
        }
        self.model = AssistantModel(cfg, ropes)
        d, back = cfg.hidden_size, s.backbone_hidden_size
        self.pre_projection = nn.Linear(2 * back, d, bias=False)
        self.post_projection = nn.Linear(d, back, bias=False)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if s.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(cfg)

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        return []  # it reads the target's

    def check_target(self, t: ModelConfig) -> None:
        """The target must be one this assistant reads: a Gemma 4, its backbone width,
        vocabulary, and per layer type the target's head dim and KV heads; else an
        MlxlisError naming the field."""
        a = self.config
        if type(t.family_config) is not Structure:
            raise MlxlisError(
                f"a Gemma 4 assistant drafts for a Gemma 4 target, not {t.family}",
                field="draft_model",
            )
        sa, st = a.own(AssistantStructure), t.own(Structure)
        types = set(a.layer_types)
        pairs = [
            ("backbone_hidden_size", sa.backbone_hidden_size, t.hidden_size),
            ("vocab_size", a.vocab_size, t.vocab_size),
        ]
        if SLIDING in types:
            pairs += [
                ("head_dim", a.head_dim, t.head_dim),
                ("num_key_value_heads", a.num_key_value_heads, t.num_key_value_heads),
            ]
        if FULL in types:
            pairs += [
                ("global_head_dim", sa.global_head_dim, st.global_head_dim),
                ("num_global_key_value_heads", sa.global_kv_heads, st.global_kv_heads),
            ]
        for name, mine, theirs in pairs:
            if mine != theirs:
                raise MlxlisError(
                    f"the assistant's {name} is {mine}, the target's {theirs}: not its assistant",
                    field=name,
                )
        if not types <= set(t.layer_types):
            raise MlxlisError(
                "the target lacks a layer type the assistant reads", field="layer_types"
            )
        aw, tw = a.attention.sliding_window, t.attention.sliding_window
        if SLIDING in types and aw + 1 < tw:
            raise MlxlisError(
                f"the assistant's window {aw} is narrower than the target's {tw}",
                field="sliding_window",
            )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {n: a for n, a in weights.items() if self._family.hf.name(n) is not None}

    def expert_stacks(self) -> dict:
        return {}

    def __call__(
        self, inputs: mx.array, position: int, shared: SharedKV
    ) -> tuple[mx.array, mx.array]:
        cfg, m = self.config, self.model
        # transformers' bidirectional window: |Δ| ≤ window
        window = cfg.attention.sliding_window + 1
        kvs = {t: (k[..., -window:, :], v[..., -window:, :]) for t, (k, v) in shared.items()}
        kvs[FULL] = shared.get(FULL)
        h = self.pre_projection(inputs.astype(self.pre_projection.weight.dtype))
        h = h.astype(mx.float32)  # the residual stream, as the target's
        for i, layer in enumerate(m.layers):
            k, v = kvs[SLIDING if cfg.is_sliding(i) else FULL]
            h, _ = layer(h, None, None, position, (k, v, None), None)
        h = m.norm(h)
        head = m.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
        if "masked_embedding" in self:
            logits = self.masked_embedding(h, head)
        else:
            logits = h @ head.T
        return logits, self.post_projection(h)


GEMMA4_ASSISTANT = Family(
    name="gemma4_assistant",
    hf=HFFormat(
        model_types=("gemma4_assistant",),
        parse=parse_hf,
        defaults=gemma4.HF_DEFAULTS,
    ),
    gguf=GGUFFormat(
        archs=(),
        parse=gemma4.GEMMA4.gguf.parse,
    ),
    network=Gemma4Assistant,
    export=Export(
        model_type="gemma4_assistant",  # `convert` of an assistant: not written yet
        architecture="Gemma4AssistantForCausalLM",
    ),
    assists=True,  # drafts from its target's state (generation/assistant.py)
)
