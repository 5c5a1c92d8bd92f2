"""A first message as quick as the second.

MLX builds its fused CPU kernels (runtime/fastmath.py, the samplers' filters) with the system
C++ compiler the first time each runs: on a fresh machine `make chat`'s first message waited
5.9-8.6 s for its first token, the second 0.2 s. The kernels are cached on disk (MLX's folder
in the temporary directory) by the operations they fuse and their dtype, not by shapes: a tiny
network of the same family fills the cache for a large one. So:

- `make install` runs `python -m mlxlis.generation.warmup`: tiny random networks of the three
  kinds of block the catalog has (Llama's SiLU, Gemma's GELU and sliding window, Qwen3.5's
  Gated DeltaNet), a prompt and a few decode steps each, greedy and sampled;
- the chat app and the server run `warm_up(model)` on their MLX thread as soon as the model is
  loaded, for what the first covers not (another family, float16, the user's sampler; or the
  temporary folder emptied since), while the user types. Nothing either run computes is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxlis.generation.processors import processors_for
from mlxlis.generation.sampling import SamplingParams, make_sampler
from mlxlis.generation.steps import StepKind, forward, prefill
from mlxlis.models import WARMUP_CONFIGS, build_model, config_from_hf
from mlxlis.models.model import Model
from mlxlis.models.network import Network

import mlx.core as mx

WARM_PROMPT = 24  # prompt positions (the prefill kernels, causal attention over several) ...
WARM_TOKENS = 3  # ... then decode steps (the one-token kernels and the sampler's)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1)

_TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
# one tiny config.json per kind of block (each family's own keys: Family.warmup): what
# `make install` compiles the kernels of
TINY_CONFIGS: tuple[dict, ...] = tuple({**c, **_TINY} for c in WARMUP_CONFIGS)


def warm_network(
    net: Network, vocab: int, params: SamplingParams, should_stop: Callable[[], bool] = bool
) -> None:
    """A prompt and a few decode steps through the core's own forward and `params`' sampler
    and processors, on throwaway caches; `should_stop()` true ends it between steps (a user
    who quits does not wait for it)."""
    cache = net.make_cache()
    history = [(7 * i + 3) % vocab for i in range(WARM_PROMPT)]
    logits = prefill(net, history, cache)
    sample = make_sampler(params.replace(seed=0))
    processors = processors_for(params)
    for _ in range(WARM_TOKENS):
        if should_stop():
            return
        for process in processors:
            logits = process(logits, history)
        token = sample(logits)
        history.append(int(token.item()))
        logits = forward(net, [cache], token, StepKind.DECODE)
    mx.eval(logits)


def warm_up(
    model: Model, params: SamplingParams | None = None, should_stop: Callable[[], bool] = bool
) -> None:
    """The model's kernels, with `params`' sampler. A pipelined model is left alone: its ranks
    would all have to run it."""
    if model.part is None and not should_stop():
        warm_network(model.net, model.config.vocab_size, params or SamplingParams(), should_stop)


def warm_tiny(configs: Sequence[dict] = TINY_CONFIGS, dtype: mx.Dtype = mx.float32) -> None:
    """Each tiny config's kernels, greedy and sampled (random weights: only the kernels
    matter)."""
    for raw in configs:
        cfg = config_from_hf(dict(raw), "<warm-up config>")
        net = build_model(cfg)
        net.set_dtype(dtype)
        for params in (SamplingParams(), SAMPLED):
            warm_network(net, cfg.vocab_size, params)


if __name__ == "__main__":
    from mlxlis.runtime import backend
    from mlxlis.runtime.device import resolve_dtype, select_device

    select_device()
    backend.select()
    warm_tiny(dtype=resolve_dtype(None))
