"""`mlxlis chat`: the Textual chat app (a raw-completion pad with --no-chat).

The model loads on mlxlis's one MLX thread (mlxlis.runtime.mlx_thread) while the UI is already up;
replies are generated there too and streamed to a Markdown widget in batches, a reasoning
model's `<think>` block to a collapsible block above it. Esc / Ctrl+C stop a reply through
ChatSession's `should_stop`. Nothing the user typed is ever dropped: a refused or failed send
puts the text back into the input, and every engine error becomes a notification.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from mlxlis.generation.warmup import warm_up
from mlxlis.models.model import Model
from mlxlis.runtime.mlx_thread import shared as mlx_thread

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Markdown, Static

from tui.chat_commands import CommandsMixin
from tui.engine import (
    Engine,
    Options,
    attachment_line,
    load_model,
    model_names_cached,
    parse_args,
)
from tui.store import new_id, save_record
from tui.style import CSS as APP_CSS
from tui.widgets import Bubble, Diagnosis, Loading, PromptInput

QUIT_WAIT_SECONDS = 10.0  # a reply stops at its next token or prefill chunk
FLUSH_SECONDS = 0.05  # the worker hands text to the UI at most ~20 times a second
FINISH_NOTES = {"stop": "done", "cancelled": "stopped", "length": "max_tokens reached"}


class Progress(Message):
    def __init__(self, stage: str, done: int, total: int):
        super().__init__()
        self.stage, self.done, self.total = stage, done, total


class Loaded(Message):
    def __init__(self, model=None, error: BaseException | None = None):
        super().__init__()
        self.model, self.error = model, error


class Chunk(Message):
    """Streamed text: `text` the answer, `reasoning` the reasoning (`thought`: its tokens)."""

    def __init__(self, text: str, stats, context: int, reasoning: str = "", thought: int = 0):
        super().__init__()
        self.text, self.stats, self.context = text, stats, context
        self.reasoning, self.thought = reasoning, thought


class Finished(Message):
    def __init__(
        self, reason: str | None, stats, produced: int, error: BaseException | None = None
    ):
        super().__init__()
        self.reason, self.stats, self.produced, self.error = reason, stats, produced, error


def describe_error(e: BaseException) -> str:
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        return f"out of memory: {e}"
    return str(e) or type(e).__name__


class ChatApp(CommandsMixin, App[int]):
    """The chat app. Inject `model=` (already loaded) or `load=` (options, progress) -> model,
    plus `session_factory=` / `generate=` to drive it with a fake engine in tests."""

    TITLE = "mlxlis chat"
    CSS = APP_CSS
    BINDINGS = [
        Binding("escape", "stop", "Stop reply"),
        Binding("ctrl+c", "stop_or_copy", "Stop", show=False, priority=True),
        Binding("f1", "help", "Help"),
        Binding("f2", "preview", "Prompt preview"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(
        self,
        options: Options | None = None,
        *,
        model=None,
        load: Callable | None = None,
        session_factory: Callable | None = None,
        generate: Callable | None = None,
        data_dir=None,
    ):
        super().__init__()
        self.options = options or Options()
        self._model = model
        self._load = load or load_model
        self._session_factory = session_factory
        self._generate_fn = generate
        self.data_dir = data_dir
        self.engine: Engine | None = None
        self.generating = False
        self.record_id = new_id()
        self._stop = threading.Event()
        self._quitting = threading.Event()  # the warm-up ends early on quit
        self._reply: Bubble | None = None
        self._user: Bubble | None = None
        self._stream = None
        self._sent = ""
        self._reply_text: list[str] = []

    # --- layout ---
    def compose(self) -> ComposeResult:
        yield Static(Text(f"mlxlis chat · loading {self.options.model} …"), id="model-header")
        with VerticalScroll(id="conversation"):
            yield Loading(self.options.model)
        yield PromptInput(
            id="input",
            soft_wrap=True,
            show_line_numbers=False,
            placeholder="Message — Enter sends, Shift+Enter / Ctrl+J new line, /help for commands",
        )
        yield Static("", id="status")
        yield Footer()

    @property
    def conversation(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    @property
    def prompt_input(self) -> PromptInput:
        return self.query_one(PromptInput)

    def on_mount(self) -> None:
        self.prompt_input.focus()
        self.prompt_input.completions = model_names_cached
        if self._model is not None:
            self.post_message(Loaded(self._model))
        else:
            self._load_worker()

    async def start_loading(self) -> None:
        """Load `options.model` (/model): the loading panel, then Loaded."""
        self._set_header(f"mlxlis chat · loading {self.options.model} …")
        await self.conversation.mount(Loading(self.options.model))
        self.update_status()
        self._load_worker()

    # --- loading ---
    def _load_worker(self) -> None:
        mlx_thread().submit(self._load_job)

    def _load_job(self) -> None:
        def progress(stage: str, done: int, total: int) -> None:
            self.post_message(Progress(stage, done, total))

        try:
            model = self._load(self.options, progress)
        except BaseException as e:  # noqa: BLE001 — shown, never raised into the UI
            self.post_message(Loaded(error=e))
            return
        self.post_message(Loaded(model))
        if isinstance(model, Model):  # (not a test's stand-in) while the user types the first
            warm_up(model, self.options.sampling, self._quitting.is_set)  # kernels compile

    def on_progress(self, msg: Progress) -> None:
        for w in self.query(Loading):
            w.progress(msg.stage, msg.done, msg.total)
        if self.engine is None:  # downloads: file, bytes, speed and ETA where the user looks
            self._set_header(f"mlxlis chat · loading {self.options.model} — {msg.stage}")

    async def on_loaded(self, msg: Loaded) -> None:
        await self.query(Loading).remove()
        if msg.error is not None:
            self._set_header(f"mlxlis chat · {self.options.model} — failed to load")
            self.notify(
                describe_error(msg.error),
                title="could not load the model",
                severity="error",
                timeout=30,
            )
            return
        try:
            self.engine = Engine(
                msg.model,
                self.options,
                session_factory=self._session_factory,
                generate=self._generate_fn,
            )
        except Exception as e:  # noqa: BLE001
            self.notify(describe_error(e), title="could not start", severity="error", timeout=30)
            return
        self._set_header(self.engine.header())
        if self.engine.raw:
            self.prompt_input.placeholder = "Text to continue — fed as is, no chat template"
        await self.show_welcome()
        self.update_status()

    async def show_welcome(self) -> None:
        if self.engine is None:
            return
        if self.engine.blocked:
            await self.conversation.mount(Diagnosis(self.engine.diagnosis()))
            self.notify(
                "no chat template: chat is disabled (see --no-chat, --chat-template)",
                severity="warning",
                timeout=10,
            )

    def _set_header(self, text: str) -> None:
        self.query_one("#model-header", Static).update(Text(text))

    # --- sending ---
    async def on_prompt_input_submitted(self, msg: PromptInput.Submitted) -> None:
        text = msg.text
        if not text.strip():
            return
        try:
            if await self.run_command_text(text):
                return
        except Exception as e:  # noqa: BLE001 — a bad command is a notification
            self.notify(describe_error(e), severity="error")
            return
        if text.startswith("//"):
            text = text[1:]
        refusal = self.send_refusal()
        if refusal:
            self.notify(refusal + " — your text stays in the input", severity="warning")
            return
        self.prompt_input.clear()
        await self.start_reply(text)

    def send_refusal(self) -> str | None:
        if self.engine is None:
            return "the model is not loaded yet"
        if self.generating:
            return "a reply is still being generated (Esc stops it)"
        if self.engine.blocked:
            return (
                "this model has no chat template, so chat is disabled (--no-chat / --chat-template)"
            )
        return None

    async def start_reply(self, text: str) -> None:
        raw = self.engine.raw
        self._sent = text
        shown = [attachment_line(im) for im in self.engine.attachments]
        self._user = Bubble("user", "\n\n".join([*shown, text]), raw=raw)
        self._reply = Bubble("assistant", raw=raw)
        self._reply_text = []
        await self.conversation.mount_all([self._user, self._reply])
        self._stream = Markdown.get_stream(self._reply.markdown)
        self.conversation.anchor()
        self.generating = True
        self._stop.clear()
        self.update_status(note="generating…")
        self._generate_worker(text)

    def _generate_worker(self, text: str) -> None:
        # MLX work runs on the process's one MLX thread (see mlxlis.runtime.mlx_thread: a worker
        # thread that exits during shutdown aborts the process)
        mlx_thread().submit(lambda: self._generate_job(text))

    def _generate_job(self, text: str) -> None:
        buf: list[str] = []
        thought: list[str] = []  # reasoning text since the last flush
        produced, last_flush, stats, reason, n_thought = 0, time.monotonic(), None, None, 0
        try:
            for ev in self.engine.send(text, self._stop.is_set):
                stats, n_thought = ev.stats, ev.reasoning_tokens
                if ev.token is not None:
                    produced += 1
                if ev.finish_reason is not None:
                    reason = ev.finish_reason
                buf.append(ev.answer)
                thought.append(ev.reasoning)
                now = time.monotonic()
                if now - last_flush >= FLUSH_SECONDS or reason is not None:
                    ctx = self.engine.streaming_context(stats.generated_tokens)
                    self.post_message(Chunk("".join(buf), stats, ctx, "".join(thought), n_thought))
                    buf.clear()
                    thought.clear()
                    last_flush = now
            self.post_message(Finished(reason, stats, produced))
        except BaseException as e:  # noqa: BLE001 — every engine error becomes a notification
            if buf or thought:
                self.post_message(Chunk("".join(buf), stats, 0, "".join(thought), n_thought))
            self.post_message(Finished(None, stats, produced, error=e))

    async def on_chunk(self, msg: Chunk) -> None:
        reply = self._reply
        if reply is not None:
            reply.reasoning_tokens = msg.thought
            if msg.reasoning:
                await reply.add_reasoning(msg.reasoning)
            if msg.text:
                reply.answer_started()  # the reasoning block folds away
        if self._stream is not None and msg.text:
            self._reply_text.append(msg.text)
            await self._stream.write(msg.text)
        self.update_status(msg.stats, msg.context, note="generating…")

    async def on_finished(self, msg: Finished) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.generating = False
        reply, user = self._reply, self._user
        self._reply = self._user = None
        if reply is not None:
            reply.reply_ended()
        if msg.error is not None:
            self.notify(
                describe_error(msg.error),
                title=type(msg.error).__name__,
                severity="error",
                timeout=15,
            )
            if msg.produced == 0 and not "".join(self._reply_text).strip():
                # nothing came back: undo the turn and give the text back to the user
                self.engine.rollback()
                for w in (user, reply):
                    if w is not None:
                        await w.remove()
                self.prompt_input.restore(self._sent)
                self.update_status(note="not sent")
                return
            if reply is not None:
                reply.mark(f"■ stopped by an error: {describe_error(msg.error)}", "stopped")
        elif reply is not None:
            if msg.reason == "cancelled":
                reply.mark("■ stopped", "stopped")
            elif msg.reason == "length":
                reply.mark("… max_tokens reached (/params max_tokens=N)", "length")
        self.update_status(msg.stats, note=msg.reason or "error")
        self.persist()

    # --- stopping ---
    async def action_quit(self) -> None:
        self._stop.set()  # a generating thread would otherwise run on to max_tokens
        self._quitting.set()
        self.exit()

    def on_unmount(self) -> None:
        self._stop.set()
        self._quitting.set()

    def action_stop(self) -> None:
        if self.generating:
            self._stop.set()
            self.update_status(note="stopping…")

    def action_stop_or_copy(self) -> None:
        if self.generating:
            self.action_stop()
            return
        focused = self.focused
        if isinstance(focused, PromptInput) and focused.selected_text:
            focused.action_copy()
        else:
            self.notify("Ctrl+C stops a reply; Ctrl+Q quits", timeout=3)

    # --- status + persistence ---
    def update_status(self, stats=None, context: int | None = None, note: str = "") -> None:
        if self.engine is None:
            return
        used, limit = self.engine.context
        if context is not None and context > 0:
            used = context
        parts = []
        if stats is not None:
            parts.append(f"first token {stats.time_to_first_token * 1000:.0f} ms")
            parts.append(f"{stats.decode_tps:.1f} tok/s")
            if getattr(stats, "draft_tokens", 0):  # speculative decoding: drafts kept
                parts.append(f"drafts kept {stats.accepted_tokens / stats.draft_tokens:.0%}")
        parts.append(f"ctx {used}/{limit}")
        if stats is not None and stats.peak_memory:
            parts.append(f"peak {stats.peak_memory / 2**20:.0f} MiB")
        p = self.engine.sampling
        parts.append(f"temp {p.temperature}, max {p.max_tokens}")
        if self.engine.thinking_supported:
            parts.append(f"think {self.engine.thinking_label()}")
        if self.engine.response_format is not None:
            parts.append("json")
        if note:
            parts.append(FINISH_NOTES.get(note, note))
        self.query_one("#status", Static).update(Text(" │ ".join(parts)))

    def persist(self) -> None:
        if self.engine is None or not self.engine.turns:
            return
        try:
            save_record(self.engine.record(self.record_id), self.data_dir)
        except OSError as e:
            self.notify(f"could not save the conversation: {e}", severity="warning")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mlxlis chat`; returns the process exit code."""
    import sys

    options = parse_args(list(sys.argv[1:] if argv is None else argv))
    app = ChatApp(options)
    result = app.run()
    code = 1 if app.return_code not in (0, None) else (result or 0)
    # Quitting set the stop flag, so a reply ends at its next token. A load cannot be stopped:
    # leave without shutting the interpreter down around it (see mlxlis.runtime.mlx_thread).
    if not mlx_thread().wait_idle(timeout=0.5):
        print("mlxlis chat: waiting for the model to stop…", file=sys.stderr, flush=True)
        if not mlx_thread().wait_idle(timeout=QUIT_WAIT_SECONDS):
            print("mlxlis chat: quit without waiting for it", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
