"""An API request -> the generation core's Request: the API's own fields checked in its terms
(sampling values, logprobs, stop strings, KV format), then a chat request through the one
request builder (generation/request.py), a completion's raw prompt tokenized here; the
context bounded. Every refusal is an APIError naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from mlxlis.cache.store import BITS, KVChoice, KVFormat
from mlxlis.errors import ContextLimitError, MlxlisError, NoChatTemplateError, TemplateError
from mlxlis.generation.context import ContextOverflow, fit_context
from mlxlis.generation.core import Request
from mlxlis.generation.processors import check_vocabulary
from mlxlis.generation.request import Ask, RequestError, build, masks
from mlxlis.generation.sampling import SamplingError, SamplingParams, draws_of_its_own
from mlxlis.generation.speculative import Speculation
from mlxlis.prompt.tool_formats import ToolFormat
from mlxlis.serve.chat_messages import message_dict
from mlxlis.serve.openai_format import MAX_TOP_LOGPROBS, APIError, bad
from mlxlis.serve.schemas import ChatCompletionRequest, CompletionRequest, _Sampling

MAX_STOP_STRINGS = 16
# reasoning_effort -> the template's thinking switch (where it has one)
EFFORT_THINKS = {
    "none": False,
    "minimal": False,
    "low": False,
    "medium": True,
    "high": True,
    "xhigh": True,
}
# template variables a request may not set through chat_template_kwargs (render_chat's own)
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class Target:
    """What requests are prepared for: the model, the server's sampling defaults, the context
    bound (--max-context) and the model's stop ids."""

    model: Any
    defaults: SamplingParams
    max_context: int
    stop_ids: frozenset[int]
    speculation: Speculation | None = None  # --speculative / --draft-model: every request
    # --strict-context: prompt + an explicit max_tokens over the context is a 400 (OpenAI's
    # rule); by default max_tokens is a ceiling, cut to what the context leaves (llama.cpp's
    # and Ollama's: agents ask for 32 000 as a matter of course)
    strict_context: bool = False
    adapter: str | None = None  # the LoRA adapter its requests run under (a BASE:NAME model)
    adapters: tuple[str, ...] = ()  # the model's adapters by id (`lora`; GET /lora-adapters)


@dataclass
class Prepared:
    gen: Request
    prompt: str | None  # the rendered chat prompt (where a reply's reasoning starts), or None
    # the offered tools' parameters by name: tool calls are parsed (their arguments by these
    # schemas, where a format writes them as text); None: no tools
    tools: dict[str, Any] | None
    tool_format: ToolFormat | None = None  # how the template has the model write calls
    forced: str = ""  # text the prompt ends with that opens a call (tool_choice), for the parser
    asked: int | None = None  # the max_tokens asked for, when the context cut it (logged)


# the body's sampling fields -> SamplingParams' (llama-server's names included)
SAME_NAMES = """
temperature top_p top_k min_p repetition_penalty presence_penalty
frequency_penalty logit_bias typical_p top_n_sigma dry_multiplier dry_base
dry_allowed_length dry_penalty_last_n dry_sequence_breakers xtc_probability xtc_threshold mirostat
mirostat_tau mirostat_eta seed
"""
SAMPLING_FIELDS = {
    **{name: name for name in SAME_NAMES.split()},
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repetition_context",
}


def sampling(
    req: _Sampling,
    defaults: SamplingParams,
    max_field: str,
    max_tokens: int | None,
    vocab: int | None = None,
) -> SamplingParams:
    """The request's sampling values over the server's defaults (max_tokens set later);
    logit_bias's ids checked against a vocabulary of `vocab` tokens."""
    changes: dict[str, Any] = {}
    named: dict[str, str] = {}  # our field -> the body's name for it (what a refusal names)
    for theirs, ours in SAMPLING_FIELDS.items():
        value = getattr(req, theirs)
        if value is not None:
            changes[ours], named[ours] = value, theirs
    if changes.get("top_k") == -1:  # vLLM's and llama.cpp's "off"
        changes["top_k"] = 0
    if changes.get("top_n_sigma") == -1:  # llama.cpp's "off"
        changes["top_n_sigma"] = 0.0
    if changes.get("repetition_context") == 0:  # llama.cpp's repeat_last_n 0: no penalty
        changes["repetition_context"], changes["repetition_penalty"] = 1, 1.0
    elif changes.get("repetition_context") == -1:  # llama.cpp's "the whole context"
        changes["repetition_context"] = 2**31 - 1
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    try:
        params = defaults.replace(**changes)
        if vocab is not None:
            check_vocabulary(params, vocab)
        return params
    except SamplingError as e:
        param = max_field if e.field == "max_tokens" else named.get(e.field or "", e.field)
        raise bad(f"{param}: {str(e).split(': ', 1)[-1]}", param) from None


def kv_choice(t: Target, req: _Sampling) -> KVChoice:
    """The request's KV format (extension fields kv_bits: 4, 8, or 16 for full precision;
    kv_group_size, by default the server's or 64), or "model": the server's --kv-bits."""
    bits, group, own = req.kv_bits, req.kv_group_size, t.model.kv_format
    if bits is None and group is None:
        return "model"
    if bits is not None and bits not in (*BITS, 16):
        raise bad(f"kv_bits: must be 4, 8 or 16 (full precision), not {bits}", "kv_bits")
    if bits == 16 and group is not None:
        raise bad("kv_group_size: only with kv_bits 4 or 8", "kv_group_size")
    if bits is None and own is None:
        raise bad("kv_group_size: needs kv_bits (the server's KV cache is dense)", "kv_group_size")
    kv: KVFormat | None = None
    try:
        if bits != 16:
            fallback = own.group_size if own else 64  # 0 is a value (refused), not unset
            kv = KVFormat(bits or own.bits, fallback if group is None else group)
        if kv != own and t.model.part is not None:
            raise MlxlisError("a pipelined model's caches keep its --kv-bits", field="kv_bits")
        t.model.check_kv(kv)
    except MlxlisError as e:
        why = str(e).split(f"{e.field}: ", 1)[-1]
        raise bad(f"{e.field}: {why}", e.field) from None
    return "model" if kv == own else kv


def adapter_choice(t: Target, req: _Sampling) -> tuple[str | None, float]:
    """The adapter a request runs under and its scale: llama.cpp's `lora` list (one adapter
    by id with a scale above 0; [] or every scale 0: the base) over the one its model name
    chose."""
    if req.lora is None:
        return t.adapter, 1.0
    names = t.adapters
    chosen = []
    for i, entry in enumerate(req.lora):
        if not 0 <= entry.id < len(names):
            have = f"ids 0 to {len(names) - 1}" if names else "none"
            raise bad(f"lora[{i}].id: no adapter {entry.id} (this model has {have})", "lora")
        if not (math.isfinite(entry.scale) and entry.scale >= 0):
            raise bad(f"lora[{i}].scale: must be 0 or above, not {entry.scale}", "lora")
        if entry.scale > 0:
            chosen.append((names[entry.id], entry.scale))
    if len(chosen) > 1:
        raise bad("lora: one adapter per request (every other one's scale 0)", "lora")
    return chosen[0] if chosen else (None, 1.0)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"stop: at most {MAX_STOP_STRINGS} stop strings, not {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def bound_context(
    ids: list[int],
    params: SamplingParams,
    explicit: bool,
    max_context: int,
    param: str,
    max_field: str = "max_tokens",
) -> SamplingParams:
    """The one context check (generation.context), its refusal worded as OpenAI words it;
    `explicit`: an explicit max_tokens (`max_field`) over what the context leaves is refused
    (else it is cut)."""
    try:
        return fit_context(len(ids), params, max_context, explicit=explicit, field=param)
    except ContextOverflow as e:
        raise overflow(e, max_field) from None


def overflow(e: ContextOverflow, max_field: str = "max_tokens") -> APIError:
    """A context refusal as OpenAI words it, naming the prompt's field, or `max_field` when
    the prompt alone fits."""
    param = e.field or "messages"
    if e.completion:
        if e.prompt < e.limit:  # the field the client set is what cannot be honoured
            param = max_field
        message = (
            f"However, you requested {e.prompt + e.completion} tokens ({e.prompt} "
            f"in the prompt, {e.completion} in the completion). Reduce the prompt "
            f"or {max_field}."
        )
    else:
        message = (
            f"However, your prompt has {e.prompt} tokens, which leaves no room for a completion."
        )
    return bad(
        f"This model's maximum context length is {e.limit} tokens. {message}",
        param,
        "context_length_exceeded",
    )


def fit(
    t: Target,
    ids: list[int],
    params: SamplingParams,
    explicit: bool,
    param: str,
    max_field: str = "max_tokens",
) -> tuple[SamplingParams, int | None]:
    """`params` bounded by the context (an explicit max_tokens refused past it only under
    --strict-context), and the max_tokens asked for when an explicit one was cut (logged)."""
    fitted = bound_context(
        ids, params, explicit and t.strict_context, t.max_context, param, max_field
    )
    cut = explicit and fitted.max_tokens < params.max_tokens
    return fitted, params.max_tokens if cut else None


def speculable(t: Target, params: SamplingParams) -> SamplingParams:
    """`params`, or a 400 naming the sampler a speculating server cannot run (XTC's coin and
    mirostat's state are no fixed distribution for the ratio test)."""
    if t.speculation is not None and (name := draws_of_its_own(params)) is not None:
        raise bad(f"{name}: not with this server's speculative decoding", name)
    return params


def within(t: Target, req: _Sampling) -> Target:
    """`t` with the request's own context (num_ctx, Ollama's) when it is smaller than the
    server's: the prompt and max_tokens bounded by it as by --max-context."""
    n = req.num_ctx
    if n is None:
        return t
    if n < 1:
        raise bad(f"num_ctx: must be an integer > 0, not {n}", "num_ctx")
    return replace(t, max_context=min(n, t.max_context))


def prepare_chat(t: Target, req: ChatCompletionRequest) -> Prepared:
    """A chat request's checks in OpenAI's terms, then the one request builder
    (generation/request.py), its refusals worded as OpenAI words them."""
    t = within(t, req)
    model = t.model
    if not req.messages:
        raise bad("messages: at least one message is required", "messages")
    top: int | None = None
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(
                f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], not {req.top_logprobs}",
                "top_logprobs",
            )
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs: needs logprobs=true", "top_logprobs")
    if req.logprobs:
        top = req.top_logprobs or 0
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    explicit = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    vocab = model.tokenizer.vocab_size
    params = speculable(t, sampling(req, t.defaults, max_field, explicit, vocab))
    variables = dict(req.chat_template_kwargs or {})
    if (effort := req.reasoning_effort) is not None:
        if effort not in EFFORT_THINKS:
            raise bad(f"reasoning_effort: one of {', '.join(EFFORT_THINKS)}", "reasoning_effort")
        variables = {**model.thinking_vars(EFFORT_THINKS[effort]), **variables}
    if clash := sorted(RESERVED_TEMPLATE_VARS & variables.keys()):
        raise bad(f"chat_template_kwargs: {', '.join(clash)} cannot be set", "chat_template_kwargs")
    adapter, scale = adapter_choice(t, req)
    ask = Ask(
        [message_dict(m, i, model) for i, m in enumerate(req.messages)],
        params,
        template_vars=variables,
        tools=req.tools,
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls is True,
        response_format=req.response_format,
        stop_strings=stop_strings(req.stop),
        stop_ids=t.stop_ids,
        ignore_eos=bool(req.ignore_eos),
        top_logprobs=top,
        speculation=t.speculation,
        kv_format=kv_choice(t, req),
        explicit=explicit is not None,
        strict=t.strict_context,
        adapter=adapter,
        adapter_scale=scale,
    )
    try:
        built = build(model, ask, context=t.max_context)
    except RequestError as e:
        raise bad(str(e), e.field, e.code) from None
    except NoChatTemplateError:
        raise bad(model.missing_template_diagnosis(), "messages", "no_chat_template") from None
    except TemplateError as e:
        raise bad(f"the chat template refused the messages: {e}", "messages") from None
    except ContextOverflow as e:
        raise overflow(e, max_field) from None
    except ContextLimitError as e:  # images past the context, named by the first one over
        raise bad(
            f"{e.field}: {e.message}", e.field or "messages", "context_length_exceeded"
        ) from None
    except MlxlisError as e:  # a bad image, a text-only model: named by its part
        raise bad(f"{e.field or 'messages'}: {e.message}", e.field or "messages") from None
    return Prepared(
        built.request, built.prompt, built.tools, built.tool_format, built.forced, built.asked
    )


def prepare_completion(t: Target, req: CompletionRequest) -> Prepared:
    t = within(t, req)
    model = t.model
    if req.echo:
        raise bad("echo: not supported", "echo")
    if req.suffix:
        raise bad("suffix: not supported", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}], not {req.logprobs}", "logprobs")
    params = speculable(
        t, sampling(req, t.defaults, "max_tokens", req.max_tokens, model.tokenizer.vocab_size)
    )
    stops = stop_strings(req.stop)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad(f"prompt: one prompt per request, not {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = encode(model, prompt, special=False)
    else:
        vocab = model.tokenizer.vocab_size
        if bad_ids := [t for t in prompt if not 0 <= t < vocab]:
            raise bad(
                f"prompt: token id {bad_ids[0]} is outside the vocabulary ({vocab})", "prompt"
            )
        ids = list(prompt)
    if not ids:
        raise bad("prompt: empty", "prompt")
    params, asked = fit(t, ids, params, req.max_tokens is not None, "prompt")
    adapter, scale = adapter_choice(t, req)
    gen = Request(
        ids,
        params,
        stop_ids=frozenset() if req.ignore_eos else t.stop_ids,
        stop_strings=stops,
        top_logprobs=req.logprobs,
        processors=completion_masks(t, req),
        speculation=t.speculation,
        kv_format=kv_choice(t, req),
        adapter=adapter,
        adapter_scale=scale,
    )
    return Prepared(gen, None, None, asked=asked)


def encode(model: Any, text: str, *, special: bool) -> list[int]:
    try:
        return model.tokenizer.encode(text, special=special)
    except MlxlisError as e:
        raise bad(
            f"the prompt could not be tokenized: {e}", "messages" if special else "prompt", None
        ) from None


def completion_masks(t: Target, req: CompletionRequest) -> tuple:
    """The grammar mask a completion's response_format asks for (the request builder's)."""
    ask = Ask([], SamplingParams(), response_format=req.response_format)
    ask = replace(ask, ignore_eos=bool(req.ignore_eos))
    try:
        return masks(t.model, ask, t.stop_ids)
    except RequestError as e:
        raise bad(str(e), e.field, e.code) from None
