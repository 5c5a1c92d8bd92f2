"""Request bodies of the OpenAI API, as pydantic models: types only, strictly (no "1" for 1).

Ranges are checked where they are defined once, `mlxlis.SamplingParams` (prepare.py), so the
server refuses exactly what the CLI and the library refuse. Every field of the API is used,
accepted as a no-op that does not change the answer (docs/api-fields.md lists them and why:
user, metadata, service_tier, …; `NO_OPS` here) or refused: a body's REFUSED fields (the
legacy functions, …) are a 400 naming them when set (service.read_body), never ignored.
Unknown fields (another server's extensions) are ignored, as OpenAI's SDKs send them only on
request (`extra_body`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, PrivateAttr


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # fields of the API that change the answer and cannot be honoured here -> why: set (not
    # null, false or empty, nor one of its ALLOWED values), a 400 naming the field
    REFUSED: ClassVar[dict[str, str]] = {}
    ALLOWED: ClassVar[dict[str, tuple[Any, ...]]] = {}  # a REFUSED field's values that are fine

    def refused(self) -> tuple[str, str] | None:
        """(field, why) of the first REFUSED field this body sets."""
        for name, why in self.REFUSED.items():
            value = getattr(self, name)
            if value not in (None, False, "", [], {}) and value not in self.ALLOWED.get(name, ()):
                return name, why
        return None


class StreamOptions(_Body):
    include_usage: bool = False


class ImageURL(_Body):
    url: str
    detail: str | None = None  # "auto" / "low" / "high": the model's processor decides


class InputAudio(_Body):
    data: str  # base64 of the file's bytes
    format: str | None = None  # "wav", "mp3", ...: the file's header says; not trusted over it


class ContentPart(_Body):
    type: str  # "text", "image_url" or "input_audio"
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None


class ToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class LoraChoice(_Body):
    """llama.cpp's per-request adapter: the id of one the server holds (GET /lora-adapters)
    and its scale (0: left out)."""

    id: int
    scale: float = 1.0


class _Sampling(_Body):
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not in OpenAI's API; vLLM's and llama.cpp's (-1 = off)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # token id (as text) -> bias in [-100, 100]
    # llama-server's names for its samplers (prepare.LLAMA_CPP maps them): the same body
    # that llama.cpp takes samples the same way here
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    typical_p: float | None = None
    top_n_sigma: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's: generate past end-of-sequence tokens (benchmarks)
    response_format: dict[str, Any] | None = None  # structured output (generation/constraints)
    kv_bits: int | None = None  # mlxlis': this request's KV cache format (4, 8; 16: dense)
    kv_group_size: int | None = None
    # mlxlis' extension, as Ollama's: how long the model stays loaded once idle (a duration
    # such as 5m, seconds, -1 forever, 0 at once)
    keep_alive: float | str | None = None
    # Ollama's options.num_ctx: this request's context, within the server's (--max-context)
    num_ctx: int | None = None
    # llama.cpp's: the LoRA adapter this request runs under, by id, and its scale (the
    # model's name may choose one too: BASE:NAME); [] the base
    lora: list[LoraChoice] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    # another API's names for fields its conversion moved (an image block's place), ours ->
    # theirs, the more specific first: what a refusal names (service.renamed)
    _renames: dict[str, str] = PrivateAttr(default_factory=dict)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # enforced calls: one unless true
    chat_template_kwargs: dict[str, Any] | None = None
    # the thinking switch of the model's template, where it has one (a template without one
    # thinks as it does: docs/api-fields.md)
    reasoning_effort: str | None = None
    functions: list[Any] | None = None  # the API's first, deprecated, form of tools
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    REFUSED: ClassVar[dict[str, str]] = {
        "functions": "the deprecated functions API is not served: send tools",
        "function_call": "the deprecated functions API is not served: send tool_choice",
        "audio": "audio output is not served: the models here write text",
        "modalities": 'only ["text"] is served',
        "web_search_options": "web search is not served here",
        "verbosity": 'not supported: the reply is as long as the model makes it ("medium")',
        "moderation": "moderation is not run here",
    }
    ALLOWED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "modalities": (["text"],),
        "verbosity": ("medium",),
    }


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def field_names(*models: type[BaseModel]) -> frozenset[str]:
    """Every field name of `models` and of the models their fields hold, nested ones
    included: the parts of a validation error's location that name the offending field (the
    others name a union member's type)."""
    seen: set[type] = set()
    names: set[str] = set()

    def walk(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                return
            seen.add(tp)
            for name, f in tp.model_fields.items():
                names.add(f.alias or name)
                walk(f.annotation)
        for arg in get_args(tp):
            walk(arg)

    for m in models:
        walk(m)
    return frozenset(names)


FIELD_NAMES = field_names(ChatCompletionRequest, CompletionRequest)


def param_path(loc: tuple[str | int, ...], names: frozenset[str] = FIELD_NAMES) -> str | None:
    """The field a pydantic error location points at, as OpenAI writes it: messages[0].role."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:
            out += f".{part}" if out else part
    return out or None


def offending(errors: list[Any], names: frozenset[str] = FIELD_NAMES) -> tuple[str | None, int]:
    """The field pydantic's `errors` name first (param_path) and the index of its error. A
    field of several types (content: text or a list of parts) has an error per type: the one
    that got deepest names the place (messages[1].content[0].input, not messages[1].content:
    a list was sent), unless places tie."""
    param = param_path(errors[0]["loc"], names)
    if param is None:
        return None, 0
    paths = [param_path(x["loc"], names) or "" for x in errors]
    inside = {
        p: p.count(".") + p.count("[")
        for p in paths
        if p.startswith(param) and p[len(param) : len(param) + 1] in ("", ".", "[")
    }
    deepest = [p for p, n in inside.items() if n == max(inside.values())]
    return (deepest[0], paths.index(deepest[0])) if len(deepest) == 1 else (param, 0)
