"""The chat app with a reasoning model, driven by Textual's Pilot.

The model is the scripted tiny Qwen3-template model of tests/test_thinking.py (every reply is
"<think>The quick brown fox</think>\\n\\nHello, world!"), loaded by the app's own load worker
and run by the real mlxlis.ChatSession. These prove the app's handling of reasoning: a
collapsible block apart from the answer, open while it streams and collapsed once the answer
starts; `/think` switching the template's enable_thinking for the next prompt; the reasoning
kept in the saved record and shown again when a conversation is reopened.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import mlxlis
from mlxlis.generation.sampling import SamplingParams

import pytest
from test_thinking import ANSWER_TEXT, REASONING_TEXT, build_thinker, official, user
from test_tui import SIZE, bubbles, record_notes, reply_text, wait_for

from tui.app import FLUSH_SECONDS, ChatApp
from tui.engine import Options, parse_args
from tui.screens import PreviewScreen
from tui.widgets import Note, Thinking


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    return build_thinker(tmp_path_factory.mktemp("thinker-tui"))


class HeldSession(mlxlis.ChatSession):
    """The real ChatSession, its stream held after the second reasoning piece until the test
    releases it. Before that piece a flush period passes, so the app has received the
    reasoning streamed so far when the stream stops (the app flushes on the next event once
    FLUSH_SECONDS have passed)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.held, self.release = threading.Event(), threading.Event()
        self.pieces = 0

    def send(self, text, should_stop=None, **sampling):
        for ev in super().send(text, should_stop, **sampling):
            yield ev
            if ev.reasoning and not self.release.is_set():
                self.pieces += 1
                if self.pieces == 1:
                    time.sleep(FLUSH_SECONDS * 1.5)
                elif self.pieces == 2:
                    self.held.set()
                    self.release.wait(10)


def thinking_app(tmp_path, thinker, thinking: bool | None = None, **kw) -> ChatApp:
    opts = Options(
        model=str(thinker.folder), sampling=SamplingParams(max_tokens=32), thinking=thinking
    )
    return record_notes(ChatApp(opts, data_dir=tmp_path / "data", **kw))


def run(app: ChatApp, scenario) -> None:
    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(
                pilot, lambda: app.engine is not None or app.notes, timeout=60, what="model load"
            )
            assert app.engine is not None, app.notes
            await scenario(pilot)

    asyncio.run(main())


async def send(pilot, app: ChatApp, text: str) -> None:
    before = len(app.engine.turns)
    app.prompt_input.insert(text)
    await pilot.press("enter")
    await wait_for(
        pilot,
        lambda: len(app.engine.turns) == before + 2 and not app.generating,
        timeout=30,
        what=f"reply to {text!r}",
    )
    await pilot.pause()


async def command(pilot, app: ChatApp, text: str) -> None:
    app.prompt_input.clear()
    app.prompt_input.insert(text)
    await pilot.press("enter")
    await pilot.pause()


def held_app(tmp_path, thinker):
    """The app whose sessions hold their reply partway (HeldSession); (app, its sessions)."""
    sessions: list[HeldSession] = []

    def factory(model, system):
        sessions.append(HeldSession(model, system=system))
        return sessions[-1]

    return thinking_app(tmp_path, thinker, session_factory=factory), sessions


async def send_until_reasoning(pilot, app, session) -> None:
    """Send "Hi" and wait until the held reply has streamed "The quick" into its block."""
    app.prompt_input.insert("Hi")
    await pilot.press("enter")
    await wait_for(
        pilot,
        lambda: (
            session.held.is_set()
            and app.query(Thinking)
            and app.query_one(Thinking).text == "The quick"
        ),
        what="reasoning streamed",
    )


def test_reasoning_streams_in_a_block_that_collapses_when_the_answer_starts(tmp_path, thinker):
    """While the reasoning streams it shows, open, in a Thinking block titled "Thinking…" and
    the answer is empty; once the answer starts the block is collapsed, titled with the
    reasoning's token count, and the answer widget holds the answer alone."""
    app, sessions = held_app(tmp_path, thinker)

    async def scenario(pilot):
        session = sessions[0]
        try:
            await send_until_reasoning(pilot, app, session)
            reply, block = bubbles(app, "assistant")[-1], app.query_one(Thinking)
            assert reply.thinking is block
            assert not block.collapsed and block.title == "Thinking…"
            assert reply.markdown.source == "" and app.generating
        finally:
            session.release.set()
        await wait_for(pilot, lambda: not app.generating, timeout=30, what="reply")
        await pilot.pause()
        assert block.collapsed and block.title == "Thought for 4 tokens"
        assert block.text == REASONING_TEXT
        assert reply_text(app) == ANSWER_TEXT and "quick" not in reply_text(app)
        assert session.turns[-1].reasoning == REASONING_TEXT
        assert "think default" in str(app.query_one("#status").render())

    run(app, scenario)


def test_escape_inside_the_reasoning_stops_and_keeps_it_open(tmp_path, thinker):
    """Esc while the model reasons stops the reply at the next token: the block stays open,
    titled with the tokens spent, the answer is empty and the turn (marked stopped) keeps the
    partial reasoning; the next message gets a full reply."""
    app, sessions = held_app(tmp_path, thinker)

    async def scenario(pilot):
        session = sessions[0]
        try:
            await send_until_reasoning(pilot, app, session)
            await pilot.press("escape")
        finally:
            session.release.set()
        await wait_for(pilot, lambda: not app.generating, timeout=30, what="stop")
        await pilot.pause()
        reply, block = bubbles(app, "assistant")[-1], app.query_one(Thinking)
        assert not block.collapsed and block.title == "Thought for 2 tokens"
        assert reply.stopped and reply_text(app) == ""
        turn = session.turns[-1]
        assert turn.stopped and (turn.content, turn.reasoning) == ("", "The quick")
        await send(pilot, app, "Again")
        assert reply_text(app) == ANSWER_TEXT and not session.turns[-1].stopped

    run(app, scenario)


def test_think_command_switches_the_next_prompt(tmp_path, thinker):
    """`mlxlis chat --think` starts with thinking on. /think off: the status and /params say
    so, and the next prompt (F2 preview) is the official template with enable_thinking=false,
    so the reply has no reasoning block; a bad argument is refused with the usage and the text
    kept. The first reply's reasoning is saved and comes back, collapsed, with /open; /save
    writes it as a quote above the answer."""
    assert parse_args(["--think"]).thinking is True and parse_args([]).thinking is None
    app = thinking_app(tmp_path, thinker, thinking=parse_args(["--think"]).thinking)

    async def scenario(pilot):
        assert app.engine.thinking is True
        assert "think on" in str(app.query_one("#status").render())
        await send(pilot, app, "Hi")
        assert bubbles(app, "assistant")[-1].thinking is not None
        await command(pilot, app, "/think maybe")
        assert app.prompt_input.text == "/think maybe"
        assert any(
            "/think takes on, off or default, not 'maybe'" in m
            for sev, m in app.notes
            if sev == "error"
        )
        await command(pilot, app, "/think off")
        assert app.engine.thinking is False and app.prompt_input.text == ""
        assert "think off" in str(app.query_one("#status").render())
        await command(pilot, app, "/params")
        assert "**Thinking:** off" in app.query(Note).last().source
        app.prompt_input.insert("Next")
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PreviewScreen), what="preview")
        shown = app.screen.query_one("#preview-text").text
        history = [
            user("Hi"),
            {"role": "assistant", "content": f"<think>{REASONING_TEXT}</think>\n\n{ANSWER_TEXT}"},
        ]
        assert shown == official(thinker.template, [*history, user("Next")], enable_thinking=False)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, PreviewScreen))
        app.prompt_input.clear()
        await send(pilot, app, "Next")
        assert bubbles(app, "assistant")[-1].thinking is None
        assert reply_text(app) == ANSWER_TEXT
        # the saved record keeps the first reply's reasoning; /open shows it again, collapsed
        (saved,) = (tmp_path / "data").glob("*.json")
        turns = json.loads(saved.read_text())["turns"]
        assert [t.get("reasoning") for t in turns] == [None, REASONING_TEXT, None, None]
        md = tmp_path / "chat.md"
        await command(pilot, app, f"/save {md}")
        await wait_for(pilot, md.exists, what="saved Markdown")
        assert f"## Assistant\n\n> *Thinking:*\n>\n> {REASONING_TEXT}\n\n{ANSWER_TEXT}" in (
            md.read_text()
        )
        await command(pilot, app, "/clear")
        await command(pilot, app, "/open 1")
        await wait_for(pilot, lambda: len(bubbles(app)) == 4, what="reopened")
        (block,) = app.query(Thinking)
        assert block.collapsed and block.text == REASONING_TEXT
        assert app.engine.turns[1].reasoning == REASONING_TEXT

    run(app, scenario)


def test_think_command_on_a_template_without_the_switch(tmp_path, thinker):
    """A template without enable_thinking (ChatML): /think says so, nothing changes, and the
    status line does not mention thinking."""
    opts = Options(
        model=str(thinker.folder), chat_template="chatml", sampling=SamplingParams(max_tokens=32)
    )
    app = record_notes(ChatApp(opts, data_dir=tmp_path / "data"))

    async def scenario(pilot):
        await command(pilot, app, "/think on")
        assert app.prompt_input.text == "/think on"
        assert any("no thinking switch" in m for _, m in app.notes)
        assert app.engine.thinking is None
        assert "think" not in str(app.query_one("#status").render())

    run(app, scenario)
