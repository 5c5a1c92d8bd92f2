"""The one context check: a prompt that does not fit is refused (never truncated); without an
explicit max_tokens, the default is cut to what is left of the context."""

from __future__ import annotations

from mlxlis.errors import ContextLimitError
from mlxlis.generation.sampling import SamplingParams


class ContextOverflow(ContextLimitError):
    """The prompt (and the completion asked for) exceed the context: the numbers, for the
    surfaces to word in their own API's terms."""

    def __init__(self, message: str, *, prompt: int, completion: int, limit: int, field: str):
        super().__init__(message, field=field)
        self.prompt, self.completion, self.limit = prompt, completion, limit


def fit_context(
    prompt: int,
    params: SamplingParams,
    limit: int,
    *,
    explicit: bool = False,
    field: str = "context",
    hint: str = "",
) -> SamplingParams:
    """`params` for a prompt of `prompt` tokens in a context of `limit`: max_tokens cut to what
    is left unless `explicit` (then a prompt + max_tokens over the limit is refused). `hint`
    ends the refusal's message (what the user can do)."""
    hint = f"; {hint}" if hint else ""
    if explicit and prompt + params.max_tokens > limit:
        raise ContextOverflow(
            f"the prompt ({prompt} tokens) and max_tokens ({params.max_tokens}) need "
            f"{prompt + params.max_tokens} tokens but the context holds {limit}{hint}",
            prompt=prompt,
            completion=params.max_tokens,
            limit=limit,
            field=field,
        )
    if prompt >= limit:
        raise ContextOverflow(
            f"the prompt needs {prompt} tokens but the context holds {limit}, which leaves no "
            f"room for a reply{hint}",
            prompt=prompt,
            completion=0,
            limit=limit,
            field=field,
        )
    if prompt + params.max_tokens > limit:
        params = params.replace(max_tokens=limit - prompt)
    return params
