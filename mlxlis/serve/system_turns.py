"""System turns after the first message, where the model's chat template takes them.

Anthropic's `messages` (role "system") and the Responses API's `input` (system and developer
items) may hold system turns anywhere in the conversation; chat templates differ on them. A
template that renders a system turn at any place (ChatML's, Llama 3's) gets each where it was
sent. One that takes a single, leading system turn (it raises on a later one, as Qwen3.5's and
Mistral's do, or leaves it out of the prompt) gets them all joined into that leading turn, in
their order, a blank line between: what the model was trained to read. Which kind a template
is, it says itself: a probe conversation, a user turn then a system turn, rendered once per
template, and the system turn's text must come out.
"""

from __future__ import annotations

import functools
from typing import Any

from mlxlis.errors import MlxlisError
from mlxlis.prompt.template import ChatTemplate

PROBE = "mlxlis probe: a system turn after the first message"


@functools.lru_cache(maxsize=16)
def _anywhere(template: ChatTemplate, bos: str | None, eos: str | None) -> bool:
    messages = [{"role": "user", "content": "Hello."}, {"role": "system", "content": PROBE}]
    try:
        text = template.render(messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except MlxlisError:  # raise_exception(...) or any other failure: a leading turn only
        return False
    return PROBE in text


def system_anywhere(model: Any) -> bool:
    """Whether `model`'s chat template renders a system turn after the first message."""
    if model is None or model.template is None:
        return True  # nothing to ask (no template: the prompt is refused with its diagnosis)
    tok = model.tokenizer
    return _anywhere(model.template, tok.bos_token, tok.eos_token)


def place_systems(messages: list[dict[str, Any]], model: Any) -> list[dict[str, Any]]:
    """`messages` (chat template messages) with their system turns where `model`'s template
    takes them: as they are, or joined into one leading system turn (made when the first
    message is not one). A system turn with images cannot be joined: then as they are, the
    template's to refuse."""
    systems = [m for m in messages if m["role"] == "system"]
    if not any(m["role"] == "system" for m in messages[1:]):
        return messages
    if any(not isinstance(m["content"], str) for m in systems) or system_anywhere(model):
        return messages
    joined = "\n\n".join(m["content"] for m in systems if m["content"])
    return [{"role": "system", "content": joined}, *(m for m in messages if m["role"] != "system")]
