"""ModelConfig from GGUF metadata (`{arch}.*` keys), mirroring what llama.cpp reads: the keys
every architecture shares here, the family's own in its module (`Family.gguf.parse`)."""

from __future__ import annotations

from typing import Any

from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models import GGUF_ARCHS
from mlxlis.models.base import GGUFMeta
from mlxlis.models.config import (
    AttentionConfig,
    MLPConfig,
    ModelConfig,
    NormConfig,
    RopeConfig,
    SpecialTokens,
    yarn_mscale,
)

import numpy as np


def _ff(m: GGUFMeta) -> Any:
    """feed_forward_length; an all-experts model (Qwen3.5-MoE) may state only its experts'."""
    if not m.has("feed_forward_length") and m.has("expert_feed_forward_length"):
        return m.get("expert_feed_forward_length")
    return m.get("feed_forward_length")  # required: a ConfigError naming it when absent


def config_from_gguf(
    md: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], path: str
) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedError(
            f"architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})",
            path=path,
            field="general.architecture",
        )
    spec = GGUF_ARCHS[arch]
    # keys a family reads per layer itself (Gemma 4: head_count_kv, feed_forward_length): the
    # shared fields take the first layer's nonzero value (LFM2's conv layers state 0 KV heads),
    # the family's parser gets the whole array
    keys = {f"{arch}.{k}" for k in spec.gguf.per_layer_keys}
    per_layer = {
        k: (v[v != 0] if (v != 0).any() else v).flat[0].item()
        for k, v in md.items()
        if k in keys and isinstance(v, np.ndarray) and v.size
    }
    m = GGUFMeta({**md, **per_layer}, arch, path, tensor_shapes)
    if "token_embd.weight" not in tensor_shapes:
        raise ConfigError("tensor token_embd.weight missing", path=path, field="token_embd.weight")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = m.get("embedding_length")
    heads = m.get("attention.head_count")
    kv_heads = m.get("attention.head_count_kv", heads)
    sizes = {  # every size, bounded before anything is computed or built from it
        "hidden_size": (key("embedding_length"), hidden),
        "num_attention_heads": (key("attention.head_count"), heads),
        "num_key_value_heads": (key("attention.head_count_kv"), kv_heads),
        "intermediate_size": (key("feed_forward_length"), _ff(m)),
        "num_hidden_layers": (key("block_count"), m.get("block_count")),
        "max_position_embeddings": (key("context_length"), m.get("context_length", 4096)),
        # Gemma 3 trims embedding rows: the tensor is the truth
        "vocab_size": ("token_embd.weight", tensor_shapes["token_embd.weight"][0]),
    }
    size = check_sizes(sizes, path)
    heads, kv_heads = size["num_attention_heads"], size["num_key_value_heads"]
    if heads % kv_heads:
        raise ConfigError(
            f"head_count_kv {kv_heads} must divide head_count {heads}",
            path=path,
            field=key("attention.head_count_kv"),
        )
    head_dim = m.get("attention.key_length", hidden // heads)
    check_sizes({"head_dim": (key("attention.key_length"), head_dim)}, path)
    theta = m.get("rope.freq_base", 10000.0, float)
    rope = RopeConfig(theta=theta)
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = m.get("rope.scaling.factor", 1.0, float)
        rope = RopeConfig(theta=theta, type="linear", factor=factor)
    elif scaling == "yarn":
        rope = _yarn(m, key, theta, size["max_position_embeddings"], path)
    elif scaling not in ("none", None):
        raise UnsupportedError(
            f"rope scaling {scaling!r} is not implemented",
            path=path,
            field=f"{arch}.rope.scaling.type",
        )
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        family=spec.name,
        vocab_size=size["vocab_size"],
        hidden_size=size["hidden_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope=rope,
        norms=NormConfig(m.get("attention.layer_norm_rms_epsilon", 1e-6, float)),
        mlp=MLPConfig(size["intermediate_size"]),
        max_position_embeddings=size["max_position_embeddings"],
        tie_word_embeddings="output.weight" not in tensor_shapes,  # llama.cpp omits it when tied
        attention=AttentionConfig(
            bias="blk.0.attn_q.bias" in tensor_shapes,
            o_bias="blk.0.attn_output.bias" in tensor_shapes,
        ),
        special=SpecialTokens(
            bos if isinstance(bos, int) else None, (eos,) if isinstance(eos, int) else ()
        ),
        source=path,
    )
    return spec.gguf.parse(cfg, GGUFMeta(md, arch, path, tensor_shapes) if per_layer else m)


def _yarn(m, key, theta: float, ctx: int, path: str) -> RopeConfig:
    """llama.cpp's YaRN (llama_context's set-up): the ramp's ends always rounded out
    (ggml_rope_yarn_corr_dims floors and ceils); q and k scaled by mscale(factor), or by
    mscale(factor) / mscale(factor, yarn_log_multiplier) when the file has that key
    (transformers' mscale_all_dim, mscale taken as 1), times rope.scaling.attn_factor; its
    yarn_attn_factor key is overwritten there, so not read; a yarn_ext_factor other than 1
    is refused."""
    ext = m.get("rope.scaling.yarn_ext_factor", 1.0, float)
    if ext != 1.0:
        raise UnsupportedError(
            f"yarn with an extrapolation factor of {ext} is not supported",
            path=path,
            field=key("rope.scaling.yarn_ext_factor"),
        )
    factor = m.get("rope.scaling.factor", 1.0, float)
    if not factor > 0:
        raise ConfigError(
            f"yarn needs a positive factor, got {factor!r}",
            path=path,
            field=key("rope.scaling.factor"),
        )
    orig = m.get("rope.scaling.original_context_length", ctx)
    fast = m.get("rope.scaling.yarn_beta_fast", 32.0, float)
    slow = m.get("rope.scaling.yarn_beta_slow", 1.0, float)
    for name, v in (("rope.freq_base", theta - 1), ("rope.scaling.original_context_length", orig)):
        if not v > 0:  # the correction range divides by log θ and takes log of the context
            raise ConfigError(
                f"must be positive for yarn (θ above 1), got {v!r}", path=path, field=key(name)
            )
    for name, v in (("rope.scaling.yarn_beta_fast", fast), ("rope.scaling.yarn_beta_slow", slow)):
        if not v > 0:
            raise ConfigError(f"must be positive, got {v!r}", path=path, field=key(name))
    attn = yarn_mscale(factor)
    log_mul = m.get("rope.scaling.yarn_log_multiplier", 0.0, float)
    if log_mul:
        attn = yarn_mscale(factor) / yarn_mscale(factor, log_mul)
    attn *= m.get("rope.scaling.attn_factor", 1.0, float)
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=fast,
        beta_slow=slow,
        truncate=True,
        attention_factor=attn,
    )
