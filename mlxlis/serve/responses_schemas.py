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
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    REFUSED: ClassVar[dict[str, str]] = {
        "conversation": "conversations are not kept here: send previous_response_id, or the "
        "whole input",
        "prompt": "stored prompts are not kept here: send instructions and input",
    }
