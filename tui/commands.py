"""Slash commands typed in the input: parsing and validation (no UI here).

`parse_command` splits "/name args"; sampling parameters ("/params top_p=0.9") are parsed and
checked by mlxlis.sampling.SamplingParams, the one definition the CLI and library use too.
"""

from __future__ import annotations

from mlxlis.sampling import SamplingParams

COMMANDS = ("system", "clear", "temp", "params", "save", "help", "preview", "history", "open")

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


def format_params(params: SamplingParams) -> str:
    return " · ".join(f"{k}={v}" for k, v in params.as_dict().items())
