"""Messages -> the core's Request, in one place: what the one-shot command, ChatSession (and
the chat app on it) and every server dialect ask of a model is an `Ask` (the conversation as
chat templates take it, its images, tools and tool choice, the thinking switch, a response
format, stop strings, sampling), and `build` turns it into the Request the core runs, with
what reading the reply needs (the rendered prompt, the tool format, the call the prompt
opened).

`build` refuses what it cannot honour with an MlxlisError naming the field: RequestError for
its own checks (a tool choice naming no tool, a constraint that cannot be enforced, an image
past the context), the template's and the image reader's own errors, and ContextOverflow when
the prompt (and an explicit max_tokens) do not fit. Each surface words them in its own shape
(serve/prepare.py in the APIs', the CLI and the chat app as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxlis.cache.rewind import common_prefix
from mlxlis.cache.store import KVChoice
from mlxlis.errors import MlxlisError
from mlxlis.generation.constraints import ConstraintError, constraint
from mlxlis.generation.context import fit_context
from mlxlis.generation.core import Request
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.tool_grammar import ParametersError, tag_ids, tool_grammar
from mlxlis.models.model import Model
from mlxlis.prompt.tool_calls import tool_names, tool_schemas
from mlxlis.prompt.tool_formats import ToolFormat, for_template, template_format

MAX_IMAGES = 16  # images in one request: each is decoded and preprocessed before it runs


class RequestError(MlxlisError):
    """A part of an Ask that cannot be honoured: its message whole (as a surface shows it),
    the field it names, and its error code in OpenAI's terms (None: none applies)."""

    def __init__(self, text: str, field: str, code: str | None = "invalid_value"):
        super().__init__(text)
        self.field, self.code = field, code


@dataclass(frozen=True)
class Ask:
    """What a surface asks of the model. `messages` as chat templates take them (images as
    content parts); `template_vars` reach the template (a client's own win over `thinking`'s
    switch); `tools` in OpenAI's function shape with `tool_choice` as OpenAI's ("auto",
    "required", {"type": "function", "function": {"name": …}}, "none"); `explicit`: max_tokens
    was asked for (refused past the context with `strict`, else cut to it)."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    thinking: bool | None = None
    template_vars: Mapping[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = False
    response_format: dict[str, Any] | None = None
    stop_strings: tuple[str, ...] = ()
    stop_ids: frozenset[int] | None = None  # None: the model's end-of-turn tokens
    ignore_eos: bool = False
    top_logprobs: int | None = None
    speculation: Speculation | None = None
    kv_format: KVChoice = "model"
    explicit: bool = False
    strict: bool = False
    context_field: str = "messages"  # what a context refusal names
    context_hint: str = ""  # ends a context refusal's message (what the user can do)
    adapter: str | None = None  # the LoRA adapter it runs under (Model.selectable's name)
    adapter_scale: float = 1.0  # a multiplier on that adapter's scale


@dataclass
class Built:
    request: Request
    prompt: str  # the rendered chat prompt (where a reply's reasoning starts)
    # the offered tools' parameters by name (how a reply's calls are read), None: no tools
    tools: dict[str, Any] | None = None
    tool_format: ToolFormat | None = None  # how the template has the model write calls
    forced: str = ""  # text the prompt ends with that opens a call (tool_choice)
    asked: int | None = None  # the max_tokens asked for, when the context cut it
    messages: list[dict[str, Any]] = field(default_factory=list)  # images prepared


@dataclass
class _Tools:
    variables: dict[str, Any]
    schemas: dict[str, Any] | None = None
    fmt: ToolFormat | None = None
    forced: str = ""
    grammar: str | None = None


def build(model: Model, ask: Ask, *, context: int) -> Built:
    """The Request for `ask` on `model` in a context of `context` tokens (module docstring)."""
    stops = model.stop_ids() if ask.stop_ids is None else ask.stop_ids
    variables = {**(model.thinking_vars(ask.thinking) if ask.thinking is not None else {})}
    variables.update(ask.template_vars)
    tools = _tools(model, ask, variables)
    messages = ask.messages
    parts = image_parts(messages)
    if len(parts) > MAX_IMAGES:
        where = parts[MAX_IMAGES]
        raise RequestError(f"{where}: at most {MAX_IMAGES} images a request", where)
    seeing = any(isinstance(m["content"], list) for m in messages)
    if seeing:  # each image opened, preprocessed and expanded into its placeholders, in
        # order, stopping at the one past the context
        encoded = model.encode_chat(
            messages, add_generation_prompt=True, max_image_tokens=context, **tools.variables
        )
        prompt, images, sources = encoded.text, encoded.images, encoded.sources
        messages = with_prepared(messages, encoded)  # what turn_start renders: not again
    else:
        prompt = model.render_chat(messages, add_generation_prompt=True, **tools.variables)
        images, sources = (), ()
    if seeing and not tools.forced:
        ids = encoded.ids  # encode_chat tokenized this very text
    else:
        try:
            ids = model.tokenizer.encode(prompt + tools.forced, special=True)
        except MlxlisError as e:
            text = f"the prompt could not be tokenized: {e}"
            raise RequestError(text, "messages", None) from None
    try:
        spans = model.image_spans(ids, images)
    except MlxlisError as e:
        raise RequestError(f"messages: {e.message}", "messages") from None
    if over := [k for k, s in enumerate(spans) if s.end >= context]:
        k = over[0]
        part = sources[k]  # the message part it comes from (pan and scan: a crop of one)
        where = image_parts(messages)[part]
        raise RequestError(
            f"{where}: image {part + 1} reaches token {spans[k].end}, past the context "
            f"({context} tokens): send fewer images or a shorter conversation",
            where,
            "context_length_exceeded",
        )
    explicit = ask.explicit and ask.strict
    fitted = fit_context(
        len(ids),
        ask.params,
        context,
        explicit=explicit,
        field=ask.context_field,
        hint=ask.context_hint,
    )
    cut = ask.explicit and fitted.max_tokens < ask.params.max_tokens
    request = Request(
        ids,
        fitted,
        stop_ids=frozenset() if ask.ignore_eos else frozenset(stops),
        stop_strings=ask.stop_strings,
        top_logprobs=ask.top_logprobs,
        processors=masks(model, ask, stops, prompt + tools.forced, tools.grammar),
        snapshot_at=turn_start(model, messages, ids, **tools.variables),
        speculation=ask.speculation,
        kv_format=ask.kv_format,
        images=spans,
        adapter=ask.adapter,
        adapter_scale=ask.adapter_scale,
    )
    asked = ask.params.max_tokens if cut else None
    return Built(request, prompt, tools.schemas, tools.fmt, tools.forced, asked, messages)


def _tools(model: Model, ask: Ask, variables: dict[str, Any]) -> _Tools:
    """The tools the template is given, their schemas, the format calls are written in and,
    for a call that must come (tool_choice, strict tools), its grammar or (where no grammar
    can hold the format) the call opened in the prompt."""
    if not ask.tools or ask.tool_choice == "none":
        if ask.tool_choice not in (None, "auto", "none"):
            raise RequestError("tool_choice: needs tools", "tool_choice")
        return _Tools(variables)
    offered, name = tool_choice(ask.tools, ask.tool_choice)
    if model.template is not None and "tools" not in model.template_variables:
        raise RequestError(
            "tools: the model's chat template does not take tools (it would leave "
            "them out of the prompt)",
            "tools",
        )
    out = _Tools({**variables, "tools": offered}, tool_schemas(offered))
    out.fmt = template_format(model.template) if model.template is not None else for_template("")
    required = ask.tool_choice not in (None, "auto")  # "required" or a named function
    strict = any((t.get("function") or {}).get("strict") is True for t in offered)
    if required or strict:
        try:  # the call's syntax and arguments enforced token by token (all the tools:
            # `name` picks the one named, its place in them names its parameters)
            parallel = ask.parallel_tool_calls
            out.grammar = tool_grammar(
                out.fmt, ask.tools, model.tokenizer, name, required, parallel
            )
        except ConstraintError as e:
            if strict or isinstance(e, ParametersError):  # refused, never ignored
                raise RequestError(str(e), e.field or "tools") from None
            out.forced = out.fmt.forced(name)  # a call started in the prompt (Gemma 4's)
    return out


def masks(
    model: Model,
    ask: Ask,
    stops: frozenset[int] | set[int],
    prompt: str | None = None,
    call_grammar: str | None = None,
) -> tuple:
    """The grammar mask the ask's response_format (or its enforced tool calls,
    `call_grammar`) asks for ({"type": "text"}: none), after the reasoning when `prompt` is a
    reasoning model's; a constraint that cannot be enforced is refused naming the part."""
    fmt = ask.response_format
    special: tuple[int, ...] = ()
    if call_grammar is not None:
        if fmt and fmt.get("type") != "text":
            raise RequestError(
                "response_format: not with enforced tool calls (tool_choice "
                '"required", a named function or strict tools)',
                "response_format",
            )
        fmt = {"type": "grammar", "grammar": call_grammar}
        special = tag_ids(model.tokenizer)
    if not fmt or fmt.get("type") == "text":
        return ()
    if ask.ignore_eos:
        raise RequestError(
            "response_format: a constrained reply ends on the end-of-sequence token, "
            "which ignore_eos removes",
            "ignore_eos",
        )
    try:
        vocab = model.config.vocab_size
        mask = constraint(
            fmt, model.tokenizer, vocab, sorted(stops), prompt=prompt, special=special
        )
        return (mask,)
    except ConstraintError as e:
        if call_grammar is not None:  # the calls' grammar, built from `tools`
            raise RequestError(f"tools: {e.message}", "tools") from None
        raise RequestError(str(e), e.field or "response_format") from None


def tool_choice(
    tools: list[dict[str, Any]], choice: Any
) -> tuple[list[dict[str, Any]], str | None]:
    """(the tools the template is given, the function a call must name): "auto" / "required"
    offer all; {"type": "function", "function": {"name": N}} offers N alone and forces it."""
    for i, t in enumerate(tools):  # each dialect's tools arrive in Chat's shape
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(
                f'tools[{i}]: only {{"type": "function", "function": {{…}}}} tools run here',
                f"tools[{i}]",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RequestError(
                f"tools[{i}].function.name: a function needs a name", f"tools[{i}].function.name"
            )
    if choice in (None, "auto"):
        return tools, None
    if choice == "required":  # with one tool offered, it is that tool's call that is required
        names = tool_names(tools)
        return tools, next(iter(names)) if len(names) == 1 else None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type") != "function"):
        raise RequestError(
            'tool_choice: "none", "auto", "required" or {"type": "function", '
            '"function": {"name": …}}',
            "tool_choice",
        )
    named = [t for t in tools if tool_names([t]) == {name}]
    if not named:
        raise RequestError(
            f"tool_choice.function.name: {name!r} is not among the tools",
            "tool_choice.function.name",
        )
    return named, name


def turn_start(
    model: Model, messages: list[dict], ids: list[int], **variables: Any
) -> tuple[int, ...]:
    """The snapshot position for a chat prompt `ids` (`messages` rendered with the generation
    prompt): where it parts from the same messages rendered without it, the end of the
    conversation before the reply's turn, which a later turn's prompt shares. () when there is
    none inside the prompt (the template refuses that render, or nothing precedes the
    generation prompt): the caches then snapshot the prompt's end."""
    try:  # images expanded as in the prompt, so the two part after the conversation
        head = model.encode_chat(messages, add_generation_prompt=False, **variables).ids
    except MlxlisError:
        return ()
    n = common_prefix(head, ids)
    return (n,) if 0 < n < len(ids) else ()


AUDIO_PARTS = ("audio", "input_audio")


def with_prepared(messages: list[dict[str, Any]], encoded: Any) -> list[dict[str, Any]]:
    """`messages` with each image or audio part holding its prepared image or clip (so that
    rendering them again, as turn_start does, decodes nothing twice)."""
    prepared = iter(encoded.images[encoded.sources.index(k)] for k in sorted(set(encoded.sources)))
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            content = [
                {**p, "image": next(prepared)}
                if p.get("type") == "image"
                else {"type": "audio", "audio": next(prepared), "name": p.get("name", "")}
                if p.get("type") in AUDIO_PARTS
                else p
                for p in m["content"]
            ]
            m = {**m, "content": content}
        out.append(m)
    return out


def image_parts(messages: list[dict[str, Any]]) -> list[str]:
    """Where each image or audio part is (messages[i].content[j]), in the prompt's order."""
    return [
        f"messages[{i}].content[{j}]"
        for i, m in enumerate(messages)
        if isinstance(m["content"], list)
        for j, p in enumerate(m["content"])
        if p.get("type") in ("image", *AUDIO_PARTS)
    ]
