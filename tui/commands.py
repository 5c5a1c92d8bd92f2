"""Slash commands typed in the input: parsing and validation (no UI here).

`parse_command` splits "/name args"; `parse_params` turns "top_p=0.9 max_tokens=200" into a
validated dict of sampling parameters (the names mlxlis.generate and ChatSession take).
"""

from __future__ import annotations

from collections.abc import Callable

COMMANDS = ("system", "clear", "temp", "params", "save", "help", "preview", "history", "open")

# name -> (parser, check, description); the names are mlxlis.generate's keyword arguments
PARAMS: dict[str, tuple[Callable[[str], object], Callable[[object], bool], str]] = {
    "max_tokens": (int, lambda v: v > 0, "an integer > 0"),
    "temperature": (float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (int, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "min_p": (float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (float, lambda v: v > 0, "a number > 0 (1 = off)"),
    "seed": (lambda s: None if s.lower() in ("none", "random", "") else int(s),
             lambda v: v is None or v >= 0, "an integer >= 0, or none"),
}
ALIASES = {"temp": "temperature", "max": "max_tokens", "maxtokens": "max_tokens",
           "rep": "repetition_penalty", "repeat_penalty": "repetition_penalty"}

HELP = """\
**Keys** — Enter send · Shift+Enter or Ctrl+J new line (Ctrl+J where the terminal sends a \
plain Enter for Shift+Enter) · Esc or Ctrl+C stop the reply · F1 help · F2 prompt preview · \
Ctrl+Q quit

| command | what it does |
|---|---|
| `/system TEXT` | set the system prompt (`/system` alone shows it, `/system -` clears it) |
| `/clear` | start a new conversation (the system prompt stays) |
| `/temp X` | set the sampling temperature (0 = greedy) |
| `/params [k=v ...]` | show/set max_tokens, temp, top_p, top_k, min_p, repetition_penalty, seed |
| `/save [PATH]` | write the conversation as Markdown |
| `/preview` | the exact prompt the model receives next, special tokens included |
| `/history` | list saved conversations |
| `/open N` | reopen conversation N from `/history` |
| `/help` | this help |

Start a message with `//` to send text that begins with `/`.
"""


class CommandError(ValueError):
    """A command the user typed is unknown or malformed (shown as a notification)."""


def parse_command(text: str) -> tuple[str, str] | None:
    """("name", "args") for "/name args"; None for a plain message (incl. "//escaped")."""
    if not text.startswith("/") or text.startswith("//"):
        return None
    head, _, rest = text[1:].strip().partition(" ")
    name = head.lower()
    if name not in COMMANDS:
        raise CommandError(f"unknown command /{head} — /help lists them "
                           "(start with // to send text beginning with /)")
    return name, rest.strip()


def param_value(name: str, raw: str) -> object:
    """Parse and check one parameter value; raises CommandError naming the parameter."""
    name = ALIASES.get(name.lower().replace("-", "_"), name.lower().replace("-", "_"))
    if name not in PARAMS:
        raise CommandError(f"unknown parameter {name!r} (known: {', '.join(PARAMS)})")
    parse, check, what = PARAMS[name]
    try:
        value = parse(raw)
    except ValueError:
        raise CommandError(f"{name} must be {what}, not {raw!r}") from None
    if not check(value):
        raise CommandError(f"{name} must be {what}, not {raw!r}")
    return value


def parse_params(args: str) -> dict:
    """"top_p=0.9 max_tokens=200" -> {"top_p": 0.9, "max_tokens": 200}; all or nothing."""
    out: dict = {}
    for item in args.split():
        key, eq, raw = item.partition("=")
        if not eq:
            raise CommandError(f"expected name=value, got {item!r} (e.g. /params top_p=0.9)")
        name = ALIASES.get(key.lower().replace("-", "_"), key.lower().replace("-", "_"))
        out[name] = param_value(name, raw)
    return out


def format_params(params: dict) -> str:
    return " · ".join(f"{k}={params.get(k)}" for k in PARAMS)
