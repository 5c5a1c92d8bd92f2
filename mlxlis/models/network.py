"""What a family's network is to the code above it: a Protocol, so the generation core, the
pipeline and the loaders never probe a network for attributes."""

from __future__ import annotations

from typing import Protocol

from mlxlis.cache import Cache, KVFormat
from mlxlis.errors import MlxlisError, UnsupportedError
from mlxlis.models.config import ModelConfig
from mlxlis.models.multimodal import Inserts

import mlx.core as mx


class Network(Protocol):
    """inputs (B, T) token ids -> logits (B, T, vocab) in the compute dtype (T = 1 with
    last_only). A pipeline stage that does not head returns the send of its hidden states
    instead (an array whose evaluation passes them to the next rank)."""

    config: ModelConfig

    @property
    def heads(self) -> bool:
        """Whether calls return logits (a whole network, or a pipeline's last stage)."""
        ...

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Cache] | None = None,
        last_only: bool = False,
        inserts: Inserts | None = None,
    ) -> mx.array:
        """`inserts`: the images whose placeholder runs a (1, T) prompt chunk holds (a family
        that sees; the others refuse them)."""
        ...

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: Inserts | None = None
    ) -> mx.array:
        """The last layer's output (B, T, hidden) before the final norm (what `head` takes)."""
        ...

    def head(self, h: mx.array, last_only: bool = False) -> mx.array: ...

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        """One cache per layer this network holds (that keeps state), in order; KV caches
        quantized in `kv` (None: dense)."""
        ...

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """One token for each of B sequences (`tokens` (B,) int32), each with its own caches:
        (B, vocab) logits (or a stage's send)."""
        ...

    @property
    def verifies_in_batch(self) -> bool:
        """Whether `verify_batch` runs several sequences' speculative verifications in one
        forward (else the core verifies each speculating sequence in a forward of its own)."""
        ...

    def verify_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """T tokens for each of B sequences (`tokens` (B, T): a batched speculative
        verification), each with its own caches: (B, T, vocab) logits. Called only where
        `verifies_in_batch`."""
        ...

    @property
    def rope_freq_factors(self) -> mx.array | None:
        """The per-frequency RoPE factors a GGUF stores as a tensor (rope_freqs) that this
        network applies, None when none."""
        ...


class VerifiesAlone:
    """What a network without a batched verification states (Network.verifies_in_batch): the
    core verifies each speculating sequence in a forward of its own."""

    verifies_in_batch = False

    def verify_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        raise UnsupportedError("this network verifies one sequence per forward")


class DraftHead(Protocol):
    """A model's own drafting block (a multi-token-prediction head) on its target: what
    `--speculative mtp` drafts with (generation/mtp.py); a family's `Family.mtp` gives it."""

    def make_cache(self) -> list[Cache]:
        """The block's own caches."""
        ...

    def target_states(self, hidden: mx.array) -> mx.array:
        """The target's last-layer outputs (T, hidden) -> what the block reads."""
        ...

    def step(self, ids: list[int], states: mx.array, cache: list[Cache]) -> mx.array:
        """Pairs (ids[i], states[i]) through the block: (T, hidden)."""
        ...

    def logits(self, out: mx.array) -> mx.array:
        """(T, hidden) block states -> (T, vocab) float32 logits."""
        ...


SharedKV = dict[str, tuple[mx.array, mx.array]]  # layer type -> (B, n_kv_heads, S, head_dim) x 2


class TargetView(Protocol):
    """What an assistant reads of its target's network."""

    def embed(self, inputs: mx.array) -> mx.array:
        """(B, T) ids -> the embedding (B, T, hidden) as the first layer reads it."""
        ...

    def final_norm(self, h: mx.array) -> mx.array:
        """The last layer's output -> after the final norm."""
        ...

    def kv_slots(self) -> dict[str, int]:
        """Layer type -> the cache index whose keys/values an assistant reads."""
        ...


class Assistant(Protocol):
    """A network that drafts for a target from the target's state (Family.assists)."""

    def check_target(self, target: ModelConfig) -> None:
        """An MlxlisError naming the field when it cannot read `target`."""
        ...

    def __call__(
        self, inputs: mx.array, position: int, shared: SharedKV
    ) -> tuple[mx.array, mx.array]:
        """(B, 1, input) at `position`, the target's keys/values by layer type -> (logits
        (B, 1, vocab), the next state)."""
        ...


class NoDraftHead(MlxlisError):
    """The model has no drafting block of its own to draft with."""
