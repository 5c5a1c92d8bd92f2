"""The Gemma 4 assistant as a drafter (models/gemma4_assistant.py has the network): it reads the
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
from mlxlis.generation.processors import LogitsProcessor, processors_for
from mlxlis.generation.proposal import Picker, Proposal, SpeculativeError
from mlxlis.generation.sampling import SamplingParams
from mlxlis.models.gemma4_assistant import AssistantStructure, SharedKV
from mlxlis.models.gemma4_net import FULL, SLIDING, Structure
from mlxlis.models.model import Model

import mlx.core as mx

FAMILY = "gemma4_assistant"


def check_assistant(assistant: Model, target: Model) -> None:
    """The assistant must read this target: its backbone width, vocabulary, and per layer
    type the target's head dim and KV heads; else a SpeculativeError naming the field."""
    a, t = assistant.config, target.config
    if t.family != "gemma4":
        raise SpeculativeError(
            f"a Gemma 4 assistant drafts for a Gemma 4 target, not {t.family}", field="draft_model"
        )
    sa, st = a.own(AssistantStructure), t.own(Structure)
    types = set(a.layer_types)
    pairs = [
        ("backbone_hidden_size", sa.backbone_hidden_size, t.hidden_size),
        ("vocab_size", a.vocab_size, t.vocab_size),
    ]
    if SLIDING in types:
        pairs += [
            ("head_dim", a.head_dim, t.head_dim),
            ("num_key_value_heads", a.num_key_value_heads, t.num_key_value_heads),
        ]
    if FULL in types:
        pairs += [
            ("global_head_dim", sa.global_head_dim, st.global_head_dim),
            ("num_global_key_value_heads", sa.global_kv_heads, st.global_kv_heads),
        ]
    for name, mine, theirs in pairs:
        if mine != theirs:
            raise SpeculativeError(
                f"the assistant's {name} is {mine}, the target's {theirs}: not its assistant",
                field=name,
            )
    if not types <= set(t.layer_types):
        raise SpeculativeError(
            "the target lacks a layer type the assistant reads", field="layer_types"
        )
    if SLIDING in types and a.sliding_window + 1 < t.sliding_window:
        raise SpeculativeError(
            f"the assistant's window {a.sliding_window} is narrower than the target's "
            f"{t.sliding_window}",
            field="sliding_window",
        )


class AssistantDrafter:
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
        self.net, self.target = assistant.net, target.net
        self.slots = target.net.kv_slots()  # layer type -> cache index
        self.caches = caches  # the target sequence's (the core hands them over)
        self.last: mx.array | None = None  # (1, hidden) the newest state the target kept
        self.processors: list[LogitsProcessor] = processors_for(params)
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
        state = self.target.model.norm(self.last)[None]  # (1, 1, hidden): after the final norm
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


__all__ = ["FAMILY", "AssistantDrafter", "check_assistant"]
