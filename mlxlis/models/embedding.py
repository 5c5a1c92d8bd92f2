"""Embedding and reranking with an encoder network: inputs tokenized, sorted into length
buckets, run a bucket per forward (padded to the bucket's longest, masked), pooled and put back
in the callers' order.

Buckets: inputs sorted by length, a bucket closed when the next input is longer than its
first by more than a quarter (+ 8 tokens) or the bucket would pass BUCKET_TOKENS padded
tokens; so no row pays for much more than its own length, and many inputs share one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxlis.errors import ContextLimitError, MlxlisError
from mlxlis.models.encoder import EncoderNetwork
from mlxlis.models.pooling import Pooling, matryoshka
from mlxlis.tokenizer.pairs import EncoderTokenizer

import mlx.core as mx

# padded tokens per forward: on the CPU each temporary then fits in cache (all-MiniLM, 32
# inputs of 256 tokens: 11.2 sentences/s at 1024, 8.0 at 8192, same run)
BUCKET_TOKENS = 1024
BUCKET_GROWTH = 1.25  # a bucket takes inputs up to this × its shortest (+ BUCKET_SLACK) long
BUCKET_SLACK = 8

Row = tuple[list[int], list[int]]  # ids, token types


def buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of `lengths` grouped into buckets of similar lengths (see the module's doc)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out:
            b = out[-1]
            short, longest = lengths[b[0]], max(lengths[i], 1)
            fits = longest <= short * BUCKET_GROWTH + BUCKET_SLACK
            if fits and (len(b) + 1) * longest <= max(BUCKET_TOKENS, longest):
                b.append(i)
                continue
        out.append([i])
    return out


@dataclass
class Embedder:
    """An encoder with its tokenizer and pooling: what `Model.embed` / `Model.rerank` run.

    `task` "embed" (pooled vectors) or "rerank" (a classification head's one logit per pair,
    through `activation`: "sigmoid" or "identity"). `prompts`: name -> text prepended to each
    input (config_sentence_transformers.json), `default_prompt` used when none is named."""

    net: EncoderNetwork
    tokenizer: EncoderTokenizer
    pad_id: int
    task: str = "embed"
    pooling: Pooling = field(default_factory=Pooling)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    activation: str = "sigmoid"

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    def rows(self, texts: Sequence[str | Sequence[int]], prefix: str, truncate: bool) -> list[Row]:
        """Each input's ids and types: a text tokenized (after `prefix`), a list of ids as it
        is; longer than max_length: cut when `truncate`, else ContextLimitError naming it."""
        vocab = self.net.config.vocab_size
        rows = []
        for i, t in enumerate(texts):
            where = f"input[{i}]"
            if isinstance(t, str):
                ids, types = self.tokenizer.encode(prefix + t, truncate=truncate)
            elif isinstance(t, Sequence) and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in t
            ):
                ids = list(t)[: self.max_length] if truncate else list(t)
                types = [0] * len(ids)
            else:
                raise MlxlisError(f"expected a string or a list of ids below {vocab}", field=where)
            self._check(ids, where)
            rows.append((ids, types))
        return rows

    def _check(self, ids: list[int], where: str) -> None:
        if not ids:
            raise MlxlisError("an empty input", field=where)
        if len(ids) > self.max_length:
            raise ContextLimitError(
                f"{len(ids)} tokens, more than the model's {self.max_length} (truncate to cut it)",
                field=where,
            )

    def hidden(self, rows: Sequence[Row], reduce) -> mx.array:
        """reduce(h (B, T, hidden), mask (B, T)) -> (B, d) of each bucket, rows in order."""
        out: list[mx.array | None] = [None] * len(rows)
        for bucket in buckets([len(r[0]) for r in rows]):
            T = max(len(rows[i][0]) for i in bucket)
            ids = [rows[i][0] + [self.pad_id] * (T - len(rows[i][0])) for i in bucket]
            types = [rows[i][1] + [0] * (T - len(rows[i][1])) for i in bucket]
            mask = [[1] * len(rows[i][0]) + [0] * (T - len(rows[i][0])) for i in bucket]
            m = mx.array(mask, dtype=mx.int32)  # (B, T)
            h = self.net(mx.array(ids, dtype=mx.int32), m, mx.array(types, dtype=mx.int32))
            v = reduce(h, m)  # (B, d)
            mx.eval(v)
            for k, i in enumerate(bucket):
                out[i] = v[k]
        return mx.stack(out) if out else mx.zeros((0, 0), dtype=mx.float32)

    def embed(
        self,
        texts: Sequence[str | Sequence[int]],
        *,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        truncate: bool = True,
    ) -> mx.array:
        """(n, d) float32 vectors (d = `dimensions` when given: Matryoshka truncation)."""
        if isinstance(texts, str):
            raise MlxlisError("expected a list of inputs, got a string", field="input")
        if prompt_name is not None and prompt_name not in self.prompts:
            known = ", ".join(self.prompts) or "none"
            raise MlxlisError(
                f"no prompt {prompt_name!r} (the model has: {known})", field="prompt_name"
            )
        name = prompt_name if prompt_name is not None else self.default_prompt
        prefix = self.prompts.get(name, "") if name is not None else ""
        rows = self.rows(texts, prefix, truncate)
        if dimensions is not None:  # checked before the forward: a bad request costs nothing
            width = self.dims
            if (
                isinstance(dimensions, bool)
                or not isinstance(dimensions, int)
                or not 1 <= dimensions <= width
            ):
                raise MlxlisError(
                    f"dimensions must be an integer from 1 to {width}", field="dimensions"
                )
        if not rows:
            return mx.zeros((0, self.dims), dtype=mx.float32)
        v = self.hidden(rows, self.pooling)
        return matryoshka(v, dimensions, self.pooling.normalize)

    @property
    def dims(self) -> int:
        """The width of the vectors `embed` returns."""
        if self.pooling.dense:
            return int(self.pooling.dense[-1].weight.shape[0])
        return self.net.config.hidden_size * len(self.pooling.modes)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> list[float]:
        """Relevance of each document to `query`, in the documents' order. `instruction`: the
        task, for a reranker whose prompt states one (decoder_rerank.py); a cross-encoder
        takes none."""
        if instruction is not None:
            raise MlxlisError("this reranker takes no instruction", field="instruction")
        if not isinstance(query, str):
            raise MlxlisError("expected a string", field="query")
        rows = []
        for i, d in enumerate(documents):
            if not isinstance(d, str):
                raise MlxlisError("expected a string", field=f"documents[{i}]")
            row = self.tokenizer.encode(query, d, truncate=truncate)
            self._check(row[0], f"documents[{i}]")
            rows.append(row)
        if not rows:
            return []
        return self.hidden(rows, self.score)[:, 0].tolist()

    def score(self, h: mx.array, mask: mx.array) -> mx.array:
        """(B, T, hidden) states of a bucket of pairs, (B, T) mask -> (B, 1) scores: the
        classification head's logit, through `activation`."""
        logits = self.net.classify(h, mask).astype(mx.float32)[:, :1]  # (B, 1)
        return mx.sigmoid(logits) if self.activation == "sigmoid" else logits
