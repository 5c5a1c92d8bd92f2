"""Chat templates: find one (never guess), render it safely, and explain when there is none.

Sources, first found wins: `--chat-template FILE|NAME` ›
`chat_template.jinja` › `tokenizer_config.json` "chat_template" › GGUF `tokenizer.chat_template`.
Rendering matches transformers' `apply_chat_template(..., tokenize=False)` output, inside the
sandbox of `chat_sandbox`. With no template, `diagnose_missing_template` names the likely cause
among the four possible causes and the explicit ways out.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from mlxlis.errors import TemplateError
from mlxlis.prompt import sandbox as chat_sandbox
from mlxlis.prompt.diagnosis import diagnose_missing_template

import jinja2

BUILTIN_TEMPLATES: tuple[str, ...] = ("chatml", "gemma", "llama2", "llama3")
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Markers that close a turn, in the order they are reported.
END_OF_TURN_MARKERS: tuple[str, ...] = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|eot|>",
    "<|end|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and where it came from. Compiled (once per text) on construction."""

    source: str  # shown to the user: "gguf:tokenizer.chat_template", "builtin:chatml", a path...
    text: str
    file: str | None = field(default=None, compare=False)  # the file errors name
    key: str | None = field(default=None, compare=False)  # the field inside that file

    def __post_init__(self) -> None:
        from mlxlis import limits

        if len(self.text) > limits.CHAT_TEMPLATE_MAX_CHARS:
            raise self._error(
                f"template of {len(self.text)} characters is over the limit of "
                f"{limits.CHAT_TEMPLATE_MAX_CHARS}"
            )
        self._compiled()

    def _error(self, message: str) -> TemplateError:
        return TemplateError(message, path=self.file or self.source, field=self.key)

    def _compiled(self) -> jinja2.Template:
        try:
            return chat_sandbox.compile_template(self.text)
        except jinja2.TemplateSyntaxError as e:
            raise self._error(f"template syntax error on line {e.lineno}: {e.message}") from None
        except jinja2.TemplateError as e:  # e.g. SecurityError from the compile-time checks
            raise self._error(f"template refused: {e}") from None
        except (RecursionError, SyntaxError, MemoryError, ValueError, OverflowError) as e:
            # untrusted text: nesting past the parser's recursion or Python's block/indent
            # limits (`{% for %}` 21 deep), or a literal Python cannot compile
            raise self._error(
                f"template cannot be compiled ({type(e).__name__}: {e}); "
                "it is nested too deeply or too large"
            ) from None

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its context (e.g. "enable_thinking"), as jinja2's
        parser finds them: variables the template uses without setting them itself."""
        from jinja2 import meta

        tree = chat_sandbox.ChatSandbox().parse(self.text)
        return frozenset(meta.find_undeclared_variables(tree))

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template renders it.

        `extra` reaches the template as variables (tools, documents, enable_thinking, ...).
        """
        template = self._compiled()
        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update({k: _plain(v) for k, v in extra.items()})
        for name, value in (("bos_token", bos_token), ("eos_token", eos_token)):
            if value is not None:
                context.setdefault(name, value)
        context["messages"] = _plain_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return chat_sandbox.render(template, context)
        except Exception as e:  # untrusted code: every failure becomes a TemplateError
            line = chat_sandbox.error_line(e)
            where = f" (line {line})" if line else ""
            if isinstance(e, chat_sandbox.TemplateRaised):
                msg = f"the template refused the conversation{where}: {e}"
            elif isinstance(e, jinja2.exceptions.SecurityError):
                msg = f"sandbox stopped the template{where}: {e}"
            else:
                msg = f"template failed to render{where}: {type(e).__name__}: {e}"
            raise self._error(msg) from None


def _plain(value: Any) -> Any:
    """A copy made of plain JSON-like types only (objects with methods never reach a template)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, numpy scalars...) lose their methods
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _plain_messages(messages: list[dict]) -> list[dict]:
    """As transformers prepares them: None-valued keys dropped, reasoning under all its names."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be dicts, got {type(message).__name__}")
        msg = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# ---------------------------------------------------------------- discovery


def builtin_template(name: str) -> ChatTemplate:
    """One of BUILTIN_TEMPLATES, shipped as mlxlis/prompt/templates/NAME.jinja."""
    if name not in BUILTIN_TEMPLATES:
        raise TemplateError(f"no built-in chat template {name!r}; built-ins: {_builtins()}")
    text = (
        resources.files("mlxlis.prompt").joinpath("templates", f"{name}.jinja").read_text("utf-8")
    )
    return ChatTemplate(source=f"builtin:{name}", text=text)


def _builtins() -> str:
    return ", ".join(BUILTIN_TEMPLATES)


def _as_text(value: Any) -> str | None:
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    return value if isinstance(value, str) and value.strip() else None


def _read_text(path: Path) -> str:
    from mlxlis import limits
    from mlxlis.bounded import read_bytes

    raw = read_bytes(path, limits.CHAT_TEMPLATE_MAX_CHARS * 4, TemplateError, "chat template")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TemplateError(f"cannot read chat template: {e}", path=path) from None


def _template_from_config(path: Path, source: str) -> ChatTemplate | None:
    """The "chat_template" of a JSON config: a string, or a list of {"name", "template"}."""
    from mlxlis import limits
    from mlxlis.bounded import read_json_file

    # bounded like every JSON mlxlis parses: size before parsing, nesting after
    config = read_json_file(path, limits.TOKENIZER_CONFIG_MAX_BYTES, TemplateError, what=path.name)
    value = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template") for t in value if isinstance(t, dict) and "name" in t
        }
        if "default" not in named:
            names = ", ".join(map(str, named)) or "none"
            raise TemplateError(
                f"named chat templates ({names}) but none called 'default'; pick one with "
                "--chat-template FILE",
                path=path,
                field="chat_template",
            )
        value = named["default"]
    text = _as_text(value)
    if text is None:
        return None
    return ChatTemplate(source=source, text=text, file=str(path), key="chat_template")


def _explicit_template(explicit: str) -> ChatTemplate:
    path = Path(explicit).expanduser()
    if path.is_file():
        source = f"{path} (--chat-template)"
        if path.suffix == ".json":
            found = _template_from_config(path, source)
            if found is None:
                raise TemplateError("has no chat_template", path=path, field="chat_template")
            return found
        text = _read_text(path)
        if not text.strip():
            raise TemplateError("chat template file is empty", path=path)
        return ChatTemplate(source=source, text=text, file=str(path))
    if explicit in BUILTIN_TEMPLATES:
        return builtin_template(explicit)
    raise TemplateError(
        f"--chat-template {explicit!r} is neither an existing file nor a built-in template "
        f"(built-ins: {_builtins()})"
    )


def discover_template(
    *,
    explicit: str | None,
    folder: Path | None = None,
    gguf_metadata: dict | None = None,
    gguf_path: Path | None = None,
) -> ChatTemplate | None:
    """The model's chat template, or None. First found wins:
    explicit (--chat-template FILE or built-in NAME) › folder/chat_template.jinja ›
    folder/tokenizer_config.json "chat_template" › GGUF tokenizer.chat_template.
    """
    if explicit:
        return _explicit_template(explicit)
    if folder is not None:
        jinja_path = Path(folder) / "chat_template.jinja"
        if jinja_path.is_file():
            text = _as_text(_read_text(jinja_path))
            if text is not None:
                return ChatTemplate(source=str(jinja_path), text=text, file=str(jinja_path))
        config_path = Path(folder) / "tokenizer_config.json"
        if config_path.is_file():
            found = _template_from_config(config_path, str(config_path))
            if found is not None:
                return found
    text = _as_text((gguf_metadata or {}).get(GGUF_TEMPLATE_KEY))
    if text is not None:
        file = str(gguf_path) if gguf_path is not None else None
        return ChatTemplate(
            source=f"gguf:{GGUF_TEMPLATE_KEY}", text=text, file=file, key=GGUF_TEMPLATE_KEY
        )
    return None


# ---------------------------------------------------------------- stop tokens


def end_of_turn_tokens(
    template_text: str, special_tokens: dict[str, int], *, eos_token: str | None = None
) -> list[int]:
    """Ids of the end-of-turn markers the template emits and the vocabulary defines.

    A marker counts when it appears literally in the template; `eos_token` (the tokenizer's EOS
    string) counts too when the template emits it through the `eos_token` variable (Llama 2).
    """
    emitted = [m for m in END_OF_TURN_MARKERS if m in template_text]
    if eos_token and re.search(r"\beos_token\b", template_text):
        emitted.append(eos_token)
    ids: list[int] = []
    for marker in emitted:
        token_id = special_tokens.get(marker)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatTemplate",
    "builtin_template",
    "diagnose_missing_template",
    "discover_template",
    "end_of_turn_tokens",
]
