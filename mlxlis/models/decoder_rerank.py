"""A causal LM as a reranker, by Qwen3-Reranker's recipe: each (query, document) pair becomes
its prompt (a system turn asking for "yes" or "no", the instruction, query and document as the
user turn, an empty thinking block opening the answer), and its relevance is
p("yes") / (p("yes") + p("no")) at the prompt's last position.

Such a checkpoint is a plain causal LM folder (Qwen3ForCausalLM): nothing in it says it ranks,
so it is a reranker only when the load asks (`mlxlis.load(ref, task="rerank")`); its vocabulary
must hold "yes" and "no" as single tokens, else the load is refused naming them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlxlis.errors import MlxlisError, UnsupportedError
from mlxlis.models.decoder_encoder import DecoderEncoder
from mlxlis.models.embedding import Embedder
from mlxlis.models.model import Model
from mlxlis.models.pooling import POOLERS
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx

SYSTEM = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class PromptPairs:
    """(query, document) -> the prompt's ids (and token types, all 0): the pair tokenizer
    Embedder.rerank runs. The system prefix and the suffix are parsed for their special
    tokens; the instruction, query and document are plain text (a document cannot close the
    turn). Past `max_length`, the middle part is cut from its end, prefix and suffix kept."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, instruction: str = INSTRUCTION):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.instruction = instruction  # the task, as the recipe lets a caller set it
        self._prefix = tokenizer.encode(SYSTEM, special=True)
        self._suffix = tokenizer.encode(SUFFIX, special=True)

    def with_instruction(self, instruction: str) -> PromptPairs:
        """The same prompt for another task."""
        return PromptPairs(self.tokenizer, self.max_length, instruction)

    def encode(
        self, query: str, doc: str | None = None, truncate: bool = True
    ) -> tuple[list[int], list[int]]:
        text = BODY.format(instruction=self.instruction, query=query, doc=doc or "")
        body = self.tokenizer.encode(text, special=False)
        room = max(self.max_length - len(self._prefix) - len(self._suffix), 0)
        if truncate and len(body) > room:
            body = body[:room]
        ids = self._prefix + body + self._suffix
        return ids, [0] * len(ids)


@dataclass
class YesNoReranker(Embedder):
    """Scores a bucket of prompts by the yes / no logits at each row's last real token."""

    yes_id: int = -1
    no_id: int = -1

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> list[float]:
        """As Embedder.rerank, the prompt stating `instruction` (default: the load's)."""
        if instruction is None:
            return super().rerank(query, documents, truncate=truncate)
        if not isinstance(instruction, str):
            raise MlxlisError("expected a string", field="instruction")
        asked = replace(self, tokenizer=self.tokenizer.with_instruction(instruction))
        return Embedder.rerank(asked, query, documents, truncate=truncate)

    def score(self, h: mx.array, mask: mx.array) -> mx.array:
        last = POOLERS["lasttoken"](h, mask)  # (B, hidden), before the final norm
        logits = self.net.net.head(last[:, None, :])[:, 0].astype(mx.float32)  # (B, vocab)
        pair = mx.stack([logits[:, self.no_id], logits[:, self.yes_id]], axis=-1)  # (B, 2)
        return mx.softmax(pair, axis=-1, precise=True)[:, 1:]  # (B, 1): p(yes | yes or no)


def _single(tokenizer: Tokenizer, word: str, model: Model) -> int:
    ids = tokenizer.encode(word, special=False)
    if len(ids) != 1:
        raise UnsupportedError(
            f"a yes/no reranker needs {word!r} as one token ({len(ids)} here)",
            path=model.path,
            field="task",
        )
    return ids[0]


def as_reranker(model: Model, instruction: str = INSTRUCTION) -> Model:
    """`model` (a causal LM just loaded) turned into a reranker (task "rerank")."""
    if not model.config.attention.causal or model.part is not None:
        raise UnsupportedError(
            "only a whole causal LM reranks by yes / no", path=model.path, field="task"
        )
    tok = model.tokenizer
    yes, no = _single(tok, "yes", model), _single(tok, "no", model)
    limit = model.config.max_position_embeddings
    model.embedder = YesNoReranker(
        net=DecoderEncoder(model.net, final_norm=False),
        tokenizer=PromptPairs(tok, limit, instruction),
        pad_id=0,  # after each row's last token: never seen by a real one
        task="rerank",
        yes_id=yes,
        no_id=no,
    )
    model.task = "rerank"
    return model
