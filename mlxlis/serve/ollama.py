"""Ollama's API: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version` and `/`, so that `mlxlis serve --port 11434` is all an Ollama client needs.

A thin adapter, like anthropic.py: a chat body becomes the server's chat request (`thinking`
as reasoning_content, tool calls with object arguments, `tool_name` as the tool message's name,
`think` as the template's `enable_thinking`, `format` as response_format, `options` as the
sampling values), prepared and generated like any other; /api/generate renders its prompt as a
user turn through the chat template, or (`raw`) tokenizes it as it is. Replies stream as
NDJSON, one object a line, the last with `done` and Ollama's counts and durations (in
nanoseconds). Options a local engine has no use for (num_ctx, num_gpu, mirostat, …) and
`keep_alive` are accepted and ignored; what cannot be honoured (images, a suffix, a template
of the request's own, a `context` array) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cache
from glob import escape
from pathlib import Path
from typing import Any, Literal, Protocol

from mlxlis import __version__
from mlxlis.errors import MlxlisError
from mlxlis.generation.events import Event
from mlxlis.loading.gguf import peek_metadata
from mlxlis.loading.gguf_split import SPLIT_NAME
from mlxlis.models.experts import QuantizedSwitchLinear
from mlxlis.runtime.device import device_name
from mlxlis.serve.openai_format import MAX_TOP_LOGPROBS, APIError, TokenText, chat_logprob, new_id
from mlxlis.serve.prepare import Prepared, Target, prepare_chat, prepare_completion
from mlxlis.serve.reply import ChatReply, Delta
from mlxlis.serve.schemas import ChatCompletionRequest, CompletionRequest, _Body
from mlxlis.serve.service import Run, Service, State, collect, end_error, read_body

import mlx.core as mx
import mlx.nn as nn
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from mlx.utils import tree_flatten
from pydantic import Field, field_validator

# Ollama's option -> the chat request's field
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "num_predict": "max_tokens",
    "stop": "stop",
}
# the chat request's parameter names as this API calls them (in refusals), first match wins
NAMES = {
    "response_format.json_schema.schema": "format",
    "response_format": "format",
    "chat_template_kwargs": "think",
    **{ours: f"options.{theirs}" for theirs, ours in OPTIONS.items()},
}
NO_LIMIT = (-1, -2)  # num_predict: Ollama's "until the end" and "fill the context"
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
DTYPES = {"mlx.core.float32": "F32", "mlx.core.float16": "F16", "mlx.core.bfloat16": "BF16"}


class Options(_Body):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    # accepted and ignored: every request is bounded by the server's context (--max-context)
    num_ctx: int | None = None


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


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # Ollama's older name for `model`
    verbose: bool | None = None


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def renamed(e: APIError) -> APIError:
    """A refusal of the chat request, with this API's names for its parameters."""
    for ours, theirs in NAMES.items():
        if e.param is not None and e.param.startswith(ours):
            e.message = e.message.replace(ours, theirs, 1)
            e.param = theirs + e.param[len(ours) :]
            break
    return e


def sampling(req: _Request) -> dict[str, Any]:
    """The options and `format` as the server's request fields (chat and generate alike)."""
    body: dict[str, Any] = {}
    if req.options is not None:
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


def templated(req: _Request, thinks: bool) -> dict[str, Any]:
    """`sampling` plus what only a templated prompt has: the reasoning switch, logprobs."""
    body = sampling(req)
    if req.think is not None:
        on = req.think is not False  # a level ("low" … "max") turns it on
        if thinks:
            body["chat_template_kwargs"] = {"enable_thinking": on}
        elif on:
            raise bad("the model does not think (its chat template has no switch)", "think")
    if req.logprobs:
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    return body


def message_dict(m: Message, i: int) -> dict[str, Any]:
    if m.images:
        raise bad("images are not supported: this model reads text only", f"messages[{i}].images")
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
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


def to_chat(req: ChatRequest, thinks: bool) -> ChatCompletionRequest:
    """The server's chat request for `req` (`thinks`: the template has the reasoning switch)."""
    body = templated(req, thinks)
    body["messages"] = [message_dict(m, i) for i, m in enumerate(req.messages)]
    if req.tools:
        # Ollama has no tool_choice: the model decides ("auto")
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return ChatCompletionRequest.model_validate(body)


def check_generate(req: GenerateRequest) -> None:
    """What /api/generate has and this server cannot honour: a 400 naming it."""
    if req.images:
        raise bad("images are not supported: this model reads text only", "images")
    if req.suffix:
        raise bad("fill-in-the-middle is not supported", "suffix")
    if req.template:
        raise bad("not supported: the model's own chat template renders every prompt", "template")
    if req.context:
        raise bad("not supported (deprecated by Ollama): send the turns to /api/chat", "context")
    if req.raw and req.system:
        raise bad("not with raw: a raw prompt is used as it is", "system")


def generate_chat(req: GenerateRequest, thinks: bool) -> ChatCompletionRequest:
    """A templated /api/generate: the prompt as one user turn, after the system prompt."""
    body = templated(req, thinks)
    system = [{"role": "system", "content": req.system}] if req.system else []
    body["messages"] = [*system, {"role": "user", "content": req.prompt}]
    return ChatCompletionRequest.model_validate(body)


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


class Reply(Protocol):
    content: str
    reasoning: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]

    def feed(self, ev: Event) -> Delta: ...


class RawReply:
    """A raw prompt's reply: the text as it comes (no reasoning split, no tool calls)."""

    def __init__(self, token_text: TokenText, logprobs: bool):
        self.token_text, self.want_logprobs = token_text, logprobs
        self.content, self.reasoning = "", ""
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []

    def feed(self, ev: Event) -> Delta:
        d = Delta(content=ev.text)
        if self.want_logprobs and ev.token is not None and ev.logprob is not None:
            d.logprobs.append(chat_logprob(self.token_text, ev.token, ev.logprob, ev.top_logprobs))
        self.content += d.content
        self.logprobs += d.logprobs
        return d


def tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """One of the reply's calls as Ollama writes it: the arguments as an object."""
    args = call["function"]["arguments"]
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = {}
    fn = {"index": call.get("index", 0), "name": call["function"]["name"]}
    return {"id": call["id"], "function": {**fn, "arguments": parsed}}


def chat_body(d: Delta) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": d.content}
    if d.reasoning:
        msg["thinking"] = d.reasoning
    if d.tool_calls:
        msg["tool_calls"] = [tool_call(c) for c in d.tool_calls]
    return {"message": msg}


def generate_body(d: Delta) -> dict[str, Any]:
    return {"response": d.content, **({"thinking": d.reasoning} if d.reasoning else {})}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class Shape:
    """The objects of one reply: the model's name as asked, the body of a delta (a chat
    message or a generate response), logprobs when asked, the counts at the end."""

    model: str
    body: Callable[[Delta], dict[str, Any]]
    logprobs: bool
    started: int  # time.monotonic_ns() when the request came

    def part(self, d: Delta) -> dict[str, Any]:
        out = {"model": self.model, "created_at": now(), **self.body(d)}
        if self.logprobs and d.logprobs:
            out["logprobs"] = d.logprobs
        return {**out, "done": False}

    def last(self, d: Delta, ev: Event) -> dict[str, Any]:
        u = ev.usage
        return {
            **self.part(d),
            "done": True,
            "done_reason": ev.finish_reason,
            "total_duration": time.monotonic_ns() - self.started,
            "load_duration": 0,  # the model was loaded when the server started
            "prompt_eval_count": u.prompt_tokens,
            "prompt_eval_duration": ns(u.time_to_first_token),
            "eval_count": u.completion_tokens,
            "eval_duration": ns(u.decode_seconds),
        }


def line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def ndjson(run: Run, reply: Reply, shape: Shape) -> AsyncIterator[str]:
    try:
        async for ev in run.events():
            if ev.finish_reason == "error":
                yield line({"error": end_error(run.state, ev).message})
                return
            d = reply.feed(ev)
            if d:
                yield line(shape.part(d))
            if ev.finish_reason is not None:
                yield line(shape.last(Delta(), ev))
    finally:
        run.close()


def loaded(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer to Ollama's "load the model" (a request with nothing to answer): the one
    model is loaded while the server runs, and stays loaded (keep_alive 0 unloads nothing)."""
    return {"model": model, "created_at": now(), **body, "done": True, "done_reason": "load"}


def tag(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def weights_bytes(path: Path) -> int:
    """The weights' files: a folder's safetensors, a GGUF file (every part of a split one)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    m = SPLIT_NAME.match(path.name)
    parts = path.parent.glob(f"{escape(m['prefix'])}-*-of-{m['count']}.gguf") if m else [path]
    return sum(p.stat().st_size for p in parts)


def file_type(path: Path) -> str | None:
    """A GGUF's file type as llama.cpp (and Ollama) name it, Q4_K_M, when the file says."""
    from gguf import LlamaFileType  # gguf-py's constants take 0.7 s to import

    ftype = peek_metadata(path, ["general.file_type"]).get("general.file_type")
    try:
        return LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return None


def parameter_count(net: nn.Module) -> int:
    """The network's weights, packed quantized ones unpacked (pipelined: this rank's share)."""
    bits = {name: m.bits for name, m in net.named_modules() if isinstance(m, QUANTIZED)}
    total = 0
    for name, a in tree_flatten(net.parameters()):
        owner, _, leaf = name.rpartition(".")
        if owner not in bits or leaf not in ("weight", "scales", "biases"):
            total += a.size
        elif leaf == "weight":  # 32 // bits values in each uint32
            total += a.size * 32 // bits[owner]
    return total


def human(n: int) -> str:
    """A count as Ollama writes parameter_size: 135M, 494.03M, 7.6B."""
    for unit, size, digits in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= size:
            x = n / size
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{digits}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def quantization(model: Any) -> str:
    """The weights' type as Ollama names it: a GGUF's file type (Q4_K_M), MLX's bits (Q4),
    else the dtype they run in (F32, F16, BF16)."""
    if model.format == "gguf" and (ftype := file_type(model.path)):
        return ftype
    bits = (model.config.quantization or {}).get("bits")
    return f"Q{bits}" if bits else DTYPES.get(str(model.dtype), str(model.dtype))


def model_info(model: Any, context: int, count: int) -> dict[str, Any]:
    c, arch = model.config, model.config.family
    return {
        "general.architecture": arch,
        "general.parameter_count": count,
        # what a request may use, the server's bound: clients size their prompts by it
        f"{arch}.context_length": context,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.vocab_size": c.vocab_size,
    }


def parameters(state: State) -> str:
    """The server's defaults as `ollama show` prints a model's parameters."""
    d = state.target.defaults
    rows: list[tuple[str, Any]] = [("num_ctx", state.target.max_context)]
    rows += [("num_predict", d.max_tokens), ("temperature", d.temperature), ("top_k", d.top_k)]
    rows += [("top_p", d.top_p), ("min_p", d.min_p), ("repeat_penalty", d.repetition_penalty)]
    rows += [("repeat_last_n", d.repetition_context)]
    stops = sorted(s for s in map(state.token_text, state.target.stop_ids) if s.strip())
    rows += [("stop", json.dumps(s, ensure_ascii=False)) for s in stops]
    return "\n".join(f"{k:<30} {v}" for k, v in rows)


def router(svc: Service, auth: list) -> APIRouter:
    r = APIRouter()
    state = svc.state
    name = tag(state.model_id)
    known = state.names | {tag(n) for n in state.names}

    def check(model: str) -> None:
        if model not in known:
            raise APIError(404, f"model '{model}' not found", param="model")

    @cache
    def count() -> int:
        return parameter_count(state.target.model.net)

    @cache
    def card() -> dict[str, Any]:
        model = state.target.model
        details = {
            "parent_model": "",
            "format": "gguf" if model.format == "gguf" else "safetensors",
            "family": model.config.family,
            "families": [model.config.family],
            "parameter_size": human(count()),
            "quantization_level": quantization(model),
        }
        return {
            "name": name,
            "model": name,
            "modified_at": datetime.fromtimestamp(model.path.stat().st_mtime, timezone.utc),
            "size": weights_bytes(model.path),
            "digest": hashlib.sha256(state.fingerprint.encode()).hexdigest(),
            "details": details,
        }

    async def listed() -> dict[str, Any]:
        return await asyncio.to_thread(card)  # the first time, reads a GGUF's header

    async def prepared(fn: Callable[..., Prepared], body: Any) -> Prepared:
        try:
            return await svc.prepare(fn, body)
        except APIError as e:
            raise renamed(e) from None

    async def answer(
        request: Request, prep: Prepared, reply: Reply, shape: Shape, stream: bool
    ) -> Any:
        run = svc.submit(prep, new_id("ollama"), request)
        if stream:
            return StreamingResponse(ndjson(run, reply, shape), media_type="application/x-ndjson")
        ev = await collect(run, reply.feed)
        return shape.last(
            Delta(reply.content, reply.reasoning, reply.tool_calls, reply.logprobs), ev
        )

    def chat_reply(prep: Prepared, logprobs: bool) -> ChatReply:
        assert prep.prompt is not None
        model = state.target.model
        return ChatReply(
            model.tokenizer,
            state.token_text,
            prep.prompt,
            logprobs=logprobs,
            tools=prep.tools,
            tool_format=prep.tool_format,
            forced=prep.forced,
        )

    @r.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def root() -> str:
        return "Ollama is running"  # what clients probe before anything else

    @r.post("/api/chat", dependencies=auth)
    async def chat(request: Request) -> Any:
        started = time.monotonic_ns()
        req = await read_body(request, ChatRequest, state.max_body)
        check(req.model)
        if not req.messages:
            return loaded(req.model, {"message": {"role": "assistant", "content": ""}})
        prep = await prepared(prepare_chat, to_chat(req, state.target.model.supports_thinking))
        shape = Shape(req.model, chat_body, bool(req.logprobs), started)
        return await answer(request, prep, chat_reply(prep, bool(req.logprobs)), shape, req.stream)

    @r.post("/api/generate", dependencies=auth)
    async def generate(request: Request) -> Any:
        started = time.monotonic_ns()
        req = await read_body(request, GenerateRequest, state.max_body)
        check(req.model)
        check_generate(req)
        if not req.prompt:
            return loaded(req.model, {"response": ""})
        shape = Shape(req.model, generate_body, bool(req.logprobs), started)
        reply: Reply
        if req.raw:
            prep = await prepared(prepare_raw, generate_raw(req))
            reply = RawReply(state.token_text, bool(req.logprobs))
        else:
            chat = generate_chat(req, state.target.model.supports_thinking)
            prep = await prepared(prepare_chat, chat)
            reply = chat_reply(prep, bool(req.logprobs))
        return await answer(request, prep, reply, shape, req.stream)

    @r.get("/api/tags", dependencies=auth)
    async def tags() -> dict[str, Any]:
        return {"models": [await listed()]}

    @r.post("/api/show", dependencies=auth)
    async def show(request: Request) -> dict[str, Any]:
        req = await read_body(request, ShowRequest, state.max_body)
        asked = req.model or req.name
        if not asked:
            raise bad("is required", "model")
        check(asked)
        model, listing = state.target.model, await listed()
        # the template is Jinja, the model's own: given in `template`, not as a TEMPLATE line
        modelfile = f"# served by mlxlis serve\nFROM {model.path}\n" + "".join(
            f"PARAMETER {row}\n" for row in parameters(state).splitlines()
        )
        return {
            "modelfile": modelfile,
            "parameters": parameters(state),
            "template": model.template.text if model.template is not None else "",
            "details": listing["details"],
            "model_info": model_info(model, state.target.max_context, count()),
            "capabilities": [
                "completion",
                *(["tools"] if "tools" in model.template_variables else []),
                *(["thinking"] if model.supports_thinking else []),
            ],
            "modified_at": listing["modified_at"],
        }

    @r.get("/api/ps", dependencies=auth)
    async def ps() -> dict[str, Any]:
        listing = {k: v for k, v in (await listed()).items() if k != "modified_at"}
        size = mx.get_active_memory()  # MLX's arrays now, the weights included
        # loaded for as long as the server runs: Ollama's keep_alive -1, which `ollama ps`
        # shows as "Forever" (over 20 years ahead)
        expires = datetime.now(timezone.utc) + timedelta(days=365 * 100)
        return {
            "models": [
                {
                    **listing,
                    "size": size,
                    "size_vram": 0 if device_name() == "cpu" else size,
                    "expires_at": expires.isoformat(),
                    "context_length": state.target.max_context,
                }
            ]
        }

    @r.get("/api/version", dependencies=auth)
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return r
