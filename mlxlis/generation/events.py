"""What the generation core gives every surface: one Event per token (and a final one) and
one Usage per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    """A request's counts and times; the same object is updated as it runs."""

    prompt_tokens: int = 0  # the whole prompt, cached part included
    cached_tokens: int = 0  # prompt tokens the caches held already (not prefilled)
    completion_tokens: int = 0  # sampled tokens, a stop token included
    time_to_first_token: float = 0.0  # seconds from the request's start
    decode_seconds: float = 0.0  # seconds after the first token
    peak_memory: int = 0  # bytes, set on the final event
    # how many prompt tokens a cached entry gave and why no more (PrefixCache.note), e.g.
    # "prefix 4123/4200 shared with a cached entry; reused 4100 (recurrent snapshot at 4100)"
    reuse_note: str = ""
    draft_tokens: int = 0  # speculative decoding: tokens proposed, and how many were kept
    accepted_tokens: int = 0
    speculation_note: str = ""  # why speculation rested, when it did

    @property
    def generated_tokens(self) -> int:
        return self.completion_tokens

    @property
    def prompt_seconds(self) -> float:
        return self.time_to_first_token

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens prefilled per second (the cached ones cost nothing)."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.time_to_first_token if self.time_to_first_token else 0.0

    @property
    def acceptance(self) -> float | None:
        """The share of drafted tokens kept (None: nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, over the time after the first."""
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


Stats = Usage  # the name `mlxlis.generate`'s events have always given it


@dataclass
class Event:
    """One token's text (never half a UTF-8 character, stop strings held back), or the final
    event (token None) with the finish reason."""

    token: int | None
    text: str
    usage: Usage
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" (final event)
    logprob: float | None = None  # when asked: the chosen token's, after the processors
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # finish_reason "error": what went wrong
    stop_sequence: str | None = None  # final event: the stop string that ended the text
    fed: list[int] = field(default_factory=list)  # final event: every id the caches hold
    # a chat reply's text split (ChatSession); elsewhere all of it is answer (None: `text`)
    reasoning: str = ""
    answer: str | None = None
    reasoning_tokens: int = 0  # tokens spent reasoning so far in this reply

    def __post_init__(self) -> None:
        if self.answer is None:
            self.answer = self.text

    @property
    def stats(self) -> Usage:
        return self.usage
