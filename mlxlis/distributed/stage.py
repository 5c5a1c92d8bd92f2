"""A pipeline stage: one rank's share of the Decoder, passing the residual stream on.

Rank 0 embeds the tokens and runs its layers; each later rank receives the hidden states of
the rank before it (`mx.distributed.recv`), runs its layers and sends them on (`send`); the
last rank applies the final norm and head. A prompt goes through in the chunks `prefill`
cuts it into (512 tokens by default): rank r works on chunk k while rank r+1 runs chunk k-1;
they are a lone process's chunks, so the sums and the logits are bit-identical to its (given
the same BLAS thread count). The token the last rank samples comes back to every
rank in one all_sum (the others add zeros), so every rank runs the same generation loop and
stops at the same step. Everything is lazy MLX graph: a rank's sends and receives run in the
order its graph evaluates them, and `share` depends on the send so no rank enters the all_sum
before it has passed its hidden states on.

Bytes between ranks per token: hidden_size × the residual dtype's size per hop, plus the
(2,) int32 all_sum that returns the token and rank 0's stop flag.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..cache import CacheBatch
from .group import Ranks
from .split import Part


class PipelineNet:
    """The network of a pipelined Model: called like the Decoder (inputs, cache, last_only),
    it returns logits on the last rank and, on the others, the send of its hidden states
    (an array whose evaluation passes them on). Other attributes are the Decoder's."""

    is_pipeline = True

    def __init__(self, net: Any, ranks: Ranks, part: Part, dtype: mx.Dtype):
        self.net = net
        self.ranks = ranks
        self.part = part
        self.hidden_dtype = net.hidden_dtype(dtype)

    def __getattr__(self, name: str) -> Any:  # parameters(), config, make_cache, ...
        return getattr(self.__dict__["net"], name)

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def is_first(self) -> bool:
        return self.part.first

    @property
    def is_last(self) -> bool:
        return self.part.last

    def hidden_bytes_per_token(self) -> int:
        """Bytes one token's hidden state takes on each hop between ranks."""
        return self.net.config.hidden_size * self.hidden_dtype.size

    def __call__(self, inputs: mx.array, cache: list | None = None,
                 last_only: bool = False) -> mx.array:  # fmt: skip
        group, rank = self.ranks.group, self.ranks.rank
        b, t = inputs.shape[:2]  # every rank is given the token ids; only rank 0 reads them
        if self.is_first:
            h = self.net.embed(inputs)
        else:
            h = mx.distributed.recv((b, t, self.net.config.hidden_size), self.hidden_dtype,
                                    rank - 1, group=group)  # fmt: skip
        h = self.net.run_layers(h, cache)  # (B, T, hidden)
        if not self.is_last:
            return mx.distributed.send(h.astype(self.hidden_dtype), rank + 1, group=group)
        return self.net.head(h, last_only)

    def share(self, token: mx.array | None, after: mx.array, stop: bool = False) -> mx.array:
        """(2,) int32 on every rank: [the token the last rank sampled, rank 0's stop flag].
        `token`: the last rank's (1,) sample (None elsewhere); `after`: this rank's output of
        the step (its send), evaluated before the all_sum starts."""
        flag = int(bool(stop) and self.is_first)
        if token is not None:
            mine = mx.concatenate([token.reshape(1).astype(mx.int32),
                                   mx.array([flag], dtype=mx.int32)])  # fmt: skip
        else:
            mine = mx.array([0, flag], dtype=mx.int32)
        mine = mx.depends(mine, after)
        return mx.distributed.all_sum(mine, group=self.ranks.group)

    def decode_batch(self, tokens: list[int], caches: list) -> mx.array:
        """One token for each of B sequences, each with this rank's caches (the serving
        engine's batched step): (B, vocab) logits on the last rank, the send elsewhere."""
        inputs = mx.array(tokens, dtype=mx.int32)[:, None]  # (B, 1)
        held = len(self.net.held_layers)
        out = self(inputs, [CacheBatch([c[i] for c in caches]) for i in range(held)])
        return out[:, -1, :] if self.is_last else out
