"""A pipeline stage: one rank's share of the Decoder, passing the residual stream on.

Rank 0 embeds the tokens and runs its layers; each later rank receives the hidden states of
the rank before it (`mx.distributed.recv`), runs its layers and sends them on (`send`); the
last rank applies the final norm and head, and sends the logits back to rank 0, whose
generation core samples them (leader.py). A prompt goes through in the generation core's
chunks (512 tokens): rank r works on chunk k while rank r+1 runs chunk k-1; they are a lone
process's chunks, so the sums and the logits are bit-identical to its (given the same BLAS
thread count). Everything is lazy MLX graph: a rank's sends and receives run in the order its
graph evaluates them.

Bytes between ranks per token: hidden_size × the residual dtype's size per hop, plus the
logits (vocab × 4 bytes) from the last rank to rank 0.
"""

from __future__ import annotations

from typing import Any

from mlxlis.cache import Cache, CacheBatch, KVFormat
from mlxlis.distributed.group import Ranks
from mlxlis.distributed.split import Part
from mlxlis.errors import UnsupportedError
from mlxlis.models.config import ModelConfig
from mlxlis.models.network import VerifiesAlone

import mlx.core as mx
import mlx.nn as nn


class PipelineNet(VerifiesAlone):
    """The network of a pipelined Model: called like the Decoder (inputs, cache, last_only),
    it returns logits on the last rank and, on the others, the send of its hidden states
    (an array whose evaluation passes them on); its weights and caches are its share of the
    Decoder's. It does not verify in batch (the core refuses to speculate on a pipelined
    model)."""

    logits_at_leader = False  # the last rank sends them to rank 0

    def __init__(self, net: Any, ranks: Ranks, part: Part, dtype: mx.Dtype):
        self.net = net
        self.ranks = ranks
        self.part = part
        self.hidden_dtype = net.hidden_dtype(dtype)

    @property
    def config(self) -> ModelConfig:
        return self.net.config

    def make_cache(self, kv: KVFormat | None = None) -> list[Cache]:
        """This rank's layers' caches."""
        return self.net.make_cache(kv)

    def parameters(self) -> dict:
        """This rank's share of the weights (what memory figures and Ollama's sizes count)."""
        return self.net.parameters()

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        return self.net.named_modules()

    def hidden_states(
        self, inputs: mx.array, cache: list[Cache] | None = None, inserts: object = None
    ) -> mx.array:
        raise UnsupportedError("hidden states of a pipelined model (no speculation on one)")

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def is_first(self) -> bool:
        return self.part.first

    @property
    def is_last(self) -> bool:
        return self.part.last

    @property
    def sends_logits(self) -> bool:
        return self.part.last

    def hidden_bytes_per_token(self) -> int:
        """Bytes one token's hidden state takes on each hop between ranks."""
        return self.net.config.hidden_size * self.hidden_dtype.size

    def __call__(
        self,
        inputs: mx.array,
        cache: list | None = None,
        last_only: bool = False,
        inserts: object = None,
    ) -> mx.array:
        if inserts:  # Model.image_spans refuses a pipelined model's images before this
            raise UnsupportedError("images with a pipelined model", field="images")
        group, rank = self.ranks.group, self.ranks.rank
        b, t = inputs.shape[:2]  # every rank is given the token ids; only rank 0 reads them
        if self.is_first:
            h = self.net.embed(inputs)
        else:
            h = mx.distributed.recv(
                (b, t, self.net.config.hidden_size), self.hidden_dtype, rank - 1, group=group
            )
        h = self.net.run_layers(h, cache)  # (B, T, hidden)
        if not self.is_last:
            return mx.distributed.send(h.astype(self.hidden_dtype), rank + 1, group=group)
        return self.net.head(h, last_only)

    @property
    def heads(self) -> bool:
        return self.part.last

    @property
    def rope_freq_factors(self) -> mx.array | None:
        return self.net.rope_freq_factors

    def decode_batch(self, tokens: mx.array, caches: list[list[Cache]]) -> mx.array:
        """One token for each of B sequences (`tokens` (B,)), each with this rank's caches
        (a batched step): (B, vocab) logits on the last rank, the send elsewhere."""
        inputs = tokens.astype(mx.int32)[:, None]  # (B, 1)
        held = len(self.net.held_layers)
        out = self(inputs, [CacheBatch([c[i] for c in caches]) for i in range(held)])
        return out[:, -1, :] if self.is_last else out
