"""Slash commands typed in the input: parsing and validation (no UI here).

`parse_command` splits "/name args"; sampling parameters ("/params top_p=0.9") are parsed and
checked by mlxlis.generation.sampling.SamplingParams, the one definition the CLI and library
use too.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxlis.bounded import read_json_file
from mlxlis.errors import MlxlisError
from mlxlis.generation.constraints import grammar
from mlxlis.generation.sampling import SamplingParams

COMMANDS = (
    "system",
    "clear",
    "temp",
    "params",
    "think",
    "json",
    "save",
    "help",
    "preview",
    "history",
    "open",
    "image",
    "audio",
    "model",
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
| `/params [k=v ...]` | show/set max_tokens, temp, top_p, top_k, min_p, repetition_penalty, \
seed and every other sampler (presence_penalty, logit_bias=ID:BIAS,…, typical_p, top_n_sigma, \
dry_*, xtc_*, mirostat*) |
| `/think on` · `off` · `default` | reasoning models: the template's thinking switch \
(`enable_thinking`, `thinking_budget`, `reasoning_effort`, … as it spells it) for the next \
messages; `/think` shows it |
| `/json on` · `off` · `FILE` | the next replies as one JSON object (`on`), following the \
JSON schema in FILE, or free (`off`), enforced token by token; `/json` shows it |
| `/save [PATH]` | write the conversation as Markdown, and keep its cache for `/open` |
| `/preview` | the exact prompt the model receives next, special tokens included |
| `/history` | list saved conversations |
| `/open N` | reopen conversation N from `/history` |
| `/image PATH` | attach an image to your next message (a model that sees); `/image` lists \
the attached ones, `/image -` drops them |
| `/audio PATH` | attach an audio clip (WAV, FLAC, OGG, MP3) to your next message (a model \
that hears); a note says its duration; `/audio` lists the attachments, `/audio -` drops them |
| `/model [NAME]` | switch to another model (a new conversation; Tab completes the names \
of the models on the disk); `/model` lists them |
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


def complete(typed: str, names: list[str]) -> str | None:
    """Tab after "/model PREFIX": the longest text every name starting with PREFIX shares
    (the whole name when one matches); None when none does or nothing would be added."""
    head, sep, prefix = typed.partition(" ")
    if head.lower() != "/model" or not sep or "\n" in typed:
        return None
    matches = [n for n in names if n.startswith(prefix.lstrip())]
    if not matches:
        return None
    shared = os.path.commonprefix(matches)
    return f"/model {shared}" if len(shared) > len(prefix.lstrip()) else None


ALWAYS_SHOWN = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "seed",
)


def format_params(params: SamplingParams) -> str:
    """The common values, then the other samplers' where they differ from their default."""
    default = SamplingParams().as_dict()
    return " · ".join(
        f"{k}={v}" for k, v in params.as_dict().items() if k in ALWAYS_SHOWN or v != default[k]
    )


THINKING_WORDS = {"on": True, "off": False, "default": None}


def parse_thinking(arg: str) -> bool | None:
    """/think's argument: on -> True, off -> False, default -> None (the template decides)."""
    word = arg.strip().lower()
    if word not in THINKING_WORDS:
        raise CommandError(f"/think takes on, off or default, not {arg.strip()!r}")
    return THINKING_WORDS[word]


def parse_json_format(arg: str) -> dict | None:
    """/json's argument as a response_format: on -> any JSON object, off -> None, else the JSON
    schema in that file (read, parsed and compiled here: a bad one is refused where typed)."""
    word = arg.strip()
    if word.lower() == "off":
        return None
    if word.lower() == "on":
        return {"type": "json_object"}
    try:
        schema = read_json_file(Path(word).expanduser(), error=MlxlisError, what="/json schema")
        fmt = {"type": "json_schema", "json_schema": {"name": Path(word).stem, "schema": schema}}
        grammar(fmt)
    except MlxlisError as e:
        raise CommandError(f"/json: {e}") from None
    return fmt


def describe_json_format(fmt: dict | None) -> str:
    if fmt is None:
        return "off"
    if fmt["type"] == "json_object":
        return "any JSON object"
    return f"schema {fmt['json_schema']['name']}"
