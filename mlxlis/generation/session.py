"""ChatSession: a multi-turn conversation that reuses the KV cache between turns.

Before each turn the whole conversation is rendered with the model's chat template and
tokenized (the one request builder, generation/request.py); the caches of the previous turn
(a prefix cache of one entry, the server's code) are rewound to the longest token prefix they
share with it and only the rest is prefilled.
The caches keep a snapshot where the conversation ends before the generation prompt
(`turn_start`): templates re-render a past reply differently (without its reasoning,
trimmed), so that is where the next turn's prompt parts from this one, and recurrent layers
and sliding-window rings return there exactly.
When the conversation no longer fits in the context, the turn is refused with a
ContextLimitError (no silent truncation); `reset()` starts over.

Replies of reasoning models (`<think>…</think>`, see mlxlis.prompt.reasoning) stream as Events
whose `reasoning` and `answer` say which part of each piece is which; the history keeps the
answer as the message content and the reasoning as its `reasoning_content`, the field Qwen3-style
templates read. `thinking` sets the template's thinking switch when it has one, as the template
spells it (`enable_thinking`, `thinking_budget`, `reasoning_effort`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.generation.core import Core, Request
from mlxlis.generation.events import Event
from mlxlis.generation.generate import run
from mlxlis.generation.request import Ask, build
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.steps import steps_for
from mlxlis.models.model import Model
from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter, Splitter, join


@dataclass
class Turn:
    role: str
    content: str | list[dict]  # a user turn's parts: text, and images once prepared
    stopped: bool = False  # an assistant reply cut short by the user
    reasoning: str | None = None  # an assistant reply's reasoning (the <think> block), if any

    def message(self) -> dict:
        msg = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        return msg


@dataclass
class ChatSession:
    model: Model
    system: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_limit: int | None = None
    turns: list[Turn] = field(default_factory=list)
    thinking: bool | None = None  # the template's thinking switch; None: its default
    response_format: dict | None = None  # every reply constrained (generation/constraints)
    speculation: Speculation | None = None  # every reply drafted and verified (speculative.py)
    # a folder where `save_cache` keeps the conversation's caches: a later session of the same
    # model (after a restart) whose prompt shares the conversation reads them back
    cache_dir: str | Path | None = None
    cache_dir_bytes: int = 4 << 30
    warnings: list[str] = field(default_factory=list)  # the cache folder's bad files, skipped

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(
                f"ChatSession(sampling=...) takes a SamplingParams, not "
                f"{type(self.sampling).__name__}"
            )
        if self.context_limit is None:
            self.context_limit = self.model.context_length
        # the conversation's caches between turns: a prefix cache of one entry, unbounded
        disk = None
        if self.cache_dir is not None:
            key = self.model.cache_key()
            make = self.model.make_cache
            disk = DiskCache(self.cache_dir, self.cache_dir_bytes, key, make, self.warnings.append)
        self._prefix = PrefixCache(1 << 62, max_entries=1, disk=disk, write_through=False)
        self._core = Core(self.model, steps_for(self.model, self._prefix))
        self._cached: list[int] = []  # token ids the caches hold, in order
        self.last_prompt_tokens = 0
        self.last_reused_tokens = 0

    # --- conversation ---
    @property
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [t.message() for t in self.turns]

    def save_cache(self) -> bool:
        """Keep the conversation's caches in `cache_dir` (False: no folder, or nothing held)."""
        return self._prefix.save() > 0

    def reset(self) -> None:
        """Forget the conversation and the cache (the system prompt stays)."""
        self.turns.clear()
        self._prefix.clear()
        self._cached = []

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    @property
    def template_vars(self) -> dict[str, Any]:
        """Variables passed to the template on every render: its thinking switch set to
        `thinking` when that is set and the template has one (a template without a switch
        gets none)."""
        if self.thinking is None:
            return {}
        return self.model.thinking_vars(bool(self.thinking))

    def render(self, add_generation_prompt: bool = True) -> str:
        """The exact text the model sees next (special tokens included; each image's
        placeholders expanded as the model reads them)."""
        if any(isinstance(t.content, list) for t in self.turns):
            prompt = self.model.encode_chat(
                self.messages, add_generation_prompt, **self.template_vars
            )
            return prompt.text
        return self.model.render_chat(
            self.messages, add_generation_prompt=add_generation_prompt, **self.template_vars
        )

    def prompt_preview(self, pending_user: str | list[dict] | None = None) -> str:
        """What the model would receive if `pending_user` (text or content parts, images
        prepared) were sent now."""
        if pending_user is None:
            return self.render()
        if isinstance(pending_user, list):
            pending_user = self._prepared(pending_user, len(self.messages))
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
        text: str | list[dict],
        should_stop: Callable[[], bool] | None = None,
        *,
        stop_ids: set[int] | None = None,
        **sampling,
    ) -> Iterator[Event]:
        """Add a user message and stream the assistant's reply (appended when it ends);
        `sampling` keywords override the session's SamplingParams for this turn, `stop_ids`
        the model's end-of-turn tokens. `text` may be content parts, images among them
        ({"type": "image", "image": PATH | bytes | PIL.Image}): each is prepared once, and a
        later turn about it reuses the caches past it."""
        params = self.sampling.replace(**sampling)  # a bad value is refused before the turn
        self.turns.append(Turn("user", text))
        try:
            if isinstance(text, list):
                self.turns[-1].content = self._prepared(text, len(self.messages) - 1)
            ask = Ask(
                self.messages,
                params,
                thinking=self.thinking,
                response_format=self.response_format,
                stop_ids=None if stop_ids is None else frozenset(stop_ids),
                speculation=self.speculation,
                context_field="context",
                context_hint="start a new session (/clear) or shorten it",
            )
            built = build(self.model, ask, context=self.context_limit or 0)
        except Exception:
            self.turns.pop()  # a refused turn leaves the conversation as it was
            raise
        prompt = built.prompt
        splitter = ReasoningSplitter.for_prompt(self.model.tokenizer, prompt, self.model.template)
        yield from self._reply(built.request, should_stop, splitter)

    def _prepared(self, parts: list[dict], index: int) -> list[dict]:
        """`parts` with each image opened and preprocessed now (a bad one refused, naming
        its part), kept so later turns do not read it again."""
        out = []
        for j, part in enumerate(parts):
            image = self.model.image_part(part, f"messages[{index}].content[{j}]")
            out.append(part if image is None else {"type": "image", "image": image})
        return out

    def _reply(
        self,
        req: Request,
        should_stop: Callable[[], bool] | None,
        splitter: Splitter,
    ) -> Iterator[Event]:
        seq = self._core.start(req)
        self.last_prompt_tokens, self.last_reused_tokens = len(req.prompt), seq.usage.cached_tokens
        self._cached = []  # until the reply ends, the caches are the reply's
        segments: list = []
        final: Event | None = None
        try:
            for ev in run(self._core, seq, should_stop):
                parts = splitter.feed(ev.text, ev.token)
                if ev.finish_reason is not None:
                    final = ev
                    parts += splitter.flush()
                segments += parts
                yield replace(
                    ev,
                    reasoning=join(parts, REASONING),
                    answer=join(parts, ANSWER),
                    reasoning_tokens=splitter.reasoning_tokens,
                )
        finally:
            stopped = final is None or final.finish_reason == "cancelled"
            if final is None:  # the consumer left mid-way: the core released the caches whole
                segments += splitter.flush()
            self._cached = list(seq.fed)
            reasoning = join(segments, REASONING) if splitter.saw_reasoning else None
            answer = join(segments, ANSWER)
            self.turns.append(Turn("assistant", answer, stopped=stopped, reasoning=reasoning))
