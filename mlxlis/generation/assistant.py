"""An assistant as a drafter (a family with `assists`: the Gemma 4 assistant, whose network is
models/gemma4_assistant.py): it reads the
target's state — the last hidden state the target kept (after its final norm), the target's
scaled embedding of each token, and the keys/values in the target sequence's own caches of
the last layer of each type with K/V — and drafts k tokens, all at the position of the token
after that hidden state, each step's backbone state the last step's projection (transformers'
SinglePositionMultiTokenCandidateGenerator).

Sliding layers: the target's ring holds its last `window` positions, before p; transformers'
mask would admit window + 1 after a prompt (and, after a verification, rejected drafts'
keys left in its unrolled states), so the oldest of them is the one position it sees that
this drafter does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxlis.cache import Cache
from mlxlis.errors import MlxlisError
from mlxlis.generation.processors import LogitsProcessor, processors_for
from mlxlis.generation.proposal import Drafter, Picker, Proposal, SpeculativeError
from mlxlis.generation.sampling import SamplingParams
from mlxlis.models.model import Model
from mlxlis.models.network import Assistant, SharedKV, TargetView

import mlx.core as mx


def check_assistant(assistant: Model, target: Model) -> None:
    """The assistant must read this target (its network's check), else a SpeculativeError
    naming the field."""
    net: Assistant = assistant.net  # type: ignore[assignment]  (Family.assists)
    try:
        net.check_target(target.config)
    except MlxlisError as e:
        raise SpeculativeError(e.message, field=e.field or "draft_model") from None


class AssistantDrafter(Drafter):
    """Drafts with a Gemma 4 assistant from the target's state (module docstring); greedy
    for a greedy target, else sampled under the request's processors and filters (q)."""

    wants_hidden = True

    def __init__(
        self,
        assistant: Model,
        target: Model,
        params: SamplingParams,
        caches: list[Cache] | None = None,
    ):
        check_assistant(assistant, target)
        self.net: Assistant = assistant.net  # type: ignore[assignment]
        self.target: TargetView = target.net  # type: ignore[assignment]
        self.slots = self.target.kv_slots()  # layer type -> cache index
        self.caches = caches  # the target sequence's (the core hands them over)
        self.last: mx.array | None = None  # (1, hidden) the newest state the target kept
        self.processors: list[LogitsProcessor] = processors_for(params, target.tokenizer)
        self.pick = Picker(params)

    def feed_hidden(self, ids: Sequence[int], hidden: mx.array) -> None:
        self.last = hidden[-1:]  # only the newest is read: the next draft starts after it

    def shared(self) -> SharedKV:
        """The target's keys/values by layer type (a ring's in slot order: every one is seen)."""
        if self.caches is None:
            raise SpeculativeError(
                "the generation core handed this drafter no target caches", field="draft_model"
            )
        out = {}
        for kind, slot in self.slots.items():
            c = self.caches[slot]
            n = c.held
            out[kind] = (c.keys[..., :n, :], c.values[..., :n, :])
        return out

    def propose(self, history: Sequence[int], k: int) -> Proposal:
        if self.last is None:
            raise SpeculativeError("no target hidden state was fed", field="draft_model")
        position = len(history) - 1  # the token after the newest state the target kept
        shared = self.shared()
        state = self.target.final_norm(self.last)[None]  # (1, 1, hidden): after the final norm
        seq, tokens = list(history), []
        token = mx.array([[history[-1]]], mx.int32)
        for _ in range(k):
            x = mx.concatenate([self.target.embed(token).astype(state.dtype), state], axis=-1)
            logits, state = self.net(x, position, shared)
            t = self.pick(logits[:, -1, :].astype(mx.float32), seq, self.processors)
            tokens.append(t)
            seq.append(t)
            token = mx.array([[t]], mx.int32)
        return self.pick.proposal(tokens)


__all__ = ["AssistantDrafter", "check_assistant"]
