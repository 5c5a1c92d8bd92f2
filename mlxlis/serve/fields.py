"""What the server does with each field of each API's request body, in one place: every
field is used (the request models in schemas.py, responses_schemas.py, anthropic.py and
ollama_requests.py hold it and its value shapes the reply), accepted as a no-op (listed here
with why it cannot change the answer; docs/api-fields.md lists the same), or refused with a
400 naming it when set (each request model's REFUSED). tests/test_api_fields.py reads the
official clients' request types and fails on any field in none of the three."""

from __future__ import annotations

_ABUSE = "an end-user id for the provider's abuse monitoring: nothing is monitored here"
_TIER = "the provider's processing tier: a local server has one"
_CACHE_KEY = (
    "a routing hint for the provider's prompt cache: the prefix cache here matches by content"
)
_CACHE_KEEP = (
    "how long the provider keeps a cached prefix: the prefix cache here keeps by its memory budget"
)
_METADATA = "tags for the provider's dashboard: none is kept here"

# API -> no-op field -> why it leaves the answer as it is
NO_OPS: dict[str, dict[str, str]] = {
    "chat": {
        "user": _ABUSE,
        "safety_identifier": _ABUSE,
        "metadata": _METADATA,
        "store": "stored completions for the provider's dashboard and evals: none are kept here",
        "service_tier": _TIER,
        "prompt_cache_key": _CACHE_KEY,
        "prompt_cache_retention": _CACHE_KEEP,
        "prompt_cache_options": _CACHE_KEEP,
        "prediction": "a predicted output only speeds the reply up; the reply is the same",
    },
    "completions": {"user": _ABUSE},
    "responses": {
        "user": _ABUSE,
        "safety_identifier": _ABUSE,
        "metadata": _METADATA,
        "service_tier": _TIER,
        "prompt_cache_key": _CACHE_KEY,
        "prompt_cache_retention": _CACHE_KEEP,
        "prompt_cache_options": _CACHE_KEEP,
        "background_options": "options of a background run, which is refused (background)",
        "stream_options": "include_obfuscation pads stream events against a network observer; "
        "the events' content is the same",
    },
    "anthropic": {
        "metadata": "metadata.user_id is for the provider's abuse monitoring",
        "service_tier": _TIER,
        "cache_control": "a prompt-cache marker: the prefix cache here needs none",
        "container": "a code-execution container for Anthropic's server tools, which are "
        "refused (tools)",
        "diagnostics": "asks why the provider's prompt cache missed: the reply is the same",
        "inference_geo": "where the provider runs inference: here, this machine",
        "speed": "the provider's fast mode: a local server has one speed",
        "user_profile_id": "attribution for the provider's billing",
        "workspace_id": "the provider's workspace: a local server has one",
    },
    "ollama": {
        "num_keep": "what a context shift keeps: there is none here (a request past the "
        "context is refused or its max_tokens cut)",
        **{
            name: "a hardware or loading switch of Ollama's runner"
            for name in (
                "numa",
                "num_batch",
                "num_gpu",
                "main_gpu",
                "low_vram",
                "f16_kv",
                "logits_all",
                "vocab_only",
                "use_mmap",
                "use_mlock",
                "embedding_only",
                "num_thread",
            )
        },
    },
}

# Responses' include values that name output this server never makes (its items come from
# tools that are refused, or encrypted reasoning: reasoning items carry their text)
INCLUDE_NO_OPS = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
INCLUDE_LOGPROBS = "message.output_text.logprobs"
