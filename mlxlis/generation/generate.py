"""`mlxlis.generate`: one prompt through the generation core, as a generator of Events (the
one-shot command and the app's raw pad consume it; ChatSession and the server drive the same
core). A lone prompt is a batch of one: each `Core.step` queues the next forward before the
current token is read, so the device computes token n+1 while the caller handles token n.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from mlxlis.cache import Cache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.constraints import constraint
from mlxlis.generation.core import PREFILL_CHUNK, Core, Request
from mlxlis.generation.core import Sequence as Running
from mlxlis.generation.events import Event
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.steps import steps_for
from mlxlis.models.model import Model
from mlxlis.models.multimodal import Prompt


def generate(
    model: Model,
    ids: Sequence[int] | Prompt,
    params: SamplingParams | None = None,
    *,
    stop_ids: set[int] | None = None,
    cache: list[Cache] | None = None,
    history: Sequence[int] = (),
    prefill_step: int = PREFILL_CHUNK,
    should_stop: Callable[[], bool] | None = None,
    response_format: dict | None = None,
    speculation: Speculation | None = None,
    **sampling: object,
) -> Iterator[Event]:
    """Stream tokens after `ids`, sampled as `params` says with `sampling` keywords (max_tokens,
    temperature, top_p, ...: SamplingParams' fields) applied on top; a bad value raises
    SamplingError before anything runs. With `cache`, `ids` are the tokens not yet in it and
    `history` the ones that are (the repetition penalty sees them). `should_stop()` is asked
    after each step (a prompt chunk, a token): true ends the stream with finish_reason
    "cancelled". `response_format` constrains the reply (mlxlis.generation.constraints: a JSON
    schema, any JSON object, a regex or a grammar; refused with a ConstraintError naming the
    field before anything runs). `speculation` drafts tokens and verifies them in one forward
    (mlxlis.generation.speculative: prompt lookup or a draft model; the same tokens, greedy, or
    the same distribution, sampled). The final event's `fed` lists every id the caches
    hold. `ids` may be a Prompt (Model.encode_chat: ids and the images they hold)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(
            f"generate(model, ids, params): params is a SamplingParams, not {params!r}; "
            "pass max_tokens=, temperature=, ... as keywords"
        )
    params = (params or SamplingParams()).replace(**sampling)
    stops = model.stop_ids() if stop_ids is None else stop_ids
    masks = () if response_format is None else (constraint_for(model, response_format, stops),)
    images = ()
    if isinstance(ids, Prompt):
        ids, images = ids.ids, model.image_spans(ids.ids, ids.images)
    req = Request(
        list(ids),
        params,
        frozenset(stops),
        processors=masks,
        speculation=speculation,
        images=images,
    )
    core = Core(model, steps_for(model, PrefixCache(0)), prefill_step)
    seq = core.start(req, cache, history) if cache is not None else core.start(req)
    yield from run(core, seq, should_stop)


def run_request(
    model: Model,
    req: Request,
    should_stop: Callable[[], bool] | None = None,
    prefill_step: int = PREFILL_CHUNK,
) -> Iterator[Event]:
    """One Request (generation/request.py's `build`) through a core of its own, as `generate`
    runs its prompt."""
    core = Core(model, steps_for(model, PrefixCache(0)), prefill_step)
    yield from run(core, core.start(req), should_stop)


def run(core: Core, seq: Running, should_stop: Callable[[], bool] | None = None) -> Iterator[Event]:
    """The events of one sequence, stepped alone until it ends; a consumer that leaves early
    (the generator closed) ends it as cancelled, its caches released whole."""
    try:
        while not seq.done:
            for _, ev in core.step([seq]):
                yield ev
            if should_stop is not None and not seq.done and should_stop():
                seq.cancelled = True  # the next step ends it (its pending token unread)
    finally:
        core.cancel(seq)


def constraint_for(
    model: Model,
    response_format: dict,
    stops: set[int] | frozenset[int],
    prompt: str | None = None,
):
    """The grammar mask enforcing `response_format` on `model`'s replies, ending on `stops`;
    with the rendered `prompt`, after the reasoning a reasoning model does first."""
    vocab = model.config.vocab_size
    return constraint(response_format, model.tokenizer, vocab, sorted(stops), prompt=prompt)
