"""ChatSession: a multi-turn conversation that reuses the KV cache between turns.

Before each turn the whole conversation is rendered with the model's chat template and
tokenized; the cache keeps the longest common token prefix with what it already holds and only
the rest is prefilled. When the conversation no longer fits in the context, the turn is refused
with a ContextLimitError (no silent truncation); `reset()` starts over.

Replies of reasoning models (`<think>…</think>`, see mlxlis.reasoning) stream as ChatEvents that
say which part of each piece is reasoning and which is answer; the history keeps the answer as
the message content and the reasoning as its `reasoning_content`, the field Qwen3-style
templates read. `thinking` sets the template's `enable_thinking` switch when it has one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from .cache import common_prefix, rewind
from .errors import ContextLimitError
from .generate import Event, generate
from .reasoning import ANSWER, REASONING, ReasoningSplitter, join
from .sampling import SamplingParams


@dataclass
class Turn:
    role: str
    content: str
    stopped: bool = False  # an assistant reply cut short by the user
    reasoning: str | None = None  # an assistant reply's reasoning (the <think> block), if any

    def message(self) -> dict:
        msg = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        return msg


@dataclass
class ChatEvent(Event):
    """An Event of a chat reply, its text split: `reasoning` + `answer` (tags removed)."""

    reasoning: str = ""
    answer: str = ""
    reasoning_tokens: int = 0  # tokens spent reasoning so far in this reply

    @classmethod
    def of(
        cls, ev: Event, reasoning: str = "", answer: str | None = None, reasoning_tokens: int = 0
    ) -> ChatEvent:
        """`ev` with its text split as given (by default all of it is answer)."""
        base = {f.name: getattr(ev, f.name) for f in fields(Event)}
        return cls(**base, reasoning=reasoning, answer=ev.text if answer is None else answer,
                   reasoning_tokens=reasoning_tokens)  # fmt: skip


@dataclass
class ChatSession:
    model: object
    system: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_limit: int | None = None
    turns: list[Turn] = field(default_factory=list)
    thinking: bool | None = None  # enable_thinking for the template; None: its default

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"ChatSession(sampling=...) takes a SamplingParams, not "
                            f"{type(self.sampling).__name__}")  # fmt: skip
        if self.context_limit is None:
            self.context_limit = self.model.context_length
        self._cache: list | None = None
        self._cached: list[int] = []  # token ids whose K/V the cache holds, in order
        self.last_prompt_tokens = 0
        self.last_reused_tokens = 0

    # --- conversation ---
    @property
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [t.message() for t in self.turns]

    def reset(self) -> None:
        """Forget the conversation and the cache (the system prompt stays)."""
        self.turns.clear()
        self._cache, self._cached = None, []

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    @property
    def template_vars(self) -> dict[str, Any]:
        """Variables passed to the template on every render: `enable_thinking` when `thinking`
        is set and the template reads it (a template without the switch never gets it)."""
        if self.thinking is None or not getattr(self.model, "supports_thinking", False):
            return {}
        return {"enable_thinking": bool(self.thinking)}

    def render(self, add_generation_prompt: bool = True) -> str:
        """The exact text the model sees next (special tokens included)."""
        return self.model.render_chat(
            self.messages, add_generation_prompt=add_generation_prompt, **self.template_vars
        )

    def prompt_preview(self, pending_user: str | None = None) -> str:
        """What the model would receive if `pending_user` were sent now."""
        if pending_user is None:
            return self.render()
        self.turns.append(Turn("user", pending_user))
        try:
            return self.render()
        finally:
            self.turns.pop()

    @property
    def context_used(self) -> int:
        return len(self._cached)

    # --- generation ---
    def send(
        self,
        text: str,
        should_stop: Callable[[], bool] | None = None,
        *,
        stop_ids: set[int] | None = None,
        **sampling,
    ) -> Iterator[ChatEvent]:
        """Add a user message and stream the assistant's reply (appended when it ends);
        `sampling` keywords override the session's SamplingParams for this turn, `stop_ids`
        the model's end-of-turn tokens."""
        params = self.sampling.replace(**sampling)  # a bad value is refused before the turn
        self.turns.append(Turn("user", text))
        try:
            prompt = self.render()
            ids = self.model.tokenizer.encode(prompt, special=True)
            self._check_fits(ids)
        except Exception:
            self.turns.pop()  # a refused turn leaves the conversation as it was
            raise
        splitter = ReasoningSplitter.for_prompt(self.model.tokenizer, prompt)
        yield from self._reply(ids, should_stop, params, stop_ids, splitter)

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.context_limit:
            raise ContextLimitError(
                f"the conversation needs {len(ids)} tokens but the context holds "
                f"{self.context_limit}; start a new session (/clear) or shorten it",
                field="context",
            )

    def _reply(
        self,
        ids: list[int],
        should_stop,
        params: SamplingParams,
        stop_ids: set[int] | None,
        splitter: ReasoningSplitter,
    ) -> Iterator[ChatEvent]:
        cache, reuse = self._reusable(ids)
        max_tokens = min(params.max_tokens, self.context_limit - len(ids))
        self.last_prompt_tokens, self.last_reused_tokens = len(ids), reuse
        self._cache, self._cached = cache, list(ids[:reuse])  # consistent even if interrupted
        segments: list = []
        final: Event | None = None
        try:
            for ev in generate(
                self.model,
                ids[reuse:],
                params,
                max_tokens=max_tokens,
                cache=cache,
                history=ids[:reuse],
                should_stop=should_stop,
                stop_ids=stop_ids,
            ):
                parts = splitter.feed(ev.text, ev.token)
                if ev.finish_reason is not None:
                    final = ev
                    parts += splitter.flush()
                segments += parts
                yield ChatEvent.of(ev, join(parts, REASONING), join(parts, ANSWER),
                                   splitter.reasoning_tokens)  # fmt: skip
        finally:
            stopped = final is None or final.finish_reason == "cancelled"
            if final is not None:
                self._cached = list(ids[:reuse]) + final.fed
            else:  # the consumer abandoned the stream mid-way: the cache state is unknown
                self._cache, self._cached = None, []
                segments += splitter.flush()
            reasoning = join(segments, REASONING) if splitter.saw_reasoning else None
            answer = join(segments, ANSWER)
            self.turns.append(Turn("assistant", answer, stopped=stopped, reasoning=reasoning))

    def _reusable(self, ids: list[int]) -> tuple[list, int]:
        """A cache holding the longest common prefix of `ids` (at least one id left to feed)."""
        common = min(common_prefix(self._cached, ids), len(ids) - 1)
        if self._cache is not None and common > 0:
            reused = rewind(self._cache, len(self._cached), common)
            if reused:
                return self._cache, reused
        return self.model.make_cache(), 0
