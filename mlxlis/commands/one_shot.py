"""`mlxlis [-m MODEL] [--no-chat] PROMPT`: one prompt, its reply streamed to stdout (the
reasoning to stderr), through the request builder (generation/request.py) for a chat turn and
`generate` for a raw completion."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from mlxlis.commands.args import (
    add_format_args,
    add_model_args,
    add_sampling_args,
    add_speculative_args,
    add_thinking_args,
    load_speculation,
    response_format,
)
from mlxlis.commands.common import SUBCOMMANDS, load_model, print_details, say
from mlxlis.distributed.leader import finish, follow, ranks_of
from mlxlis.errors import MlxlisError, PipelineError, UnsupportedError
from mlxlis.generation.events import Event
from mlxlis.generation.generate import generate, run_request
from mlxlis.generation.request import Ask, Built, build
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation, speculation_line
from mlxlis.models.model import Model
from mlxlis.prompt.reasoning import ANSWER, ReasoningSplitter


def one_shot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxlis",
        description="Run a GGUF or safetensors model on MLX. Subcommands: "
        + ", ".join(SUBCOMMANDS)
        + " (mlxlis SUBCOMMAND --help).",
    )
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="raw completion: the prompt is fed as is, no chat template",
    )
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image the prompt is about (repeatable; before the prompt's text, in order): "
        "a model that sees (Gemma 3 multimodal)",
    )
    p.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="FILE",
        help="an audio file the prompt is about (WAV, FLAC, OGG, MP3; repeatable; after the "
        "images): a model that hears (Gemma 3n)",
    )
    add_thinking_args(p)
    add_format_args(p)
    add_speculative_args(p)
    p.add_argument("prompt", help="the prompt ('-' reads stdin)")
    return p


def thinking_vars(model: Model, thinking: bool | None) -> dict[str, Any]:
    """The template's own thinking switch set to `thinking` (`enable_thinking`,
    `thinking_budget`, `reasoning_effort`, ...) when it is set and the template has one."""
    return model.thinking_vars(thinking) if thinking is not None else {}


def thinking_note(model: Model, thinking: bool | None) -> None:
    """Say so when --think / --no-think is set and the template has no switch to set."""
    if thinking is not None and not thinking_vars(model, thinking):
        flag = "--think" if thinking else "--no-think"
        say(
            f"mlxlis: note: {flag}: the chat template has no thinking switch; "
            "the prompt is the same without it"
        )


def chat_prompt(
    model: Model, user: str, system: str | None = None, thinking: bool | None = None
) -> str:
    """The one-shot prompt: `user` (after `system`) through the model's chat template, its
    thinking switch set to `thinking` when it is set and the template has one."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    prompt = model.render_chat(messages, **thinking_vars(model, thinking))  # no template: the
    thinking_note(model, thinking)  # one error line only
    return prompt


def one_shot_request(
    model: Model,
    a: argparse.Namespace,
    params: SamplingParams,
    prompt: str,
    fmt: dict | None,
    spec: Speculation | None,
) -> Built:
    """The one-shot chat turn through the request builder (generation/request.py): `prompt`
    after the system prompt, the --image then --audio files before it."""
    user: str | list[dict] = prompt
    if a.image or a.audio:
        user = [  # opened here so that a refusal names the flag
            {"type": "image", "image": model.prepare_image(path, f"--image {path}")}
            for path in a.image
        ]
        for path in a.audio:
            clip = model.audio_part({"type": "audio", "audio": path}, f"--audio {path}")
            if clip is None:
                raise MlxlisError(f"{model.name} takes no audio", field=f"--audio {path}")
            user.append({"type": "audio", "audio": clip})
        user.append({"type": "text", "text": prompt})
    messages = [{"role": "system", "content": a.system}] if a.system else []
    messages.append({"role": "user", "content": user})
    ask = Ask(messages, params, thinking=a.thinking, response_format=fmt, speculation=spec)
    built = build(model, ask, context=model.context_length)
    thinking_note(model, a.thinking)
    return built


def stream_reply(
    model: Model, events: Iterator[Event], prompt: str | None, show_reasoning: bool
) -> Event | None:
    """Print `events`: the answer to stdout, the reasoning (`<think>` block) to stderr, dimmed
    when stderr is a terminal; `prompt` None (raw completion) prints everything to stdout.
    Returns the final Event."""
    splitter = (
        None
        if prompt is None
        else ReasoningSplitter.for_prompt(model.tokenizer, prompt, model.template)
    )
    tty = sys.stderr.isatty()
    in_reasoning = False
    final = None
    try:
        for ev in events:
            if splitter is None:
                parts = [(ANSWER, ev.text)]
            else:
                parts = splitter.feed(ev.text, ev.token)
                if ev.finish_reason is not None:
                    parts += splitter.flush()
            final = ev
            for kind, text in parts:
                if kind == ANSWER:
                    if in_reasoning:
                        sys.stderr.write("\x1b[0m\n" if tty else "\n")
                        in_reasoning = False
                    sys.stdout.write(text)
                elif show_reasoning:
                    if not in_reasoning:
                        sys.stderr.write("\x1b[2m" if tty else "")
                        in_reasoning = True
                    sys.stderr.write(text)
            sys.stderr.flush()
            sys.stdout.flush()
    finally:  # Ctrl+C inside the reasoning must not leave the terminal dimmed
        if in_reasoning:
            sys.stderr.write("\x1b[0m\n" if tty else "\n")
            sys.stderr.flush()
    sys.stdout.write("\n")
    return final


def run_one_shot(a: argparse.Namespace, params) -> int:
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    model = load_model(a)
    if model.task != "generate":  # before the template diagnosis, which would mislead
        raise UnsupportedError(
            f"{model.name} is {'an embedding' if model.task == 'embed' else 'a reranking'} "
            "model: it does not generate "
            "(`mlxlis embed -m MODEL TEXT...`)",
            field="model",
        )
    if model.rank != 0:  # pipelined: rank 0 generates, this rank runs its share of each step
        follow(model)
        return 0
    try:
        code = one_shot(a, params, model, prompt)
    except PipelineError:  # the ranks are out of step: no end to announce, they are ending
        raise
    except BaseException:
        finish(ranks_of(model))
        raise
    finish(ranks_of(model))
    return code


def one_shot(a: argparse.Namespace, params: SamplingParams, model: Model, prompt: str) -> int:
    if a.verbose:
        print_details(model)
    fmt = response_format(a)
    spec = load_speculation(a, model)
    events: Iterator[Event]
    if a.no_chat:
        if a.image or a.audio:
            flag = "--image" if a.image else "--audio"
            raise MlxlisError("images and audio need the chat template (not --no-chat)", field=flag)
        text = None
        ids = model.tokenizer.encode(prompt)
        events = generate(model, ids, params, response_format=fmt, speculation=spec)
    else:
        built = one_shot_request(model, a, params, prompt, fmt, spec)
        text, events = built.prompt, run_request(model, built.request)
    final = stream_reply(model, events, text, a.thinking is not False)
    if a.verbose and final is not None:
        s = final.stats
        say(
            f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s; "
            f"generated: {s.generated_tokens} tokens, {s.decode_tps:.1f} tok/s; "
            f"first token {s.time_to_first_token * 1000:.0f} ms; "
            f"peak memory {s.peak_memory / 2**20:.0f} MiB; finish: {final.finish_reason}"
        )
        if spec is not None:
            say(f"speculative: {speculation_line(s, spec)}")
    return 0
