"""A first message as quick as the second: MLX builds its fused CPU kernels (runtime/fastmath.py,
the samplers' filters) with the system C++ compiler the first time each runs — 8.6 s before
the first token of `make chat`'s first message on a fresh machine, 0.2 s for the second — and
compiles per thread. `warm_up` runs a short throwaway generation through the core, on the
thread that will generate (the app's and the server's MLX thread), while the user is still
typing; its caches and tokens are dropped.
"""

from __future__ import annotations

from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core, Request
from mlxlis.generation.generate import run
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.steps import LocalSteps
from mlxlis.models.model import Model

WARM_PROMPT = 24  # tokens: a prompt of several positions (the prefill kernels) ...
WARM_TOKENS = 3  # ... then a few decode steps (the one-token kernels and the sampler's)


def warm_up(model: Model, params: SamplingParams | None = None) -> None:
    """One short generation with `params`' sampling (so its filters compile too), nothing
    kept. A pipelined model is left alone: its ranks would have to run it too."""
    if model.part is not None:
        return
    params = (params or SamplingParams()).replace(max_tokens=WARM_TOKENS, seed=0)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 8
    core = Core(model, LocalSteps(model, PrefixCache(0)))
    for _ in run(core, core.start(Request(ids[:WARM_PROMPT] or [0], params))):
        pass
