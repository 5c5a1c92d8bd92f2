"""Several samples of one prompt (OpenAI's `n`): the prompt read once, the caches forked.

The first sample (the lead) is admitted as any request is (a cached prefix taken when one
helps) and reads the prompt; the others (its twins) wait beside it holding no caches. When the
lead's last prompt chunk gives the first token's logits, each twin gets a fork of the lead's
caches (`fork_caches`: every cache kind's `export`, restored into fresh caches of the same
kinds; MLX arrays are immutable, so a fork shares the prompt's arrays until its first write
makes its own) and samples its first token from those same logits with its own sampler. From
then on the samples are independent sequences that decode as rows of one batch.

What makes a sample differ from another is its own Request: its sampling parameters (its seed:
the server gives sample i the seed + i when the client sends one, else each draws a fresh one)
and its own copies of the logits processors (a grammar mask follows its own sample).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

from mlxlis.cache import Cache
from mlxlis.cache.store import format_of
from mlxlis.errors import MlxlisError
from mlxlis.generation.processors import forked

import mlx.core as mx

if TYPE_CHECKING:
    from mlxlis.generation.events import Event
    from mlxlis.generation.sequence import Request, Sequence
    from mlxlis.models.model import Model

__all__ = ["check_samples", "fork", "fork_caches", "orphans", "samples_of"]


def samples_of(req: Request, n: int) -> list[Request]:
    """`n` samples of `req`: sample i's seed is the request's + i (each a stream of its own,
    each reproduced alone by a request with that seed; without one, each draws a fresh seed),
    its logits processors its own copies (`fork`: a grammar mask follows its own sample). With
    n > 1 they decode plainly (no speculation), as rows of one batch."""
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        seed = req.params.seed
        params = req.params if seed is None else req.params.replace(seed=seed + i)
        procs = tuple(forked(req.processors)) if i else req.processors
        out.append(replace(req, params=params, processors=procs, speculation=None))
    return out


def check_samples(model: Model, reqs: Seq[Request]) -> None:
    """MlxlisError naming `n` where `reqs` cannot be samples of one prompt's caches."""
    lead, rest = reqs[0], reqs[1:]
    if rest and model.part is not None:
        raise MlxlisError("n: a pipelined model's caches live in every rank", field="n")
    for r in rest:
        if r.speculation is not None:
            raise MlxlisError("n: samples decode together, not speculatively", field="n")
        same = (r.prompt, r.images, r.kv_format, r.adapter, r.adapter_scale)
        if same != (lead.prompt, lead.images, lead.kv_format, lead.adapter, lead.adapter_scale):
            raise MlxlisError("n: samples share their prompt, format and adapter", field="n")


def fork_caches(model: Model, caches: list[Cache]) -> list[Cache]:
    """Fresh caches of `caches`' kinds holding what they hold (their snapshots included); the
    prompt's arrays shared, never written in place by either."""
    out = model.net.make_cache(format_of(caches))
    if len(out) != len(caches):
        raise MlxlisError(f"a fork made {len(out)} caches for {len(caches)} layers", field="n")
    for new, old in zip(out, caches, strict=True):
        new.restore(*old.export())
        new.shift = old.shift
    return out


def fork(model: Model, lead: Sequence, logits: mx.array) -> list[tuple[Sequence, Event]]:
    """The lead has read the prompt (its first token's logits `logits`, (1, vocab), before its
    own processors): each twin takes a fork of its caches and samples its own first token from
    a copy of those logits (a processor may write the row it is given). A twin that fails
    there ends with an error, the others go on: (twin, its final event) of those."""
    out = []
    for t in lead.twins:
        if t.done:
            continue
        t.lead = None
        try:
            t.caches = fork_caches(model, lead.caches)
            t.fed, t.todo = list(lead.fed), []
            t.usage.cached_tokens = len(t.fed)  # read once, by the lead
            t.usage.reuse_note = f"the prompt's {len(t.fed)} ids forked from its first sample"
            t.sample(mx.array(logits))
        except Exception as e:  # noqa: BLE001 — this sample fails, not the others
            ev = t.final("error", flush=False, error=f"{type(e).__name__}: {e}")
            t.fed, ev.fed = [], []  # its caches are not consistent
            out.append((t, ev))
    lead.twins = []
    return out


def orphans(seqs: Seq[Sequence]) -> list[tuple[Sequence, Event]]:
    """The twins whose lead ended before reading the prompt, ended (an error, or cancelled
    when they were): (sequence, its final event)."""
    out = []
    for s in seqs:
        if s.lead is not None and s.lead.done and not s.done:
            s.lead = None
            if s.cancelled:
                out.append((s, s.final("cancelled")))
            else:
                why = "the sample reading the prompt for it ended first"
                out.append((s, s.final("error", flush=False, error=why)))
    return out
