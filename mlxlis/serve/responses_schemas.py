"""Request bodies of OpenAI's Responses API, as pydantic models (strict types, unknown
fields ignored, as schemas.py's)."""

from __future__ import annotations

from typing import Any, ClassVar

from mlxlis.serve.schemas import _Body


class Part(_Body):
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image's (a data: URL, or http(s))
    file_id: str | None = None  # an input_image from the Files API: refused
    input_audio: dict[str, Any] | None = None  # an input_audio's {"data": base64, "format"}


class Item(_Body):
    """One input item; which fields count depends on `type` (a message when it has none)."""

    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a function_call's, when its function is a namespace's
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[Part] | None = None


class Text(_Body):
    format: dict[str, Any] | None = None


class Reasoning(_Body):
    effort: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    kv_bits: int | None = None  # mlxlis' extension: this request's KV cache format
    kv_group_size: int | None = None
    keep_alive: float | str | None = None  # mlxlis' extension, as Ollama's (schemas._Sampling)
    text: Text | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    # output_text's logprobs ("message.output_text.logprobs"); what else it may name is
    # never made here (fields.INCLUDE_NO_OPS)
    include: list[str] | None = None
    top_logprobs: int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    context_management: list[Any] | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    truncation: str | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: Any = None
    REFUSED: ClassVar[dict[str, str]] = {
        "conversation": "conversations are not kept here: send previous_response_id, or the "
        "whole input",
        "prompt": "stored prompts are not kept here: send instructions and input",
        "background": "background runs are not served: the reply comes with the request",
        "context_management": "the context is not compacted here: a request past it is refused",
        "max_tool_calls": "not enforced here: the model's calls come back to the client, "
        "which decides",
        "truncation": 'only "disabled" is served: a conversation past the context is '
        "refused, never cut",
        "moderation": "moderation is not run here",
        "image": "image generation is not served here",
        "access_programs": "the provider's access programs are not served here",
    }
    ALLOWED: ClassVar[dict[str, tuple[Any, ...]]] = {"truncation": ("disabled",)}
