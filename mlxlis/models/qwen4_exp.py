"""Qwen4-Exp (text): Qwen3.5's MoE hybrid (Gated DeltaNet layers between gated attention
layers, routed experts plus a shared one in every layer) with three additions, the network in
qwen4_exp_net.py:

  hyper-connections   the residual is hc_count streams; each sublayer reads a learnt mix of
                      them and writes its output into each, weighted (no final norm: a last
                      mix is the head's input)
  PLE                 on the DeltaNet layers ple_layer_ids names (one-indexed): hashed n-gram
                      embeddings of the last ngram_size tokens (EOS ends a context), gated per
                      stream, plus a dilated depthwise convolution over them
  QSA                 attention layers ("indexed_attention", or "full_attention" in the real
                      checkpoint's layer_types) attend to the indexer_budget tokens of the
                      best-scoring blocks of indexer_compress_ratio keys, plus the unfinished
                      last block
HF `qwen4_exp_text` and the `qwen4_exp` wrapper (its vision tower skipped and said); the
n-gram tables come as `ngram_embedding.shard_N.weight` (split_ngram_parts chunks, as
transformers saves them) or whole. No GGUF arch and no mlx-lm type exists for it.
Defaults are transformers' Qwen4ExpTextConfig.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.errors import ConfigError
from mlxlis.limits import CONFIG_MAX_CONTEXT, CONFIG_MAX_DIM, check_sizes
from mlxlis.models.base import Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig
from mlxlis.models.hybrid import exporter, hf_parser
from mlxlis.models.qwen3_next import MOE_DEFAULTS, norm_topk  # Qwen4-Exp's are the same
from mlxlis.models.qwen4_exp_describe import DESCRIPTION
from mlxlis.models.qwen4_exp_net import Qwen4Exp
from mlxlis.models.qwen4_exp_parts import Qwen4ExpStructure

import mlx.core as mx

# its own sizes (limits.check_sizes): hyper-connection streams and rank, the n-gram
# embeddings, the QSA indexer
BOUNDS = {
    "hc_count": 64,
    "hc_lowrank": CONFIG_MAX_DIM,
    "ple_embed_dim": CONFIG_MAX_DIM,
    "ple_conv_kernel_size": 64,
    "ngram_size": 16,
    "heads_per_ngram": 256,
    "ngram_vocab_size_base": 1 << 31,  # the primes from it are found by trial division
    "make_ngram_vocab_size_divisible_by": 1 << 20,
    "split_ngram_parts": 1 << 20,
    "indexer_n_heads": CONFIG_MAX_DIM,
    "indexer_kv_heads": 1,
    "indexer_head_dim": CONFIG_MAX_DIM,
    "indexer_budget": CONFIG_MAX_CONTEXT,
    "indexer_compress_ratio": CONFIG_MAX_CONTEXT,
}
HF_DEFAULTS = {  # transformers' Qwen4ExpTextConfig, for the keys the shared parser reads
    "vocab_size": 248320,
    "hidden_size": 2048,
    "intermediate_size": 512,  # no dense MLP: every layer is an expert block
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}
OWN_DEFAULTS = {
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 512,
}
INDEXER = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)
_parse_hybrid = hf_parser(True)


def _own(cfg: dict, base: ModelConfig, path: str) -> Qwen4ExpStructure:
    sizes = {k: cfg.get(k, v) for k, v in OWN_DEFAULTS.items()}
    dim = cfg.get("ple_embed_dim")
    sizes["ple_embed_dim"] = base.hidden_size if dim is None else dim
    missing = [k for k in INDEXER if cfg.get(k) is None]
    if missing:  # transformers' Qwen4-Exp builds an indexer in every attention layer
        raise ConfigError(
            "Qwen4-Exp's attention layers need the QSA indexer's settings",
            path=path,
            field=missing[0],
        )
    size = check_sizes(
        {k: (k, v) for k, v in {**sizes, **{k: cfg[k] for k in INDEXER}}.items()}, path, BOUNDS
    )
    if size["hc_count"] < 2:
        raise ConfigError("Qwen4-Exp needs 2 or more streams", path=path, field="hc_count")
    if size["indexer_budget"] % size["indexer_compress_ratio"]:
        raise ConfigError(
            "indexer_budget must be a multiple of indexer_compress_ratio",
            path=path,
            field="indexer_budget",
        )
    for k in ("ple_conv_kernel_size", "ngram_size"):  # a context and a convolution span
        if size[k] < 2:
            raise ConfigError(f"must be 2 or more, got {size[k]}", path=path, field=k)
    heads = (size["ngram_size"] - 1) * size["heads_per_ngram"]
    ple = cfg.get("ple_layer_ids") or []
    n = base.num_hidden_layers
    if not isinstance(ple, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n for i in ple
    ):
        raise ConfigError(
            f"expected layer numbers 1..{n}, got {ple!r}"[:200], path=path, field="ple_layer_ids"
        )
    if ple and (heads < 1 or size["ple_embed_dim"] % heads):
        raise ConfigError(
            f"not a multiple of the {heads} n-gram heads", path=path, field="ple_embed_dim"
        )
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    known = isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < base.vocab_size
    if ple and not known:
        raise ConfigError(
            f"PLE layers need an eos_token_id in the vocabulary, got {eos!r}"[:200],
            path=path,
            field="eos_token_id",
        )
    seed = cfg.get("seed", 1234)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"expected an integer, got {seed!r}"[:200], path=path, field="seed")
    size.pop("indexer_kv_heads")  # one key head, the only kind transformers builds
    return Qwen4ExpStructure(
        ple_layers=tuple(sorted({i - 1 for i in ple})), seed=seed, eos_token_id=eos or 0, **size
    )


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    cfg = {**MOE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    if isinstance(cfg.get("layer_types"), list):  # indexed attention is full attention + QSA
        cfg["layer_types"] = [
            "full_attention" if t == "indexed_attention" else t for t in cfg["layer_types"]
        ]
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if "partial_rotary_factor" not in params:  # transformers' default here turns whole heads
        cfg.setdefault("partial_rotary_factor", 1.0)
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act") or "silu"
    if gate not in ("silu", "sigmoid"):
        raise ConfigError(
            f"expected silu or sigmoid, got {gate!r}"[:200], path=path, field="output_gate_type"
        )
    out = _parse_hybrid(cfg, base, path)
    s = _own(cfg, out, path)
    for i in s.ple_layers:
        if not out.is_linear(i):
            raise ConfigError(
                f"layer {i + 1} is an attention layer; PLE runs on DeltaNet layers",
                path=path,
                field="ple_layer_ids",
            )
    rotary = out.attention.rotary_dim or out.head_dim
    if rotary > s.indexer_head_dim:
        raise ConfigError(
            f"the {rotary} rotary dims must fit the indexer's head",
            path=path,
            field="indexer_head_dim",
        )
    return out.with_(
        family_config=s,
        deltanet=replace(out.deltanet, gate_act=gate),
        moe=replace(out.moe, norm_topk_prob=norm_topk(cfg, path)),
    )


def parse_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:  # pragma: no cover - no arch
    raise ConfigError(
        "Qwen4-Exp has no GGUF architecture", path=m.path, field="general.architecture"
    )


_export_hybrid = exporter(True)


def export(cfg: ModelConfig) -> dict[str, Any]:
    s = cfg.own(Qwen4ExpStructure)
    out = _export_hybrid(cfg)
    out.pop("full_attention_interval", None)  # layer_types says it; no reader needs the interval
    return {
        **out,
        "layer_types": [
            t if t == "linear_attention" else "indexed_attention" for t in cfg.layer_types
        ],
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "output_gate_type": cfg.deltanet.gate_act,
        "ple_layer_ids": [i + 1 for i in s.ple_layers],
        "eos_token_id": s.eos_token_id,
        "indexer_kv_heads": 1,
        **{
            k: getattr(s, k)
            for k in (*OWN_DEFAULTS, "ple_embed_dim", "seed", *INDEXER[:1], *INDEXER[2:])
        },
    }


def fused_experts(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """The stacked experts as transformers keeps them (the type's only other reader):
    experts.gate_up_proj (E, 2·F, hidden), gate rows first, and experts.down_proj; quantized
    stacks (with scales) stay as they are, for mlxlis to read."""
    out = dict(params)
    for k in params:
        if (
            not k.endswith(".switch_mlp.gate_proj.weight")
            or k.replace("weight", "scales") in params
        ):
            continue
        p = k[: -len(".switch_mlp.gate_proj.weight")]
        up, down = (out.pop(f"{p}.switch_mlp.{n}_proj.weight") for n in ("up", "down"))
        out[f"{p}.experts.gate_up_proj"] = mx.concatenate([out.pop(k), up], axis=1)
        out[f"{p}.experts.down_proj"] = down
    return out


# the wrapper's language model under model.language_model.*; its vision tower and any
# multi-token-prediction head are not read
_RENAMES = (("model.language_model.", "model."),)
DROPPED = ("model.visual.", "mtp.")


QWEN4_EXP = Family(
    name="qwen4_exp",
    hf=HFFormat(
        model_types=("qwen4_exp_text", "qwen4_exp"),
        parse=parse_hf,
        renames=_RENAMES,
        dropped=DROPPED,
        defaults=HF_DEFAULTS,
    ),
    gguf=GGUFFormat(
        archs=(),
        parse=parse_gguf,
    ),
    network=Qwen4Exp,
    export=Export(
        model_type="qwen4_exp_text",
        architecture="Qwen4ExpForCausalLM",
        config=export,
        regroup=fused_experts,
    ),
    describe=DESCRIPTION,
)
