"""Gemma 4 GGUF files as llama.cpp's converter writes them (conversion/gemma.py, Gemma4Model)
and its gemma4 graph reads them (src/models/gemma4.cpp): the metadata -> ModelConfig, and the
tensor names.

Keys: attention.sliding_window_pattern (a bool per layer), key_length / key_length_swa (the
full / sliding head dims), head_count_kv and feed_forward_length as one value or one per layer,
rope.freq_base / rope.freq_base_swa, rope.dimension_count(_swa), attention.shared_kv_layers,
embedding_length_per_layer_input. Norm weights are stored as they are (x̂·w: no +1); the full
layers' proportional RoPE is a `rope_freqs` tensor (1 for turned pairs, 1e30 for the others);
router.scale and per_expert_scale become `blk.N.ffn_gate_inp.scale` / `blk.N.ffn_down_exps.scale`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import CONFIG_MAX_DIM, CONFIG_MAX_LAYERS, CONFIG_MAX_VOCAB, check_sizes
from mlxlis.models.base import GGUF_LLAMA_BLOCK, GGUFMeta
from mlxlis.models.config import MLPConfig, ModelConfig, RopeConfig
from mlxlis.models.gemma4_net import FULL, SLIDING, Structure, structure_fields
from mlxlis.models.reading import moe_config

import numpy as np

# Gemma 4's own sizes, bounded as limits.SIZE_BOUNDS bounds the shared ones (config.json and
# GGUF alike; Gemma 3n reads the per-layer inputs' too)
BOUNDS = {
    "global_head_dim": CONFIG_MAX_DIM,
    "num_global_key_value_heads": CONFIG_MAX_DIM,
    "hidden_size_per_layer_input": CONFIG_MAX_DIM,
    "vocab_size_per_layer_input": CONFIG_MAX_VOCAB,
    "num_kv_shared_layers": CONFIG_MAX_LAYERS,
}


def per_layer(m: GGUFMeta, name: str, n: int, size: str) -> tuple[int, ...]:
    """A key llama.cpp reads as one value or one per layer (get_key_or_arr)."""
    v = m.md.get(m.key(name))
    if isinstance(v, np.ndarray):
        if v.shape != (n,) or v.dtype.kind not in "iu":
            raise ConfigError(
                f"expected {n} integers, got {v!r}"[:200], path=m.path, field=m.key(name)
            )
        vals = tuple(int(x) for x in v)
    else:
        vals = (m.get(name),) * n
    for x in set(vals):
        check_sizes({size: (m.key(name), x)}, m.path, BOUNDS)
    return vals


def _per_type(
    vals: tuple[int, ...], types: tuple[str, ...], kind: str, m: GGUFMeta, name: str
) -> int:
    got = {v for v, t in zip(vals, types, strict=True) if t == kind}
    if len(got) > 1:
        raise UnsupportedError(
            f"values that differ among {kind} layers: {sorted(got)}", path=m.path, field=m.key(name)
        )
    return got.pop() if got else vals[0]


def _rot(m: GGUFMeta, name: str, default: int, head: int) -> int:
    n_rot = m.get(name, default)
    if not 0 < n_rot <= head or n_rot % 2:
        raise ConfigError(
            f"{n_rot} rotary dims for a head of {head}", path=m.path, field=m.key(name)
        )
    return n_rot


def layer_types(m: GGUFMeta, n: int) -> tuple[str, ...]:
    """attention.sliding_window_pattern (one bool per layer) as layer types (Gemma 3n too)."""
    pattern = m.md.get(m.key("attention.sliding_window_pattern"))
    if not isinstance(pattern, np.ndarray) or pattern.shape != (n,):
        raise ConfigError(
            f"expected {n} bools, got {pattern!r}"[:200],
            path=m.path,
            field=m.key("attention.sliding_window_pattern"),
        )
    return tuple(SLIDING if x else FULL for x in pattern.tolist())


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    n, path, shapes = base.num_hidden_layers, m.path, m.shapes
    types = layer_types(m, n)
    kv = per_layer(m, "attention.head_count_kv", n, "num_key_value_heads")
    kv_s, kv_f = (_per_type(kv, types, t, m, "attention.head_count_kv") for t in (SLIDING, FULL))
    for h in (kv_s, kv_f):
        if base.num_attention_heads % h:
            raise ConfigError(
                f"{h} KV heads must divide {base.num_attention_heads}",
                path=path,
                field=m.key("attention.head_count_kv"),
            )
    head_f, head_s = base.head_dim, m.get("attention.key_length_swa")  # llama.cpp requires it
    check_sizes({"head_dim": (m.key("attention.key_length_swa"), head_s)}, path, BOUNDS)
    for key, want in (("attention.value_length", head_f), ("attention.value_length_swa", head_s)):
        if m.get(key, want) != want:  # llama.cpp: "Gemma 4 requires n_embd_head_k == _v"
            raise UnsupportedError(
                "value heads of another size than key heads", path=path, field=m.key(key)
            )
    rot_f = _rot(m, "rope.dimension_count", head_f, head_f)
    rot_s = _rot(m, "rope.dimension_count_swa", rot_f, head_s)
    if FULL in types and shapes.get("rope_freqs.weight", (0,))[-1] * 2 != rot_f:
        raise ConfigError(
            f"full layers need rope_freqs of {rot_f // 2} values (proportional RoPE)",
            path=path,
            field="rope_freqs.weight",
        )
    shared = m.get("attention.shared_kv_layers", 0)
    if not 0 <= shared < n:
        raise ConfigError(
            f"{shared} KV-shared layers of {n}",
            path=path,
            field=m.key("attention.shared_kv_layers"),
        )
    first = n - shared
    source = list(range(n))
    for i in range(first, n):  # llama.cpp: sliding layers read layer first-2, full ones first-1
        j = first - (2 if types[i] == SLIDING else 1)
        if j < 0 or types[j] != types[i]:
            raise UnsupportedError(
                f"llama.cpp would have layer {i} ({types[i]}) read the cache of layer {j}",
                path=path,
                field=m.key("attention.shared_kv_layers"),
            )
        source[i] = j
    own = [i for i in range(n) if source[i] == i]
    no_v = {i for i in own if f"blk.{i}.attn_v.weight" not in shapes}  # llama.cpp: V = K
    if any(types[i] == SLIDING for i in no_v) or no_v not in (
        set(),
        {i for i in own if types[i] == FULL},
    ):
        raise UnsupportedError(
            "attn_v absent from some layers only", path=path, field=f"blk.{min(no_v)}.attn_v.weight"
        )
    ple = m.get("embedding_length_per_layer_input")
    ple_vocab = 0
    if ple:
        ple_vocab = shapes.get("per_layer_token_embd.weight", (0, 0))[0]
        if shapes.get("per_layer_token_embd.weight", (0, 0))[1:] != (n * ple,):
            raise ConfigError(
                f"expected a per-layer embedding of width {n} × {ple}",
                path=path,
                field="per_layer_token_embd.weight",
            )
        check_sizes(
            {
                "hidden_size_per_layer_input": (m.key("embedding_length_per_layer_input"), ple),
                "vocab_size_per_layer_input": ("per_layer_token_embd.weight", ple_vocab),
            },
            path,
            BOUNDS,
        )
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(n))
    fused = {f"blk.{i}.ffn_gate_up_exps.weight" in shapes for i in range(n) if sparse[i]}
    moe = None
    if any(sparse):
        size = check_sizes(
            {
                "num_experts": (m.key("expert_count"), m.get("expert_count")),
                "num_experts_per_tok": (m.key("expert_used_count"), m.get("expert_used_count")),
                "moe_intermediate_size": (
                    m.key("expert_feed_forward_length"),
                    m.get("expert_feed_forward_length"),
                ),
            },
            path,
        )
        if size["num_experts_per_tok"] > size["num_experts"] or len(fused) > 1:
            raise ConfigError(
                "experts per token > experts, or gate/up fused in some layers only",
                path=path,
                field=m.key("expert_used_count"),
            )
        moe = moe_config(size, sparse, norm_topk_prob=True)
    window = m.get("attention.sliding_window")
    check_sizes({"sliding_window": (m.key("attention.sliding_window"), window)}, path, BOUNDS)
    ffn = per_layer(m, "feed_forward_length", n, "intermediate_size")
    structure = Structure(
        global_head_dim=head_f,
        global_kv_heads=kv_f,
        k_eq_v=bool(no_v),
        kv_source=tuple(source),
        intermediate_sizes=ffn,
        full_rope_dims=rot_f,
        full_rotated=None,
        local_rope_dims=rot_s,
        local_rotated=None,
        per_layer_dim=ple,
        per_layer_vocab=ple_vocab,
        full_rope_factor=base.rope.factor if base.rope.type == "linear" else 1.0,
        fused_gate_up=fused == {True},
    )
    local = RopeConfig(theta=m.get("rope.freq_base_swa", 10000.0, float))
    cap = m.get("final_logit_softcapping", 0.0, float) or None  # 0: none
    return base.with_(
        **structure_fields(base, cap, local, window),
        moe=moe,
        mlp=MLPConfig(ffn[0], "gelu_pytorch_tanh"),
        head_dim=head_s,
        num_key_value_heads=kv_s,
        layer_types=types,
        rope=RopeConfig(theta=base.rope.theta),
        family_config=structure,
    )


_KV_TENSOR = re.compile(r"^blk\.(\d+)\.(attn_k|attn_v|attn_k_norm)\.weight$")


def unused_kv(name: str, cfg: ModelConfig) -> bool:
    """K/V tensors of KV-shared layers: converted from hub checkpoints that carry them, unused
    (llama.cpp loads them as optional and never reads them)."""
    hit = _KV_TENSOR.match(name)
    return bool(hit) and cfg.own(Structure).kv_source[int(hit.group(1))] != int(hit.group(1))


GGUF_BLOCK = {
    **GGUF_LLAMA_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_gate_up_exps": "experts.switch_glu.gate_up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
# tensors outside the shared naming scheme: (llama.cpp name, part) -> module parameter
GGUF_EXTRA = {
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",  # the converter moves it there
    ("layer_output_scale", "weight"): "layer_scalar",
}
GGUF_TOP = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_EXTRA_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(scale|weight)$")


def gguf_name(gguf_name: str) -> str | None:
    """The module tensor name of a Gemma 4 tensor outside the shared naming scheme."""
    hit = _EXTRA_RE.match(gguf_name)
    if hit and (hit.group(2), hit.group(3)) in GGUF_EXTRA:
        return f"model.layers.{int(hit.group(1))}.{GGUF_EXTRA[hit.group(2), hit.group(3)]}"
    return GGUF_TOP.get(gguf_name)


def rope_freqs_as_config(cfg: ModelConfig, factors) -> tuple[ModelConfig, Any]:
    """llama.cpp's converter states the full layers' proportional RoPE as factors: 1 for the
    first pairs (turned), 1e30 for the rest (still). That pattern is config (`full_rotated`),
    so the loaded model and a `convert`ed folder say it the same way; anything else stays."""
    f = np.asarray(factors, dtype=np.float64)
    turned = int(np.argmax(f != 1.0)) if (f != 1.0).any() else f.size
    if (f[:turned] == 1.0).all() and (f[turned:] >= 1e29).all():
        return cfg.with_(family_config=replace(cfg.own(Structure), full_rotated=turned)), None
    return cfg, factors
