"""Gemma 4 (text): the network and its `Structure` (config.json is read by gemma4.py, GGUF
metadata by gemma4_gguf.py).

Per layer: h += post_attn_norm(attn(input_norm(h))); then the MLP on pre_ffn_norm(h) (26B: plus
routed experts on pre_ffn_norm_2(h), each branch normed, summed), post_ffn_norm, added; then,
with per-layer inputs (E2B/E4B), h += post_norm(proj(act(gate(h)) · per_layer_input)); then
h ·= layer_scalar. Attention: q/k RMSNorm x̂·w, v RMSNorm without weight, scale 1, RoPE per layer
type; KV-shared layers attend over an earlier layer's keys and values (and write no cache).
The residual stream is float32 as in Gemma 3 (decoder.py says why). Module attribute names equal
the Hugging Face tensor names; the experts use mlx-lm's `experts.switch_glu.*` layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlxlis.cache import CacheBatch, KVBatch, KVCache, KVFormat, RotatingKVCache, window_mask
from mlxlis.models.activations import gated
from mlxlis.models.attention import attend, softcap
from mlxlis.models.config import FamilyConfig, ModelConfig, NormConfig, RopeConfig
from mlxlis.models.experts import SORT_FROM, ExpertSource, SwitchGLU, SwitchLinear
from mlxlis.models.layers import MLP, Mask
from mlxlis.models.multimodal import Inserts, with_blocks
from mlxlis.models.network import VerifiesAlone
from mlxlis.models.rope import Rope, proportional_rope
from mlxlis.runtime import fused

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlxlis.models.base import Family

Cache = KVCache | RotatingKVCache
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Structure(FamilyConfig):
    """What ModelConfig's shared fields do not say about a Gemma 4 (its `family_config`). The
    shared fields describe the sliding layers (head_dim, num_key_value_heads); RoPE: θ is
    cfg.rope's for full layers, cfg.attention.rope_local's for sliding ones, each turning
    `*_rope_dims` dims, of which only the first `*_rotated` pairs of each half (proportional
    RoPE; None: all of them), positions ÷ `*_rope_factor`."""

    global_head_dim: int
    global_kv_heads: int
    k_eq_v: bool  # full layers: values are the raw keys (no v_proj)
    kv_source: tuple[int, ...]  # per layer: the layer whose keys/values it attends over
    intermediate_sizes: tuple[int, ...]  # per layer (double-wide MLPs in KV-shared layers)
    full_rope_dims: int
    full_rotated: int | None
    local_rope_dims: int
    local_rotated: int | None
    full_rope_factor: float = 1.0  # positions ÷ factor (proportional RoPE's "factor")
    local_rope_factor: float = 1.0
    per_layer_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int = 0
    fused_gate_up: bool = False  # GGUF experts as one gate+up tensor (ffn_gate_up_exps)
    # use_bidirectional_attention: "vision" (an image's positions see each other both ways on
    # sliding layers; full layers stay causal), "all" (every position sees every other: full
    # layers all, sliding layers those within (window // 2) + 1 either side, transformers'
    # Gemma4TextConfig), None (everything causal)
    bidirectional: str | None = None


def structure_fields(
    base: ModelConfig,
    final_softcap: float | None,
    local: RopeConfig,
    window: int | None,
    causal: bool = True,
) -> dict:
    """The ModelConfig fields every Gemma 3n / 4 sets: x̂·w, sandwich and q/k norms, the scaled
    embedding, a float32 residual; the final logits' cap, the sliding layers' RoPE and window
    and whether attention is causal as read."""
    norms = NormConfig(base.norms.eps, "rms", sandwich=True, embed_scale=True, residual_f32=True)
    attention = replace(
        base.attention, qk_norm=True, rope_local=local, sliding_window=window, causal=causal
    )
    return dict(norms=replace(norms, final_logit_softcapping=final_softcap), attention=attention)


# transformers' ACT2FN for the per-layer input gate (a plain activation, not a gated pair)
PLAIN_ACTS = {
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "gelu": nn.gelu,
    "silu": nn.silu,
}
_SHARED_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: x̂·w (not Gemma 1-3's x̂·(1 + w)), in float32 and cast after the
    multiply as transformers' Gemma4RMSNorm; `scale=False`: x̂ only (the v norm)."""

    def __init__(self, dims: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        if scale:
            self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        if "weight" not in self:
            return fused.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype)
        w = self.weight.astype(mx.float32)
        return fused.rms_norm(x.astype(mx.float32), w, self.eps).astype(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope):
        super().__init__()
        s, full = cfg.own(Structure), not cfg.is_sliding(layer)
        d, eps, bias = cfg.hidden_size, cfg.norms.eps, cfg.attention.bias
        hd = s.global_head_dim if full else cfg.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = s.global_kv_heads if full else cfg.num_key_value_heads
        self.k_eq_v = full and s.k_eq_v  # the raw keys serve as values
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.q_norm = RMSNorm(hd, eps)
        if s.kv_source[layer] == layer:  # KV-shared layers have no K/V weights
            self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
            self.k_norm = RMSNorm(hd, eps)
            self.v_norm = RMSNorm(hd, eps, scale=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.rope = rope

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: Cache | CacheBatch | None,
        offset: int | mx.array,
        shared: tuple | None,
    ) -> tuple[mx.array, tuple]:
        """offset: the position of x's first token (per sequence, (B,), for a CacheBatch);
        shared: what an earlier layer attended over, (keys, values, None) or, in a batch,
        (stacked keys, values, their mask); returns the output and this layer's own."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset)  # (B, n_heads, T, head_dim)
        stacked = None  # decode_batch: the (B, 1, 1, S) mask of the stacked keys (KVBatch)
        if shared is not None:
            k, v, stacked = shared
        else:
            k = self.k_proj(x).reshape(b, t, self.n_kv_heads, -1)
            v = k if self.k_eq_v else self.v_proj(x).reshape(b, t, self.n_kv_heads, -1)
            k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset)
            v = self.v_norm(v).transpose(0, 2, 1, 3)  # k, v: (B, n_kv_heads, T, head_dim)
            if isinstance(cache, CacheBatch):  # one token per sequence: the caches stacked
                k, v, stacked = KVBatch.step_of(cache.caches, k, v)
            elif cache is not None:
                k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, 1.0, stacked if stacked is not None else mask)
        out = out.transpose(0, 2, 1, 3)  # (B, T, n_heads, head_dim)
        return self.o_proj(out.reshape(b, t, -1)), (k, v, stacked)


class Router(nn.Module):
    """x̂ · scale / √hidden -> logits; softmax over all experts (float32), top k, renormalised,
    times each chosen expert's per_expert_scale (transformers' Gemma4TextRouter)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps, self.k = cfg.norms.eps, cfg.moe.num_experts_per_tok
        self.root = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.moe.num_experts,))

    def __call__(self, h: mx.array) -> tuple[mx.array, mx.array]:
        x = fused.rms_norm(h.astype(mx.float32), None, self.eps) * self.scale * self.root
        probs = mx.softmax(
            self.proj(x.astype(self.scale.dtype)).astype(mx.float32), axis=-1, precise=True
        )  # (B, T, E)
        inds = mx.stop_gradient(mx.argpartition(-probs, kth=self.k - 1, axis=-1)[..., : self.k])
        weights = mx.take_along_axis(probs, inds, axis=-1)  # (B, T, k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights * self.per_expert_scale[inds].astype(mx.float32), inds


class FusedSwitchGLU(nn.Module):
    """SwitchGLU whose gate and up experts are one (E, 2·F, hidden) tensor, gate rows first
    (llama.cpp's ffn_gate_up_exps)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
        self.gate_up_proj = SwitchLinear(e, d, 2 * f)
        self.down_proj = SwitchLinear(e, f, d)
        self.act = gated(cfg.mlp.hidden_act)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (B, T, hidden), indices (B, T, k) -> (B, T, k, hidden), as SwitchGLU."""
        b, t, k = indices.shape
        order = None
        if indices.size < SORT_FROM:
            xs, idx = x[..., None, None, :], indices  # (B, T, 1, 1, hidden)
        else:  # rows grouped by expert (experts.py says why)
            order = mx.argsort(indices.reshape(-1))
            xs, idx = x.reshape(b * t, 1, -1)[order // k], indices.reshape(-1)[order]
        gate, up = mx.split(self.gate_up_proj(xs, idx, order is not None), 2, axis=-1)
        y = self.down_proj(self.act(gate, up), idx, order is not None)
        if order is None:
            return y[..., 0, :]
        return y[mx.argsort(order)].reshape(b, t, k, -1)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        glu = FusedSwitchGLU if cfg.own(Structure).fused_gate_up else SwitchGLU
        self.switch_glu = glu(cfg)

    def __call__(self, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, inds)  # (B, T, k, hidden)
        return (y * weights.astype(y.dtype)[..., None]).sum(axis=-2)


class Gemma4Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope):
        super().__init__()
        d, eps, s = cfg.hidden_size, cfg.norms.eps, cfg.own(Structure)
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp = MLP(cfg, s.intermediate_sizes[layer])
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, RMSNorm(d, eps))
        if cfg.is_sparse(layer):  # 26B: routed experts beside the dense MLP
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.pre_feedforward_layernorm_2 = RMSNorm(d, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(d, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(d, eps)
        if s.per_layer_dim:
            self.per_layer_input_gate = nn.Linear(d, s.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(s.per_layer_dim, d, bias=False)
            self.post_per_layer_input_norm = RMSNorm(d, eps)
            self.act = PLAIN_ACTS[cfg.mlp.hidden_act]
        self.layer_scalar = mx.ones((1,))

    def __call__(
        self,
        h: mx.array,
        mask: Mask,
        cache: Cache | None,
        offset: int,
        shared: tuple | None,
        per_layer: mx.array | None,
    ) -> tuple:
        a, kv = self.self_attn(self.input_layernorm(h), mask, cache, offset, shared)
        h = h + self.post_attention_layernorm(a)
        y = self.mlp(self.pre_feedforward_layernorm(h))
        if "router" in self:  # both branches read the residual h
            weights, inds = self.router(h)
            moe = self.experts(self.pre_feedforward_layernorm_2(h), inds, weights)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(y)
        if per_layer is not None:
            g = self.act(self.per_layer_input_gate(h)) * per_layer  # (B, T, per_layer_dim)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar, kv


class Gemma4Model(nn.Module):
    layer_class: type[nn.Module] = Gemma4Layer  # Gemma 3n's layer (gemma3n_net.py)

    def __init__(self, cfg: ModelConfig, ropes: list[Rope]):
        super().__init__()
        d, s, n = cfg.hidden_size, cfg.own(Structure), cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = [self.layer_class(cfg, i, ropes[i]) for i in range(n)]
        self.norm = RMSNorm(d, cfg.norms.eps)
        if s.per_layer_dim:
            self.embed_tokens_per_layer = nn.Embedding(s.per_layer_vocab, n * s.per_layer_dim)
            self.per_layer_model_projection = nn.Linear(d, n * s.per_layer_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(s.per_layer_dim, cfg.norms.eps)


class Gemma4(VerifiesAlone, nn.Module):
    """inputs (B, T) token ids -> logits (B, T, vocab) in the compute dtype (T = 1 if last_only)."""

    model_class: type[Gemma4Model] = Gemma4Model  # Gemma 3n's (gemma3n_net.py)

    def __init__(self, cfg: ModelConfig, family: Family, rope_freq_factors: mx.array | None = None):
        super().__init__()
        self.config, s = cfg, cfg.own(Structure)
        self._family = family  # underscores: plain data, not part of the parameter tree
        self._rope_freq_factors = rope_freq_factors  # GGUF: the full layers' RoPE (a buffer)
        full = proportional_rope(
            s.full_rope_dims,
            cfg.rope.theta,
            s.full_rotated,
            s.full_rope_factor,
            rope_freq_factors,
            cfg.source,
        )
        local = proportional_rope(
            s.local_rope_dims,
            cfg.attention.rope_local.theta,
            s.local_rotated,
            s.local_rope_factor,
            None,
            cfg.source,
        )
        self._sliding = tuple(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers))
        self._own = tuple(i for i, src in enumerate(s.kv_source) if src == i)
        self._slot = {i: j for j, i in enumerate(self._own)}  # layer -> its cache's index
        self._read = {src for i, src in enumerate(s.kv_source) if src != i}  # layers shared
        self.model = self.model_class(cfg, [local if sl else full for sl in self._sliding])
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        """One cache per layer with its own K/V (the KV-shared layers read theirs)."""
        w = self.config.attention.sliding_window
        if kv is not None:
            kv.check(self.config.head_dim, " (sliding layers)")
            kv.check(self.config.own(Structure).global_head_dim, " (full layers)")
        return [RotatingKVCache(w, kv) if self._sliding[i] else KVCache(kv) for i in self._own]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint names under ours (the family's renames and drops); the K/V weights hub
        checkpoints keep for KV-shared layers are dropped, as transformers ignores them."""
        out, source = {}, self.config.own(Structure).kv_source
        for name, arr in weights.items():
            ours = self._family.hf.name(name)
            hit = _SHARED_KV.match(ours or "")
            if ours is not None and not (hit and source[int(hit.group(1))] != int(hit.group(1))):
                out[ours] = arr
        return out

    def expert_stacks(self) -> dict[str, ExpertSource]:
        """The stacked experts -> transformers' fused `experts.gate_up_proj` (gate half, up
        half) and `experts.down_proj`, or one tensor per expert."""
        stacks: dict[str, ExpertSource] = {}
        halves = {
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
            "down_proj": ("down_proj", None),
        }
        for i, layer in enumerate(self.model.layers):
            if "experts" not in layer or "gate_proj" not in layer.experts.switch_glu:
                continue
            p, n = f"model.layers.{i}.experts", self.config.moe.num_experts
            for proj, (joined, half) in halves.items():
                parts = tuple(f"{p}.{e}.{proj}.weight" for e in range(n))
                stacks[f"{p}.switch_glu.{proj}.weight"] = ExpertSource(parts, f"{p}.{joined}", half)
        return stacks

    heads = True  # the whole network, always (Gemma 4 does not run pipelined)

    @property
    def rope_freq_factors(self) -> mx.array | None:
        return self._rope_freq_factors

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """One token for each of B sequences (`tokens` (B,)), each with its own caches:
        (B, vocab) logits. The projections and MLPs run on the batch; attention over the
        caches stacked."""
        inputs = tokens.astype(mx.int32)[:, None]  # (B, 1)
        per_layer = [CacheBatch([c[j] for c in caches]) for j in range(len(self._own))]
        return self(inputs, per_layer)[:, -1, :]

    def _per_layer_inputs(self, ids: mx.array, h: mx.array) -> mx.array:
        """(B, T, layers, per_layer_dim): the token's per-layer embedding (× √per_layer_dim)
        plus the normed projection of its embedding h (÷ √hidden), together × 1/√2."""
        m, cfg, s = self.model, self.config, self.config.own(Structure)
        b, t = ids.shape
        ids = mx.where(ids < s.per_layer_vocab, ids, 0)  # as Gemma 3n: ids past that table
        tok = m.embed_tokens_per_layer(ids)
        tok = tok * mx.array(s.per_layer_dim**0.5, mx.float32).astype(tok.dtype)
        proj = m.per_layer_model_projection(h) * cfg.hidden_size**-0.5
        proj = m.per_layer_projection_norm(proj.reshape(b, t, -1, s.per_layer_dim))
        return (proj + tok.reshape(b, t, -1, s.per_layer_dim)) * 2**-0.5

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        last_only: bool = False,
        inserts: Inserts | None = None,
    ) -> mx.array:
        return self.head(self._run(inputs, cache, last_only, inserts), last_only)

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: Inserts | None = None
    ) -> mx.array:
        """(B, T) ids -> the last layer's output (B, T, hidden), before the final norm, for
        every position (what `head` takes; what a drafter reading the target's state reads).
        `inserts`: the images whose placeholder runs a (1, T) chunk holds."""
        return self._run(inputs, cache, False, inserts)

    def embed(self, inputs: mx.array) -> mx.array:
        """(B, T) ids -> the scaled embedding (B, T, hidden) in the compute dtype, as the first
        layer reads it (transformers' Gemma4TextScaledWordEmbedding)."""
        h = self.model.embed_tokens(inputs)
        return h * mx.array(self.config.hidden_size**0.5, mx.float32).astype(h.dtype)

    def final_norm(self, h: mx.array) -> mx.array:
        """The last layer's output -> after the final norm (what an assistant reads)."""
        return self.model.norm(h)

    def kv_slots(self) -> dict[str, int]:
        """Layer type -> the cache index of the last layer of that type with K/V of its own
        (transformers' "store" layers: what the KV-shared layers and an assistant read)."""
        last = {SLIDING if self._sliding[i] else FULL: i for i in self._own}
        return {t: self._slot[i] for t, i in last.items()}

    def _expand(self, h: mx.array) -> mx.array:
        """The embedding -> the residual the layers carry (Gemma 3n: several streams)."""
        return h

    def _run(
        self, inputs: mx.array, cache: list[Cache] | None, last_only: bool, inserts: Inserts | None
    ) -> mx.array:
        """The embedding and the layers: (B, T, hidden) before the final norm (only the newest
        position from the first KV-shared layer on when `last_only`). With `inserts`, the
        placeholders are read as the pad id (the per-layer embeddings too) and their scaled
        embeddings replaced by the images' features, which the per-layer projection reads
        (transformers' Gemma4Model)."""
        cfg, s, m = self.config, self.config.own(Structure), self.model
        t = inputs.shape[1]
        batch = bool(cache) and isinstance(cache[0], CacheBatch)  # decode_batch's step
        if batch:
            offset = mx.array([c.offset for c in cache[0].caches])  # (B,) positions
        else:
            offset = cache[0].offset if cache else 0
        if inserts:
            inputs = inserts.ids(inputs)
        h = self.embed(inputs)  # (B, T, hidden)
        if inserts:
            h = inserts.place(h)
        per_layer = self._per_layer_inputs(inputs, h) if s.per_layer_dim else None
        h = self._expand(h.astype(mx.float32))  # the residual (decoder.py: Gemma outgrows f16)
        masks: dict[bool, Mask] = {False: "causal" if t > 1 else None, True: None}
        if s.bidirectional == "all":  # an encoder's one pass (the core refuses to generate)
            reach = cfg.attention.sliding_window // 2 + 1
            pos = mx.arange(t)
            masks = {False: None, True: mx.abs(pos[:, None] - pos[None, :]) <= reach}
        elif any(self._sliding) and not batch:  # a batch's mask comes with its stacked keys
            first = next(i for i in self._own if self._sliding[i])
            masks[True] = (
                cache[self._slot[first]].mask(t)
                if cache
                else (window_mask(0, t, 0, t, cfg.attention.sliding_window) if t > 1 else None)
            )
            if inserts and s.bidirectional == "vision" and masks[True] is not None:
                blocks = inserts.blocks(t)  # sliding layers only: full layers stay causal
                masks[True] = with_blocks(masks[True], blocks, cfg.attention.sliding_window)
        kvs: dict[int, tuple] = {}
        for i, layer in enumerate(m.layers):
            src = s.kv_source[i]
            if last_only and src != i and h.shape[1] > 1:
                # every later layer reuses earlier K/V and writes no cache: only the newest
                # position is still needed (transformers' _maybe_slice_kv_shared_inputs)
                h, offset = h[:, -1:], offset + h.shape[1] - 1
                per_layer = per_layer[:, -1:] if per_layer is not None else None
                masks = {False: None, True: masks[True][-1:] if masks[True] is not None else None}
            c = cache[self._slot[i]] if cache and src == i else None
            pl = per_layer[:, :, i] if per_layer is not None else None
            h, kv = layer(
                h, masks[self._sliding[i]], c, offset, kvs.get(src) if src != i else None, pl
            )
            if i in self._read:
                kvs[i] = kv
        return h

    def head(self, h: mx.array, last_only: bool = False) -> mx.array:
        """Final norm and head: (B, T, hidden) -> logits (B, T, vocab) (T = 1 if last_only)."""
        cfg, m = self.config, self.model
        if last_only:
            h = h[:, -1:, :]
        h = m.norm(h)
        logits = m.embed_tokens.as_linear(h) if cfg.tie_word_embeddings else self.lm_head(h)
        if cfg.norms.final_logit_softcapping is not None:
            logits = softcap(logits, cfg.norms.final_logit_softcapping)
        return logits
