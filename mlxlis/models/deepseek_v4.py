"""DeepSeek V4 (transformers' `deepseek_v4`), as transformers 5.25 computes it:
- streams: the residual is hc_mult streams (B, T, N, hidden), the embedding copied into each;
  manifold-constrained hyper-connections (hyper_connections.py) collapse them before each
  attention / MoE sublayer and spread its output back, the mix doubly stochastic (Sinkhorn);
  a head collapse (hc_head) before the final norm.
- attention: one shared K = V head (wkv, RMSNorm) and low-rank queries (wq_a, q_norm, wq_b,
  then an unweighted RMSNorm per head); interleaved RoPE on each head's trailing rope dims
  (θ rope_theta on sliding layers, the "compress" rope, YaRN without mscale, on the others),
  the output's rope dims turned back at the query's position; a learnt sink per head; a
  grouped low-rank output (wo_a per o_groups group of heads, then wo_b).
- sliding layers: keys of the last sliding_window positions only.
- heavily compressed attention (HCA): the window plus one entry per closed window of
  compress_rate positions (a softmax-gated sum with a per-slot bias, RMSNormed, RoPE at the
  window's first position), seen once the window has closed.
- compressed sparse attention (CSA): entries over overlapping windows (each mixes the
  previous window's first half-channels with its own second half), of which each query sees
  the index_topk its lightning indexer (its own compressor, index_n_heads relu heads) picks.
- experts: sqrt(softplus) scores; the first hash_moe layers route by a frozen token → experts
  table (tid2eid), the others by top-k of score + bias; weights renormalised × routed scale;
  experts and shared expert a SwiGLU clamped at swiglu_limit.
Cache per layer: a JointCache of the window's keys (a RotatingKVCache of sliding_window) and,
per compressor, its raw projections (a KVCache of every position, so a trim into a closed
window recomputes its entry) and entries (cache/compressed.py): speculation, the prefix and
disk caches and batching (each sequence's attention on its own caches) work as the ring
allows them. HF folders only: mlx-lm 0.32 has no deepseek_v4 (its deepseek_v41 is another
model type); no GGUF, no KV quantization, no pipelining, the next-token (MTP) layers skipped.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxlis.cache import JointCache, KVCache, KVFormat, RotatingKVCache
from mlxlis.cache.compressed import EntryCache
from mlxlis.errors import ConfigError, UnsupportedError
from mlxlis.limits import check_sizes
from mlxlis.models.base import Description, Export, Family, GGUFFormat, GGUFMeta, HFFormat
from mlxlis.models.config import ModelConfig, RopeConfig, parse_rope
from mlxlis.models.decoder import Decoder
from mlxlis.models.deepseek_v4_net import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Config,
    DeepseekV4Layer,
    HyperHead,
    V4Dims,
)
from mlxlis.models.experts import ExpertSource
from mlxlis.models.hyper_connections import collapse
from mlxlis.models.layers import Cache
from mlxlis.models.reading import expert_sizes, moe_config

import mlx.core as mx
import mlx.nn as nn

HF_DEFAULTS = {  # transformers' DeepseekV4Config, for the keys the shared parser reads
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
V4_DEFAULTS = {  # DeepseekV4Config's
    **{"q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128},
    **{"index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4},
    **{"moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 6},
    "hc_sinkhorn_iters": 20,
}
RATES = {CSA: 4, HCA: 128}
# transformers' save_pretrained writes model.* and head; the hub's files DeepSeek's root names
RENAMES = (
    ("head.", "lm_head."),
    ("embed.", "model.embed_tokens."),
    ("layers.", "model.layers."),
    ("norm.", "model.norm."),
    *((f"hc_head_{p}", f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")),
)


class DeepseekV4(Decoder):
    """The streams through the blocks, collapsed by hc_head, then the final norm and head."""

    layer: type[nn.Module] = DeepseekV4Layer

    def __init__(self, cfg: ModelConfig, family: Family, rope_freq_factors=None, **stage: Any):
        if stage.get("layers") not in (None, range(cfg.num_hidden_layers)):
            raise UnsupportedError("DeepSeek V4 is not pipelined", path=cfg.source, field="layers")
        super().__init__(cfg, family, rope_freq_factors, **stage)
        own = cfg.own(DeepseekV4Config)
        self.model.hc_head = HyperHead(own.hc_mult, cfg.hidden_size)

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        if kv is not None:
            raise UnsupportedError(
                "KV quantization of DeepSeek V4's caches (raw gates, entries) is not implemented",
                path=self.config.source,
                field="kv_bits",
            )
        own, out = self.config.own(DeepseekV4Config), []
        for kind in own.kinds:
            parts: list = [RotatingKVCache(own.dims.window)]
            if kind != SLIDING:
                parts += [KVCache(), EntryCache(own.dims.rate(kind))]
            if kind == CSA:
                parts += [KVCache(), EntryCache(own.dims.rate(CSA))]
            out.append(JointCache(*parts))
        return out

    def expert_stacks(self) -> dict[str, ExpertSource]:
        e, out = self.config.moe.num_experts, {}
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}.ffn"
            for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                parts = tuple(f"{p}.experts.{j}.{theirs}.weight" for j in range(e))
                out[f"{p}.switch_mlp.{ours}.weight"] = ExpertSource(
                    parts, f"{p}.experts.{theirs}", None
                )
        return out

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts=None
    ) -> mx.array:
        if inserts:
            raise UnsupportedError("no images", path=self.config.source, field="inserts")
        own = self.config.own(DeepseekV4Config)
        x = self.embed(inputs)  # (B, T, hidden)
        h = mx.broadcast_to(x[:, :, None], (*x.shape[:2], own.hc_mult, x.shape[-1]))  # (B, T, N, D)
        for j, layer in enumerate(self.model.layers):
            h = layer(h, inputs, cache[j] if cache is not None else None)
        head = self.model.hc_head
        return collapse(h, head.hc_fn, head.hc_base, head.hc_scale, own.hc_eps, own.dims.eps)


def _size(cfg: dict, key: str, bound: str, path: str) -> int:
    return check_sizes({bound: (key, cfg.get(key, V4_DEFAULTS.get(key)))}, path)[bound]


def _types(cfg: dict, n: int, path: str) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    kinds = cfg.get("layer_types")
    if kinds is None and isinstance(cfg.get("compress_ratios"), list):
        kinds = [{0: SLIDING, 4: CSA, 128: HCA}.get(r) for r in cfg["compress_ratios"]]
    if kinds is None:  # transformers' default: two HCA, then CSA / HCA in turn
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if (
        not isinstance(kinds, list)
        or len(kinds) != n
        or any(k not in (SLIDING, CSA, HCA) for k in kinds)
    ):
        raise ConfigError(
            f"expected {n} of {(SLIDING, CSA, HCA)}, got {kinds!r}"[:300],
            path=path,
            field="layer_types",
        )
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        h = cfg.get("num_hash_layers", 3)
        mlp = ["hash_moe" if i < h else "moe" for i in range(n)]
    if not isinstance(mlp, list) or len(mlp) != n or any(m not in ("hash_moe", "moe") for m in mlp):
        raise ConfigError(
            f"expected {n} of hash_moe / moe, got {mlp!r}"[:300], path=path, field="mlp_layer_types"
        )
    return tuple(kinds), tuple(m == "hash_moe" for m in mlp)


def _ropes(cfg: dict, path: str) -> tuple[RopeConfig, RopeConfig]:
    """(the sliding layers' RoPE, the compressed layers')."""
    params = cfg.get("rope_parameters") or {}
    main = parse_rope(params.get("main"), cfg.get("rope_theta", 1e4), path, "rope_parameters.main")
    theta, fld = cfg.get("compress_rope_theta", 1.6e5), "rope_parameters.compress"
    compress = parse_rope(params.get("compress"), theta, path, fld)
    if compress.type == "yarn" and "attention_factor" not in (params.get("compress") or {}):
        compress = replace(compress, attention_factor=1.0)  # DeepseekV4Config's: no mscale
    for r, f in ((main, "main"), (compress, "compress")):
        if r.type not in ("default", "yarn") or r.attention_factor not in (None, 1.0):
            got = f"{r.type} RoPE with factor {r.attention_factor}"
            raise UnsupportedError(got, path=path, field=f"rope_parameters.{f}")
    return main, compress


def parse_hf(cfg: dict, base: ModelConfig, path: str) -> ModelConfig:
    for key, want in (
        ("scoring_func", "sqrtsoftplus"),
        ("hidden_act", "silu"),
        ("n_shared_experts", 1),
        ("num_key_value_heads", 1),
        ("norm_topk_prob", True),
    ):
        if cfg.get(key, want) != want:
            raise UnsupportedError(
                f"only {key} {want!r} is implemented, got {cfg[key]!r}"[:200], path=path, field=key
            )
    n = base.num_hidden_layers
    kinds, hashed = _types(cfg, n, path)
    rates = {**RATES, **(cfg.get("compress_rates") or {})}
    rates = {k: _size(rates, k, "sliding_window", path) for k in (CSA, HCA)}
    hd = base.head_dim
    prf = cfg.get("partial_rotary_factor") or (cfg.get("qk_rope_head_dim", 64) / hd)
    rope_d = int(hd * prf)
    if rope_d % 2 or not 0 < rope_d <= hd:
        raise ConfigError(
            f"a rope width of {rope_d} in heads of {hd}", path=path, field="partial_rotary_factor"
        )
    main, compress = _ropes(cfg, path)
    q_lora = _size(cfg, "q_lora_rank", "hidden_size", path)
    groups = _size(cfg, "o_groups", "num_attention_heads", path)
    if (base.num_attention_heads * hd) % groups:
        raise ConfigError(
            f"{base.num_attention_heads} heads in {groups} groups", path=path, field="o_groups"
        )
    dims = V4Dims(
        hd,
        rope_d,
        q_lora,
        groups,
        _size(cfg, "o_lora_rank", "hidden_size", path),
        _size(cfg, "sliding_window", "sliding_window", path),
        tuple(rates.items()),
        _size(cfg, "index_n_heads", "num_attention_heads", path),
        _size(cfg, "index_head_dim", "head_dim", path),
        _size(cfg, "index_topk", "max_position_embeddings", path),
        float(cfg.get("swiglu_limit", 10.0)),
        float(cfg.get("routed_scaling_factor", 1.5)),
        base.norms.eps,
    )
    keys = {"num_experts": "n_routed_experts", "num_experts_per_tok": "num_experts_per_tok"}
    keys["moe_intermediate_size"] = "moe_intermediate_size"
    size = expert_sizes({m: (k, cfg.get(k, V4_DEFAULTS[k])) for m, k in keys.items()}, path)
    hc = _size(cfg, "hc_mult", "num_attention_heads", path)
    iters = _size(cfg, "hc_sinkhorn_iters", "num_hidden_layers", path)
    own = DeepseekV4Config(dims, kinds, hashed, hc, iters, float(cfg.get("hc_eps", 1e-6)), compress)
    return base.with_(
        rope=main,
        num_key_value_heads=1,
        moe=moe_config(size, (True,) * n, norm_topk_prob=True),
        family_config=own,
    )


def _base(cfg: dict) -> dict:
    """What the shared parser reads: the sliding layers' rope, the expert width."""
    params = cfg.get("rope_parameters") or {}
    out = {**cfg, "intermediate_size": cfg.get("moe_intermediate_size", 2048)}
    out["rope_parameters"] = params.get("main") if isinstance(params.get("main"), dict) else None
    return out


def _no_gguf(base: ModelConfig, m: GGUFMeta) -> ModelConfig:
    raise UnsupportedError(
        "DeepSeek V4 GGUF files are not read", path=m.path, field="general.architecture"
    )


def _describe(c: ModelConfig) -> dict[str, Any]:
    own = c.own(DeepseekV4Config)
    d, hashed = own.dims, sum(own.hashed)
    keys = {"layer_types": list(own.kinds), "hash_layers": hashed, "rates": dict(d.rates)}
    more = {"sliding_window": d.window, "index_topk": d.index_topk, "hc_mult": own.hc_mult}
    return {"compressed_attention": {**keys, **more}}


def _rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    a = config["compressed_attention"]
    kinds = {k: a["layer_types"].count(k) for k in (SLIDING, CSA, HCA)}
    return [
        (
            "attention",
            f"{kinds[SLIDING]} sliding ({a['sliding_window']}), {kinds[CSA]} compressed sparse "
            f"(1 entry per {a['rates'][CSA]}, top {a['index_topk']} by an indexer), "
            f"{kinds[HCA]} heavily compressed (1 entry per {a['rates'][HCA]}); "
            "shared K = V, a sink per head",
        ),
        ("residual", f"{a['hc_mult']} hyper-connection streams, mixed doubly stochastic"),
        (
            "routing",
            f"sqrt(softplus) scores; the first {a['hash_layers']} layers routed by a token table",
        ),
    ]


DEEPSEEK_V4 = Family(
    name="deepseek_v4",
    hf=HFFormat(
        model_types=("deepseek_v4",),
        parse=parse_hf,
        defaults=HF_DEFAULTS,
        base=_base,
        renames=RENAMES,
        dropped=("mtp.", "model.mtp."),
    ),
    gguf=GGUFFormat(archs=(), parse=_no_gguf),
    network=DeepseekV4,
    export=Export(model_type="deepseek_v4", architecture="DeepseekV4ForCausalLM"),
    describe=Description(("compressed_attention",), _describe, _rows),
)
