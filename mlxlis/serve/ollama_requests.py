"""Ollama's request bodies (pydantic, strict types, unknown fields ignored) and what they
become: the server's one chat request (or, for a raw /api/generate, a completion)."""

from __future__ import annotations

from typing import Any, Literal

from mlxlis.errors import MlxlisError
from mlxlis.models.model import Model
from mlxlis.serve.images import data_url
from mlxlis.serve.openai_format import MAX_TOP_LOGPROBS, APIError
from mlxlis.serve.prepare import Prepared, Target, prepare_completion
from mlxlis.serve.schemas import ChatCompletionRequest, CompletionRequest, _Body

from pydantic import Field, field_validator

# Ollama's option -> the chat request's field
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "typical_p": "typical_p",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "num_predict": "max_tokens",
    "num_ctx": "num_ctx",
    "stop": "stop",
    "kv_bits": "kv_bits",  # mlxlis' extension: this request's KV cache format
    "kv_group_size": "kv_group_size",
}
# the chat request's parameter names as this API calls them (in refusals), first match wins
NAMES = {
    "response_format.json_schema.schema": "format",
    "response_format": "format",
    "chat_template_kwargs": "think",
    **{ours: f"options.{theirs}" for theirs, ours in OPTIONS.items()},
}
NO_LIMIT = (-1, -2)  # num_predict: Ollama's "until the end" and "fill the context"


# the options Ollama's runner reads and that cannot change the answer are accepted as
# no-ops (fields.NO_OPS["ollama"] says why for each)
# options that would change the answer and are not honoured here -> why: set, a 400
OPTION_REFUSED = {
    "tfs_z": "tail-free sampling is not implemented (llama.cpp removed it): leave it unset or 1",
    "penalize_newline": "not implemented: the repetition penalty counts every token",
}


class Options(_Body):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    tfs_z: float | None = None
    penalize_newline: bool | None = None
    num_ctx: int | None = None
    num_keep: int | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None


class ToolCallFunction(_Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Body):
    id: str | None = None
    function: ToolCallFunction


class ToolFunction(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: str = "function"
    function: ToolFunction


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v  # Ollama reads "User" as "user"


class _Request(_Body):
    model: str
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | Literal["low", "medium", "high", "max"] | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None  # accepted: the one model stays loaded
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None
    width: int | None = None  # image generation's: refused (check_generate)
    height: int | None = None
    steps: int | None = None


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # Ollama's older name for `model`
    verbose: bool | None = None


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def sampling(req: _Request) -> dict[str, Any]:
    """The options and `format` as the server's request fields (chat and generate alike)."""
    body: dict[str, Any] = {}
    if req.options is not None:
        for name, why in OPTION_REFUSED.items():
            value = getattr(req.options, name)
            if value is not None and not (name == "tfs_z" and value == 1.0):
                raise bad(why, f"options.{name}")
        for theirs, ours in OPTIONS.items():
            if (v := getattr(req.options, theirs)) is not None:
                body[ours] = v
        if req.options.num_predict in NO_LIMIT:  # the server's default, bounded by the context
            del body["max_tokens"]
        if (req.options.seed or 0) < 0:  # Ollama's -1: a random seed
            del body["seed"]
    if req.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        schema = {"name": "format", "schema": req.format, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    return body


def templated(req: _Request, model: Model) -> dict[str, Any]:
    """`sampling` plus what only a templated prompt has: the model's thinking switch (as its
    template spells it), logprobs."""
    body = sampling(req)
    if req.think is not None:
        on = req.think is not False  # a level ("low" … "max") turns it on
        if switch := model.thinking_vars(on):
            body["chat_template_kwargs"] = switch
        elif on:
            raise bad("the model does not think (its chat template has no switch)", "think")
    if req.logprobs:
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    return body


def message_dict(m: Message, i: int, renames: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": with_images(m.content, m.images)}
    for k in range(len(m.images or ())):  # the images are the first parts
        renames[f"messages[{i}].content[{k}].image_url.url"] = f"messages[{i}].images[{k}]"
        renames[f"messages[{i}].content[{k}]"] = f"messages[{i}].images[{k}]"
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_name is not None:
        out["name"] = m.tool_name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": c.function.model_dump()}
            for c in m.tool_calls
        ]
    return out


def to_chat(req: ChatRequest, model: Model) -> ChatCompletionRequest:
    """The server's chat request for `req` (`model`: whose template has the thinking switch
    `think` sets)."""
    body = templated(req, model)
    renames: dict[str, str] = {}
    body["messages"] = [message_dict(m, i, renames) for i, m in enumerate(req.messages)]
    if req.tools:
        # Ollama has no tool_choice: the model decides ("auto")
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    chat = ChatCompletionRequest.model_validate(body)
    chat._renames = renames
    return chat


def with_images(text: str | None, images: list[str] | None) -> str | list[dict[str, Any]]:
    """A turn's content: its text, or its images (Ollama's base64, no data: prefix) as image
    parts, then the text."""
    if not images:
        return text or ""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url("image/*", b)}} for b in images
    ]
    return [*parts, {"type": "text", "text": text or ""}]


def check_generate(req: GenerateRequest) -> None:
    """What /api/generate has and this server cannot honour: a 400 naming it."""
    if req.images and req.raw:
        raise bad("not with raw: a raw prompt has no place for images", "images")
    if req.suffix:
        raise bad("fill-in-the-middle is not supported", "suffix")
    if req.template:
        raise bad("not supported: the model's own chat template renders every prompt", "template")
    if req.context:
        raise bad("not supported (deprecated by Ollama): send the turns to /api/chat", "context")
    for name in ("width", "height", "steps"):
        if getattr(req, name) is not None:
            raise bad("image generation is not served here", name)
    if req.raw and req.system:
        raise bad("not with raw: a raw prompt is used as it is", "system")


def generate_chat(req: GenerateRequest, model: Model) -> ChatCompletionRequest:
    """A templated /api/generate: the prompt as one user turn, after the system prompt."""
    body = templated(req, model)
    system = [{"role": "system", "content": req.system}] if req.system else []
    body["messages"] = [*system, {"role": "user", "content": with_images(req.prompt, req.images)}]
    chat = ChatCompletionRequest.model_validate(body)
    k = len(system)
    for n in range(len(req.images or ())):
        chat._renames[f"messages[{k}].content[{n}].image_url.url"] = f"images[{n}]"
        chat._renames[f"messages[{k}].content[{n}]"] = f"images[{n}]"
    return chat


def generate_raw(req: GenerateRequest) -> CompletionRequest:
    body = sampling(req)
    if req.logprobs:
        body["logprobs"] = req.top_logprobs or 0
    return CompletionRequest.model_validate({**body, "prompt": req.prompt})


def prepare_raw(t: Target, req: CompletionRequest) -> Prepared:
    """A raw prompt is a template's output: tokenized as a rendered chat prompt is (special
    tokens read as such, unlike /v1/completions' text), then prepared as token ids."""
    assert isinstance(req.prompt, str)
    try:
        ids = t.model.tokenizer.encode(req.prompt, special=True)
    except MlxlisError as e:
        raise bad(f"could not be tokenized: {e}", "prompt") from None
    return prepare_completion(t, req.model_copy(update={"prompt": ids}))
