"""Slash commands typed in the input: parsing and validation (no UI here).

`parse_command` splits "/name args"; sampling parameters ("/params top_p=0.9") are parsed and
checked by mlxlis.generation.sampling.SamplingParams, the one definition the CLI and library
use too.
"""

from __future__ import annotations

from mlxlis.generation.sampling import SamplingParams

COMMANDS = (
    "system",
    "clear",
    "temp",
    "params",
    "think",
    "save",
    "help",
    "preview",
    "history",
    "open",
)

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
| `/think on` · `off` · `default` | reasoning models: the template's thinking switch \
(`enable_thinking`) for the next messages; `/think` shows it |
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
        raise CommandError(
            f"unknown command /{head} — /help lists them "
            "(start with // to send text beginning with /)"
        )
    return name, rest.strip()


def format_params(params: SamplingParams) -> str:
    return " · ".join(f"{k}={v}" for k, v in params.as_dict().items())


THINKING_WORDS = {"on": True, "off": False, "default": None}


def parse_thinking(arg: str) -> bool | None:
    """/think's argument: on -> True, off -> False, default -> None (the template decides)."""
    word = arg.strip().lower()
    if word not in THINKING_WORDS:
        raise CommandError(f"/think takes on, off or default, not {arg.strip()!r}")
    return THINKING_WORDS[word]
