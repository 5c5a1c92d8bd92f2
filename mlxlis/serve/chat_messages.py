"""A chat request's messages as chat templates take them (the request builder's first step,
serve/prepare.py): roles, content parts (images read and checked), tool calls and reasoning."""

from __future__ import annotations

import base64
import binascii
import json
from typing import TYPE_CHECKING, Any

from mlxlis.prompt.tool_formats import call_arguments
from mlxlis.serve.images import image_bytes
from mlxlis.serve.openai_format import bad
from mlxlis.serve.schemas import ChatMessage

if TYPE_CHECKING:
    from mlxlis.models.model import Model


MAX_AUDIO_BYTES = 64 << 20  # one clip's encoded bytes


def audio_bytes(data: str, field: str) -> bytes:
    """An input_audio part's base64 data as bytes; a 400 naming `field` where it is not
    base64 or past MAX_AUDIO_BYTES."""
    if len(data) > MAX_AUDIO_BYTES * 4 // 3 + 4:
        raise bad(f"{field}: more than {MAX_AUDIO_BYTES >> 20} MiB of audio", field)
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, binascii.Error):
        raise bad(f"{field}: not base64", field) from None


def message_dict(m: ChatMessage, i: int, model: Model | None = None) -> dict[str, Any]:
    """One message as chat templates expect it (tool-call arguments as objects, as in
    transformers' convention; "developer" is OpenAI's newer name for "system"). Content
    parts with an image stay parts (Model.encode_chat's), their images as bytes; text-only
    parts are joined; an image to a `model` that does not see is refused here."""
    if isinstance(m.content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text" and part.text is not None:
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image_url" and part.image_url is not None:
                if model is not None and model.vision is None:
                    raise bad(f"{where}: {model.text_only_reason()}", where)
                data = image_bytes(part.image_url.url, f"{where}.image_url.url")
                parts.append({"type": "image", "image": data, "name": f"image {j + 1}"})
            elif part.type == "input_audio" and part.input_audio is not None:
                if model is not None and model.hearing is None:
                    raise bad(f"{where}: {model.name} takes no audio", f"{where}.type")
                data = audio_bytes(part.input_audio.data, f"{where}.input_audio.data")
                parts.append({"type": "audio", "audio": data, "name": f"audio {j + 1}"})
            elif part.type in ("text", "image_url", "input_audio"):  # without the field it names
                raise bad(f"{where}: a {part.type} part needs {part.type}", f"{where}.{part.type}")
            else:
                raise bad(
                    f"{where}: only text, image_url and input_audio parts are supported, not "
                    f"{part.type!r}",
                    f"{where}.type",
                )
        seen = any(p["type"] in ("image", "audio") for p in parts)
        content: Any = parts if seen else "".join(p["text"] for p in parts)
    else:
        content = m.content or ""
    template = model.template if model is not None else None
    out: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": content,
    }
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
        if template is not None and "message.thinking" in template.text:
            out["thinking"] = m.reasoning_content  # gpt-oss's template reads this name
    if m.tool_calls:
        calls = []
        # a template that concatenates the arguments to its text (functionary v3.2) takes
        # them as the JSON text they came as
        as_text = template is not None and call_arguments(template) == "text"
        for c in m.tool_calls:
            args: Any = c.function.arguments
            if as_text and not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            elif isinstance(args, str) and not as_text:
                try:
                    args = json.loads(args)
                except (ValueError, RecursionError):  # nested past json's reach too
                    pass  # the template gets the text as it came
            calls.append(
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": args},
                }
            )
        out["tool_calls"] = calls
    return out
