"""The chat app (tui/) driven by Textual's Pilot against a scripted fake engine.

The fake model has describe()/render_chat/tokenizer; the fake session streams scripted Events
with small sleeps and honours should_stop exactly as mlxlis.ChatSession does. These tests prove
the UI's behaviour (streaming, keys, stop, commands, errors, persistence), not the engine's:
tests/test_tui_real.py runs the same flow with real models.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mlxlis import Event, Stats
from mlxlis.errors import ContextLimitError, MlxlisError, ModelNotFoundError, NoChatTemplateError
from mlxlis.generation.sampling import SamplingError, SamplingParams
from mlxlis.generation.session import Turn
from mlxlis.runtime.mlx_thread import shared as mlx_thread

import pytest
from conftest import need_pulled

from tui.app import ChatApp, parse_args
from tui.commands import CommandError, complete, parse_command
from tui.engine import Options
from tui.screens import PreviewScreen
from tui.store import atomic_write, data_dir, list_records
from tui.widgets import Bubble, Diagnosis, Loading, Note

# ---------------------------------------------------------------- the scripted fake engine

DIAGNOSIS = (
    "fake-model carries no chat template anywhere (no chat_template.jinja, no "
    "tokenizer_config.json entry, no GGUF tokenizer.chat_template).\nLikely cause: a "
    "base model. Use --no-chat for raw completion, or --chat-template FILE|NAME."
)


class FakeTokenizer:
    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class FakeModel:
    context_length = 4096
    supports_thinking = False

    def __init__(self, template: str | None = "fake:chatml"):
        self.template_source = template
        self.tokenizer = FakeTokenizer()

    def describe(self) -> dict:
        return {
            "model": "fake-model.gguf",
            "family": "llama",
            "format": "gguf",
            "quant": "4-bit g32×30",
            "dtype": "float32",
            "template": self.template_source or "none",
        }

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.template_source is None:
            raise NoChatTemplateError(self.missing_template_diagnosis())
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def missing_template_diagnosis(self) -> str:
        return DIAGNOSIS

    def make_cache(self) -> list:
        return []


def default_script(text: str) -> list[str]:
    return ["Hello", " **world**", "!", " You", " said:", f" {text}"]


class FakeSession:
    """Mimics mlxlis.ChatSession: send() yields Events, appends the assistant Turn at the end."""

    def __init__(
        self,
        model,
        system,
        *,
        script=default_script,
        delay: float = 0.005,
        fail: BaseException | None = None,
        fail_after: int = 0,
        step: Callable[[int], None] | None = None,
    ):
        self.model, self.system = model, system
        self.turns: list[Turn] = []
        self.context_limit = model.context_length
        self.context_used = 0
        self.last_prompt_tokens = 0
        self.thinking: bool | None = None
        self.response_format: dict | None = None
        self.save_cache = None  # keeps no cache, as a raw pad
        self.script, self.delay = script, delay
        self.step = step  # called before token i instead of sleeping `delay`, when given
        self.fail, self.fail_after = fail, fail_after
        self.calls: list[tuple[str, dict]] = []
        self.after_stop = 0  # tokens produced after should_stop first returned True
        self.last_stats: Stats | None = None  # the Stats of the last Event yielded

    @property
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [t.message() for t in self.turns]

    def reset(self) -> None:
        self.turns.clear()
        self.context_used = 0

    def set_system(self, text):
        self.system = text or None

    def prompt_preview(self, pending_user=None) -> str:
        if pending_user is None:
            return self.model.render_chat(self.messages)
        self.turns.append(Turn("user", pending_user))
        try:
            return self.model.render_chat(self.messages)
        finally:
            self.turns.pop()

    def send(self, text: str, should_stop=None, **sampling):
        self.calls.append((text, dict(sampling)))
        self.turns.append(Turn("user", text))
        if self.fail is not None and self.fail_after == 0:
            self.turns.pop()
            raise self.fail
        ids = self.model.tokenizer.encode(self.model.render_chat(self.messages))
        self.last_prompt_tokens = len(ids)
        stats = Stats(prompt_tokens=len(ids), time_to_first_token=0.01)
        out: list[str] = []
        reason = "stop"
        stop_seen = False
        try:
            pieces = self.script(text)[: sampling.get("max_tokens", 256)]
            for i, piece in enumerate(pieces):
                if self.fail is not None and i == self.fail_after:
                    raise self.fail
                if self.step is not None:
                    self.step(i)
                else:
                    time.sleep(self.delay)
                stats.completion_tokens = i + 1
                stats.decode_seconds = 0.001 * (i + 1)
                if stop_seen:
                    self.after_stop += 1
                out.append(piece)
                self.last_stats = stats
                yield Event(i, piece, stats)
                if should_stop is not None and should_stop():
                    stop_seen = True
                    reason = "cancelled"
                    break
            else:
                if len(pieces) == sampling.get("max_tokens", 256):
                    reason = "length"
            stats.peak_memory = 123 * 2**20
            self.context_used = len(ids) + len(out)
            self.last_stats = stats
            yield Event(None, "", stats, finish_reason=reason)
        finally:
            self.turns.append(Turn("assistant", "".join(out), stopped=reason == "cancelled"))


def fake_generate(calls: list):
    """A stand-in for mlxlis.generate (raw mode) that records what it was fed."""

    def generate(model, ids, max_tokens=64, should_stop=None, **kw):
        calls.append((list(ids), max_tokens, kw))
        stats = Stats(prompt_tokens=len(ids), time_to_first_token=0.01)
        for i, piece in enumerate([" there", " was", " a", " fox."][:max_tokens]):
            time.sleep(0.005)
            stats.completion_tokens = i + 1
            stats.decode_seconds = 0.001 * (i + 1)
            yield Event(i, piece, stats)
        yield Event(None, "", stats, finish_reason="stop")

    return generate


# ---------------------------------------------------------------- harness

SIZE = (110, 40)


async def wait_for(pilot, predicate, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `predicate` while letting the app run; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def make_app(
    tmp_path: Path,
    *,
    model=None,
    session_kw: dict | None = None,
    options: Options | None = None,
    **kw,
) -> ChatApp:
    """A ChatApp on the fake engine; app.sessions lists the sessions it made, app.notes the
    notifications it showed as (severity, message)."""
    sessions: list[FakeSession] = []

    def factory(m, system):
        s = FakeSession(m, system, **(session_kw or {}))
        sessions.append(s)
        return s

    if "load" not in kw:
        kw["model"] = model or FakeModel()
    app = ChatApp(options or Options(), session_factory=factory, data_dir=tmp_path / "data", **kw)
    app.sessions = sessions
    return record_notes(app)


def record_notes(app: ChatApp) -> ChatApp:
    """Keep every notification as (severity, text) in app.notes, for assertions."""
    app.notes = []
    real_notify = app.notify

    def notify(message, *a, severity="information", **k):
        app.notes.append((severity, str(message)))
        return real_notify(message, *a, severity=severity, **k)

    app.notify = notify
    return app


def run(app: ChatApp, scenario) -> None:
    """Run `scenario(pilot)` inside app.run_test() (plain sync test: no async plugin needed)."""

    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.engine is not None or app.notes, what="load")
            await scenario(pilot)

    asyncio.run(main())


async def type_text(pilot, app: ChatApp, text: str) -> None:
    app.prompt_input.insert(text)
    await pilot.pause()


async def send(pilot, app: ChatApp, text: str, timeout: float = 5.0) -> None:
    """Type `text`, press Enter and wait until the reply has finished."""
    before = len(app.engine.turns)
    await type_text(pilot, app, text)
    await pilot.press("enter")
    await wait_for(
        pilot,
        lambda: len(app.engine.turns) >= before + 2 and not app.generating,
        timeout,
        what=f"reply to {text!r}",
    )
    await pilot.pause()


def bubbles(app: ChatApp, role: str | None = None) -> list[Bubble]:
    return [b for b in app.query(Bubble) if role is None or b.role == role]


def reply_text(app: ChatApp) -> str:
    return bubbles(app, "assistant")[-1].markdown.source


def errors(app: ChatApp) -> list[str]:
    return [m for sev, m in app.notes if sev == "error"]


# ---------------------------------------------------------------- chat flow


def test_enter_sends_and_reply_streams_as_markdown(tmp_path):
    """Typing + Enter sends the text to the session; the scripted reply streams into a Markdown
    bubble, the input is cleared, and the status line shows tok/s and context use."""
    app = make_app(tmp_path)

    async def scenario(pilot):
        header = str(app.query_one("#model-header").render())
        assert "fake-model.gguf" in header and "template: fake:chatml" in header
        await pilot.press(*"hi")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 2 and not app.generating)
        await pilot.pause()
        assert app.sessions[0].calls[0][0] == "hi"
        assert [b.role for b in bubbles(app)] == ["user", "assistant"]
        assert reply_text(app) == "Hello **world**! You said: hi"
        assert app.prompt_input.text == ""
        status = str(app.query_one("#status").render())
        used = app.sessions[0].context_used
        assert used > 0 and f"ctx {used}/4096" in status
        # the figures of the engine's last Stats, formatted as update_status promises
        stats = app.sessions[0].last_stats
        assert stats is not None and stats.generated_tokens == len(default_script("hi"))
        assert stats.decode_tps > 0 and stats.peak_memory > 0
        assert f"{stats.decode_tps:.1f} tok/s" in status
        assert f"first token {stats.time_to_first_token * 1000:.0f} ms" in status
        assert f"peak {stats.peak_memory / 2**20:.0f} MiB" in status and "done" in status
        assert not bubbles(app, "assistant")[0].stopped

    run(app, scenario)


def test_shift_enter_and_ctrl_j_insert_newlines_without_sending(tmp_path):
    """Shift+Enter (Textual 8 reports it as "shift+enter") and Ctrl+J insert a newline and do
    not send; Enter then sends the multi-line text exactly."""
    app = make_app(tmp_path)

    async def scenario(pilot):
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        await pilot.pause()
        assert app.prompt_input.text == "a\nb\nc"
        assert app.sessions[0].calls == [] and bubbles(app) == []
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 2 and not app.generating)
        assert app.sessions[0].calls[0][0] == "a\nb\nc"

    run(app, scenario)


def test_escape_stops_midstream_keeps_partial_reply_and_next_turn_works(tmp_path):
    """Esc mid-stream stops within a couple of tokens (through should_stop); the partial reply
    stays, marked stopped, in the pane and the session; the next turn runs normally."""
    long = lambda text: [f" w{i}" for i in range(400)]  # noqa: E731
    app = make_app(tmp_path, session_kw=dict(script=long, delay=0.01))

    async def scenario(pilot):
        await type_text(pilot, app, "tell me a long story")
        await pilot.press("enter")
        await wait_for(
            pilot, lambda: app.generating and len(app._reply_text) >= 2, what="first streamed text"
        )
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating, what="stop")
        await pilot.pause()
        session = app.sessions[0]
        assert session.after_stop == 0  # should_stop was honoured at the next token
        turn = session.turns[-1]
        assert turn.role == "assistant" and turn.stopped
        assert 0 < len(turn.content.split()) < 400
        reply = bubbles(app, "assistant")[-1]
        assert reply.stopped and reply.markdown.source == turn.content
        assert "■ stopped" in str(reply.query(".marker").last().render())
        # a next turn works, with the stopped reply still in the conversation
        session.script = default_script
        await send(pilot, app, "again")
        assert reply_text(app) == "Hello **world**! You said: again"
        assert [t.role for t in session.turns] == ["user", "assistant"] * 2
        assert not session.turns[-1].stopped

    run(app, scenario)


def test_ctrl_c_stops_generation(tmp_path):
    """Ctrl+C stops a reply (a priority binding, so the focused TextArea's copy doesn't eat
    it), and the app keeps running."""
    long = lambda text: [f" w{i}" for i in range(400)]  # noqa: E731
    app = make_app(tmp_path, session_kw=dict(script=long, delay=0.01))

    async def scenario(pilot):
        await type_text(pilot, app, "go")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app._reply_text) >= 1, what="streaming")
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.generating, what="stop")
        assert app.sessions[0].turns[-1].stopped and app.is_running

    run(app, scenario)


def test_quit_while_generating_stops_the_worker(tmp_path):
    """Ctrl+Q mid-reply exits without waiting for the generating thread, and that thread is told
    to stop instead of running on to max_tokens (which would keep the process alive).

    Proved by order of events, not by time: the worker is held inside token `held` (after a chunk
    has reached the UI) until the app has exited, so the exit cannot have waited for it; once
    released it finishes that one token and stops: held + 1 of the 400 scripted tokens, the turn
    marked stopped, and no token produced after should_stop turned true."""
    held, total = 5, 400
    reached, release = threading.Event(), threading.Event()
    released: list[bool] = []  # False would mean the 10 s safety net ran out, not the test

    def step(i: int) -> None:
        if i < held:
            time.sleep(0.02)  # >= 0.06 s before token 2 ends: a chunk is flushed (FLUSH_SECONDS)
        elif i == held:
            reached.set()
            released.append(release.wait(10))  # the test releases it below

    long = lambda text: [f" w{i}" for i in range(total)]  # noqa: E731
    app = make_app(tmp_path, session_kw=dict(script=long, step=step))

    async def scenario(pilot):
        await type_text(pilot, app, "go")
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: reached.is_set() and len(app._reply_text) >= 1,
            what="worker held mid-reply with text streamed",
        )
        await pilot.press("ctrl+q")

    try:
        run(app, scenario)
        assert not app.is_running
        assert reached.is_set() and not release.is_set()  # the exit did not wait for the worker
        assert app.sessions[0].turns[-1].role == "user"  # the reply is still being generated
    finally:
        release.set()
        assert mlx_thread().wait_idle(timeout=10), "worker still running after its release"
    session = app.sessions[0]
    turn = session.turns[-1]
    assert released == [True] and turn.role == "assistant" and turn.stopped
    assert turn.content.split() == [f"w{i}" for i in range(held + 1)]  # work: 6 of 400 tokens
    assert session.after_stop == 0


def test_text_typed_during_generation_is_not_lost(tmp_path):
    """Enter while a reply streams refuses to send and keeps the typed text; once the reply is
    done, Enter sends it."""
    slow = lambda text: [f" w{i}" for i in range(30)]  # noqa: E731
    app = make_app(tmp_path, session_kw=dict(script=slow, delay=0.02))

    async def scenario(pilot):
        await type_text(pilot, app, "first")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.generating)
        await type_text(pilot, app, "second")
        await pilot.press("enter")
        await pilot.pause()
        assert app.prompt_input.text == "second"
        assert any("stays in the input" in m for _, m in app.notes)
        await wait_for(pilot, lambda: not app.generating, what="first reply")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 4 and not app.generating)
        assert [c[0] for c in app.sessions[0].calls] == ["first", "second"]

    run(app, scenario)


def test_view_follows_the_stream(tmp_path):
    """The conversation is anchored while a long reply streams: it ends scrolled to the bottom."""
    long = lambda text: [f"line {i}\n\n" for i in range(80)]  # noqa: E731
    app = make_app(tmp_path, session_kw=dict(script=long, delay=0.001))

    async def scenario(pilot):
        await send(pilot, app, "lines please")
        conv = app.conversation
        await wait_for(
            pilot,
            lambda: conv.max_scroll_y > 0 and conv.scroll_y >= conv.max_scroll_y,
            what="scrolled to the end",
        )

    run(app, scenario)


# ---------------------------------------------------------------- commands


def test_json_command_sets_the_sessions_response_format(tmp_path):
    """/json on, /json FILE (a JSON schema) and /json off set what the session's next replies
    are constrained to (the status line says json); a schema the engine cannot compile, or a
    file that is not JSON, is refused where typed, the text kept."""
    schema = tmp_path / "person.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}}}')
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    app = make_app(tmp_path)

    async def scenario(pilot):
        session = app.sessions[0]
        for cmd, want in (
            ("/json on", {"type": "json_object"}),
            (
                f"/json {schema}",
                {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": json.loads(schema.read_text())},
                },
            ),
        ):
            await type_text(pilot, app, cmd)
            await pilot.press("enter")
            await pilot.pause()
            assert app.prompt_input.text == "" and session.response_format == want, cmd
            assert "json" in str(app.query_one("#status").render())
        for bad in (f"/json {broken}", f"/json {tmp_path / 'missing.json'}"):
            app.prompt_input.clear()
            await type_text(pilot, app, bad)
            await pilot.press("enter")
            await pilot.pause()
            assert app.prompt_input.text == bad and any("/json" in m for m in errors(app))
        app.prompt_input.clear()
        await type_text(pilot, app, "/json off")
        await pilot.press("enter")
        await pilot.pause()
        assert session.response_format is None

    run(app, scenario)


def test_system_temp_and_params_commands_reach_the_session(tmp_path):
    """/system sets the session's system prompt (seen in the rendered prompt); /temp and /params
    change the sampling passed to the next send; a bad /params is refused, text kept."""
    app = make_app(tmp_path)

    async def scenario(pilot):
        session = app.sessions[0]
        for cmd in ("/system Be brief.", "/temp 0.7", "/params top_p=0.9 max_tokens=20 seed=3"):
            await type_text(pilot, app, cmd)
            await pilot.press("enter")
            await pilot.pause()
            assert app.prompt_input.text == "", cmd
        assert session.system == "Be brief."
        assert "<|im_start|>system\nBe brief.<|im_end|>" in session.prompt_preview("x")
        notes = [n.source for n in app.query(Note)]
        assert any("top_p=0.9" in n and "max_tokens=20" in n for n in notes)
        await send(pilot, app, "hello")
        sampling = session.calls[-1][1]
        assert sampling["temperature"] == 0.7 and sampling["top_p"] == 0.9
        assert sampling["max_tokens"] == 20 and sampling["seed"] == 3
        for bad, field in (
            ("/params top_p=7", "top_p"),
            ("/params min_p=1", "min_p"),
            ("/temp -1", "temperature"),
        ):
            app.prompt_input.clear()
            await type_text(pilot, app, bad)
            await pilot.press("enter")
            await pilot.pause()
            assert app.prompt_input.text == bad  # refused where typed, the text kept
            assert any(f"{field}: must be" in m for m in errors(app)), bad
        assert app.engine.sampling.top_p == 0.9 and app.engine.sampling.min_p == 0.0

    run(app, scenario)


def test_clear_starts_a_new_conversation(tmp_path):
    """/clear empties the session and the pane (the system prompt stays)."""
    app = make_app(tmp_path, options=Options(system="sys"))

    async def scenario(pilot):
        await send(pilot, app, "one")
        assert len(app.engine.turns) == 2
        first_id = app.record_id
        await type_text(pilot, app, "/clear")
        await pilot.press("enter")
        await pilot.pause()
        assert app.engine.turns == [] and bubbles(app) == []
        assert app.engine.system == "sys" and app.record_id != first_id

    run(app, scenario)


def test_save_writes_markdown_atomically(tmp_path):
    """/save PATH writes the conversation as Markdown (no temp file left behind)."""
    app = make_app(tmp_path)
    out = tmp_path / "out" / "chat.md"

    async def scenario(pilot):
        await send(pilot, app, "save me")
        await type_text(pilot, app, f"/save {out}")
        await pilot.press("enter")
        await wait_for(pilot, out.exists, what="saved file")

    run(app, scenario)
    text = out.read_text()
    assert "## User\n\nsave me" in text
    assert "## Assistant\n\nHello **world**! You said: save me" in text
    assert sorted(p.name for p in out.parent.iterdir()) == ["chat.md"]


def test_help_and_preview_show_the_exact_prompt(tmp_path):
    """/help lists the commands; F2 shows the exact rendered prompt for the typed message with
    its special tokens; /preview shows the prompt as it stands; Esc closes the preview."""
    app = make_app(tmp_path, options=Options(system="S"))

    async def scenario(pilot):
        await type_text(pilot, app, "/help")
        await pilot.press("enter")
        await pilot.pause()
        assert "/params" in app.query(Note).last().source
        await type_text(pilot, app, "what is <b>?")
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PreviewScreen), what="preview")
        shown = app.screen.query_one("#preview-text").text
        assert shown == (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nwhat is <b>?"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, PreviewScreen))
        assert app.prompt_input.text == "what is <b>?"  # previewing doesn't consume the text
        app.prompt_input.clear()
        await type_text(pilot, app, "/preview")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, PreviewScreen))
        assert app.screen.query_one("#preview-text").text == app.sessions[0].prompt_preview()

    run(app, scenario)


def test_conversations_persist_and_reopen(tmp_path):
    """Each finished turn is saved as JSON in the data dir; /history lists it and /open N
    restores its turns (stopped flags included) into a fresh session and the pane."""
    app = make_app(tmp_path)

    async def scenario(pilot):
        await send(pilot, app, "remember this")
        saved = list((tmp_path / "data").glob("*.json"))
        assert len(saved) == 1
        rec = json.loads(saved[0].read_text())
        assert [t["role"] for t in rec["turns"]] == ["user", "assistant"]
        await type_text(pilot, app, "/clear")
        await pilot.press("enter")
        await pilot.pause()
        await type_text(pilot, app, "/history")
        await pilot.press("enter")
        await pilot.pause()
        assert "1. " in app.query(Note).last().source
        assert "remember this" in app.query(Note).last().source
        await type_text(pilot, app, "/open 1")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(bubbles(app)) == 2, what="restored bubbles")
        assert [(t.role, t.content) for t in app.engine.turns] == [
            ("user", "remember this"),
            ("assistant", "Hello **world**! You said: remember this"),
        ]
        assert bubbles(app, "assistant")[0].markdown.source.endswith("remember this")
        await send(pilot, app, "and more")  # the reopened conversation continues
        assert len(app.engine.turns) == 4
        await type_text(pilot, app, "/open 9")
        await pilot.press("enter")
        await pilot.pause()
        assert app.prompt_input.text == "/open 9" and any("/open N" in m for m in errors(app))

    run(app, scenario)


def test_unknown_command_is_refused_and_double_slash_escapes(tmp_path):
    """An unknown /command is refused with the text kept; "//x" sends "/x" as a message."""
    app = make_app(tmp_path)

    async def scenario(pilot):
        await type_text(pilot, app, "/nope")
        await pilot.press("enter")
        await pilot.pause()
        assert app.prompt_input.text == "/nope" and any("unknown command" in m for m in errors(app))
        app.prompt_input.clear()
        await send(pilot, app, "//usr/bin")
        assert app.sessions[0].calls[-1][0] == "/usr/bin"

    run(app, scenario)


# ---------------------------------------------------------------- errors


def test_engine_error_becomes_notification_and_text_is_kept(tmp_path):
    """A session that raises an MlxlisError (context full) gives an error notification; the app
    stays up, nothing is left in the pane or session, and the typed text is back in the input."""
    app = make_app(
        tmp_path,
        session_kw=dict(
            fail=ContextLimitError("the conversation needs 5000 tokens", field="context")
        ),
    )

    async def scenario(pilot):
        await type_text(pilot, app, "too long")
        await pilot.press("enter")
        await wait_for(pilot, lambda: errors(app), what="error notification")
        await wait_for(pilot, lambda: not app.generating and app.prompt_input.text)
        assert "5000 tokens" in errors(app)[0]
        assert app.is_running and bubbles(app) == [] and app.engine.turns == []
        assert app.prompt_input.text == "too long"

    run(app, scenario)


def test_midstream_error_keeps_partial_reply(tmp_path):
    """An error after some tokens (e.g. out of memory) is notified; the partial reply stays,
    marked as stopped, and the session stays consistent for the next turn."""
    app = make_app(tmp_path, session_kw=dict(fail=MemoryError("metal heap"), fail_after=2))

    async def scenario(pilot):
        await type_text(pilot, app, "boom")
        await pilot.press("enter")
        await wait_for(pilot, lambda: errors(app) and not app.generating, what="error")
        assert "out of memory" in errors(app)[0]
        assert bubbles(app, "assistant")[0].stopped
        assert reply_text(app) == "Hello **world**"
        app.sessions[0].fail = None
        await send(pilot, app, "ok now")
        assert reply_text(app).endswith("ok now")

    run(app, scenario)


def test_load_failure_is_notified_and_typing_survives(tmp_path):
    """A model that fails to load is an error notification, not a crash; Enter then refuses to
    send (the model is not loaded) and keeps the text."""

    def load(options, progress):
        raise ModelNotFoundError("no such file or folder", path="nowhere.gguf")

    app = make_app(tmp_path, load=load)

    async def scenario(pilot):
        await wait_for(pilot, lambda: errors(app))
        assert "nowhere.gguf" in errors(app)[0]
        await type_text(pilot, app, "hello?")
        await pilot.press("enter")
        await pilot.pause()
        assert app.prompt_input.text == "hello?" and app.is_running
        assert "failed to load" in str(app.query_one("#model-header").render())

    run(app, scenario)


def test_model_loads_in_a_worker_with_visible_progress(tmp_path):
    """The UI is up (loading panel with the pull progress) while the model loads in a thread;
    once loaded the header shows model, family, format + quant, dtype, device and template."""
    gate = __import__("threading").Event()

    def load(options, progress):
        progress("downloading part 1", 0, 2)
        gate.wait(5)
        return FakeModel()

    app = make_app(tmp_path, load=load)

    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(
                pilot,
                lambda: "downloading part 1 (0/2)" in str(app.query_one("#loading-stage").render()),
                what="progress shown",
            )
            assert app.engine is None and app.query(Loading)
            gate.set()
            await wait_for(pilot, lambda: app.engine is not None, what="loaded")
            await pilot.pause()
            header = str(app.query_one("#model-header").render())
            for part in (
                "fake-model.gguf",
                "llama",
                "gguf 4-bit g32×30",
                "float32",
                "cpu",
                "template: fake:chatml",
            ):
                assert part in header
            assert not app.query(Loading)

    asyncio.run(main())


# ---------------------------------------------------------------- templates and raw mode


def test_model_without_template_shows_diagnosis_and_refuses_to_send(tmp_path):
    """Chat mode on a model with no chat template never chats: the pane shows the diagnosis
    and the ways out (--no-chat, --chat-template), and Enter sends nothing, keeping the text."""
    app = make_app(tmp_path, model=FakeModel(template=None))

    async def scenario(pilot):
        await pilot.pause()
        panel = str(app.query_one(Diagnosis).render())
        assert "base model" in panel and "--no-chat" in panel and "--chat-template" in panel
        assert "NONE" in str(app.query_one("#model-header").render())
        await type_text(pilot, app, "hello")
        await pilot.press("enter")
        await pilot.pause()
        assert app.sessions[0].calls == [] and bubbles(app) == []
        assert app.prompt_input.text == "hello"
        await pilot.press("f2")  # the preview explains instead of showing a guessed prompt
        await pilot.pause()
        assert not isinstance(app.screen, PreviewScreen)
        assert any("no chat template" in m for m in errors(app))

    run(app, scenario)


def test_no_chat_mode_is_a_raw_completion_pad(tmp_path):
    """--no-chat: the header says raw completion, the text is fed as is (tokenizer.encode of
    exactly the typed text, no template) to generate, and the continuation is shown."""
    calls: list = []
    model = FakeModel(template=None)
    app = make_app(
        tmp_path, model=model, options=Options(no_chat=True), generate=fake_generate(calls)
    )

    async def scenario(pilot):
        assert "RAW COMPLETION" in str(app.query_one("#model-header").render())
        assert not app.query(Diagnosis)
        await send(pilot, app, "Once upon a time")
        assert calls[0][0] == model.tokenizer.encode("Once upon a time")
        assert reply_text(app) == " there was a fox."
        assert bubbles(app, "user")[0].query_one("Label").render().plain == "Prompt"
        await type_text(pilot, app, "The end")
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PreviewScreen))
        assert app.screen.query_one("#preview-text").text == "The end"

    run(app, scenario)


# ---------------------------------------------------------------- pieces


def test_parse_command_and_params():
    """Commands and parameters parse and validate (aliases, none seed, errors name the field)."""
    assert parse_command("hello") is None and parse_command("//x") is None
    assert parse_command("/params top_p=0.9") == ("params", "top_p=0.9")
    got = SamplingParams(seed=4).with_text("temp=0.5 max-tokens=9 seed=none")
    assert got == SamplingParams(temperature=0.5, max_tokens=9, seed=None)
    for bad in ("top_p", "top_k=-1", "max_tokens=0", "bogus=1", "min_p=x", "min_p=1"):
        with pytest.raises(SamplingError):
            SamplingParams().with_text(bad)
    with pytest.raises(CommandError):
        parse_command("/nope")


def test_model_names_complete_to_what_they_share():
    """Tab after "/model PREFIX" completes to the longest text the names starting with PREFIX
    share; nothing when none matches, when nothing would be added, or outside /model."""
    names = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert complete("/model smo", names) == "/model smollm2-135m"
    assert complete("/model qw", names) == "/model qwen2.5-coder-"
    assert complete("/model qwen2.5-coder-", names) is None
    assert complete("/model llama", names) is None
    assert complete("/system smo", names) is None and complete("/model", names) is None


def test_atomic_write_and_records(tmp_path, monkeypatch):
    """Conversations live in $MLXLIS_DATA/conversations; atomic_write leaves only the final
    file; list_records skips unreadable files."""
    monkeypatch.setenv("MLXLIS_DATA", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d" / "conversations"
    monkeypatch.delenv("MLXLIS_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "x"))
    assert data_dir() == tmp_path / "x" / "mlxlis" / "conversations"
    atomic_write(tmp_path / "a.json", json.dumps({"id": "a", "turns": [], "updated": 1}))
    (tmp_path / "broken.json").write_text("{not json")
    assert [r["id"] for r in list_records(tmp_path)] == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "broken.json"]


def test_main_argument_parsing():
    """`mlxlis chat` flags map onto Options (model, template, --no-chat, system, sampling)."""
    o = parse_args(
        [
            "-m",
            "x.gguf",
            "--no-chat",
            "--system",
            "s",
            "--temp",
            "0.5",
            "--max-tokens",
            "9",
            "--chat-template",
            "chatml",
        ]
    )
    assert (o.model, o.no_chat, o.system, o.chat_template) == ("x.gguf", True, "s", "chatml")
    assert o.sampling.temperature == 0.5 and o.sampling.max_tokens == 9
    with pytest.raises(SystemExit) as e:  # as the one-shot command: --think needs a template
        parse_args(["-m", "x.gguf", "--no-chat", "--think"])
    assert e.value.code == 2


def test_an_embedding_model_is_refused_by_the_chat_app_by_name():
    """`mlxlis chat -m all-minilm-l6-v2` (or /model to it): one clear error naming the model
    and what uses it, not a failure at the first message."""
    import tui.engine as engine

    need_pulled("all-minilm-l6-v2")
    with pytest.raises(MlxlisError) as e:
        engine.load_model(Options(model="all-minilm-l6-v2"), lambda *a: None)
    assert "all-minilm-l6-v2 is an embedding model" in str(e.value) and e.value.field == "model"


def test_load_model_pulls_a_missing_catalog_model_with_progress(monkeypatch):
    """load_model pulls a catalog model that is not in the store yet (reporting the pull's
    progress) before mlxlis.load; a pulled one is loaded directly."""
    import tui.engine as engine

    seen, pulled = [], []
    monkeypatch.setattr(engine.catalog, "is_pulled", lambda name: bool(pulled))

    def pull(name, progress):
        progress("downloading x", 0, 1)
        pulled.append(name)

    monkeypatch.setattr(engine.catalog, "pull", pull)

    class Loaded(tuple):
        task = "generate"  # a chat model (an embedding one is refused: the next test)

    monkeypatch.setattr(
        engine.mlxlis, "load", lambda name, dtype, **kw: Loaded(("model", name, kw))
    )
    opts = Options(model="smollm2-135m", chat_template="chatml")
    got = engine.load_model(opts, lambda *a: seen.append(a))
    assert pulled == ["smollm2-135m"] and seen[0] == ("downloading x", 0, 1)
    assert got == (
        "model",
        "smollm2-135m",
        {
            "dequantize": None,
            "chat_template": "chatml",
            "bindings": None,
            "strict": True,
            "layers_split": None,
            "tensor": None,
            "kv_bits": None,
            "kv_group_size": 64,
            "mmproj": None,
            "adapters": (),
            "adapter_scale": 1.0,
            "fuse": False,
            "task": None,
        },
    )
    engine.load_model(opts, lambda *a: seen.append(a))
    assert pulled == ["smollm2-135m"]  # not pulled twice


def test_diagnosis_panel_adds_the_ways_out_when_the_engine_text_lacks_them():
    """The no-template panel always names --no-chat and --chat-template, adding them when the
    engine's diagnosis does not (and not twice when it does)."""
    bare = str(Diagnosis("no template; probably a base model").content)
    assert "--no-chat" in bare and "--chat-template" in bare
    full = str(Diagnosis(DIAGNOSIS).content)
    assert full.count("--no-chat") == 1
