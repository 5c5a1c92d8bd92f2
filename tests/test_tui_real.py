"""The chat app end to end with real catalog models (skipped when a model is not pulled).

Unlike tests/test_tui.py these go through the real engine: the app's own load worker
(mlxlis.load), mlxlis.ChatSession with its KV cache, the model's own chat template. They prove
the app works on real models; they do not check the text is right (see the parity tests).
"""

from __future__ import annotations

import asyncio
import json

from mlxlis.generation.sampling import SamplingParams
from mlxlis.loading import catalog

import pytest
from test_tui import SIZE, bubbles, record_notes, reply_text, wait_for

from tui.app import ChatApp
from tui.engine import Options
from tui.screens import PreviewScreen
from tui.widgets import Diagnosis

pytestmark = pytest.mark.real


def pulled(name: str):
    return pytest.mark.skipif(
        not catalog.is_pulled(name), reason=f"{name} not pulled (mlxlis pull {name})"
    )


def real_app(tmp_path, model: str, **sampling) -> ChatApp:
    opts = Options(model=model, sampling=SamplingParams(temperature=0.0, **sampling))
    return record_notes(ChatApp(opts, data_dir=tmp_path / "conversations"))


def errors(app: ChatApp) -> list[str]:
    return [m for sev, m in app.notes if sev == "error"]


async def wait_done(pilot, app: ChatApp, n_turns: int, timeout: float, what: str) -> None:
    """Wait until the session holds `n_turns` turns and nothing streams; fail fast on an error."""
    await wait_for(
        pilot,
        lambda: (len(app.engine.turns) == n_turns and not app.generating) or errors(app),
        timeout=timeout,
        what=what,
    )
    assert not errors(app), errors(app)
    await pilot.pause()


def run(app: ChatApp, scenario) -> None:
    async def main():
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(
                pilot, lambda: app.engine is not None or app.notes, timeout=120, what="model load"
            )
            assert app.engine is not None, app.notes
            await scenario(pilot)

    asyncio.run(main())


@pulled("smollm2-135m")
def test_smollm2_chat_reply_status_and_stop(tmp_path):
    """SmolLM2 (ChatML template from the GGUF): greedy 8-token reply appears and the status
    line shows tok/s; the preview shows the ChatML prompt; Esc stops a long reply, keeping it
    marked stopped, and the real ChatSession (KV cache) takes a next turn."""
    app = real_app(tmp_path, "smollm2-135m", max_tokens=8)

    async def scenario(pilot):
        assert "template: gguf" in str(app.query_one("#model-header").render())
        app.prompt_input.insert("What is the capital of France?")
        await pilot.press("enter")
        await wait_done(pilot, app, 2, 60, "first reply")
        assert reply_text(app).strip(), "empty reply"
        status = str(app.query_one("#status").render())
        assert "tok/s" in status and " 0.0 tok/s" not in status, status
        used, limit = app.engine.context
        assert 0 < used < limit and f"ctx {used}/{limit}" in status
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, PreviewScreen))
        assert "<|im_start|>assistant" in app.screen.query_one("#preview-text").text
        await pilot.press("escape")
        # a long reply, stopped with Esc after the first streamed text
        app.engine.sampling = app.engine.sampling.replace(max_tokens=200)
        app.prompt_input.insert("Write a long poem about the sea.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app._reply_text or errors(app), timeout=60, what="streaming")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating, timeout=30, what="stop")
        assert app.engine.turns[-1].stopped and bubbles(app, "assistant")[-1].stopped
        app.engine.sampling = app.engine.sampling.replace(max_tokens=4)
        app.prompt_input.insert("Thanks!")
        await pilot.press("enter")
        await wait_done(pilot, app, 6, 60, "turn after stop")
        assert not app.engine.turns[-1].stopped
        assert not errors(app), app.notes

    run(app, scenario)


@pulled("gemma3-270m")
def test_gemma3_base_model_shows_diagnosis_and_does_not_send(tmp_path):
    """Gemma 3 270M is a base model with no chat template: in chat mode the app shows the
    diagnosis with the --no-chat way out and refuses to send (the text stays)."""
    app = real_app(tmp_path, "gemma3-270m", max_tokens=4)

    async def scenario(pilot):
        await pilot.pause()
        panel = str(app.query_one(Diagnosis).render())
        assert "--no-chat" in panel and "--chat-template" in panel
        app.prompt_input.insert("Hello")
        await pilot.press("enter")
        await pilot.pause()
        assert app.engine.turns == [] and bubbles(app) == []
        assert app.prompt_input.text == "Hello"

    run(app, scenario)


@pytest.mark.extended  # `make test-all` (9 s): the pad's raw path is tiny-tested
@pulled("gemma3-270m")
def test_gemma3_no_chat_pad_completes_raw_text(tmp_path):
    """--no-chat on the Gemma 3 base model: the header says raw completion and the typed text
    is continued (fed as is through mlxlis.generate)."""
    app = real_app(tmp_path, "gemma3-270m", max_tokens=4)
    app.options.no_chat = True

    async def scenario(pilot):
        assert "RAW COMPLETION" in str(app.query_one("#model-header").render())
        app.prompt_input.insert("The capital of France is")
        await pilot.press("enter")
        await wait_done(pilot, app, 2, 60, "completion")
        assert reply_text(app).strip() and not app.query(Diagnosis)

    run(app, scenario)


@pulled("smollm2-135m")
@pulled("qwen2.5-coder-0.5b")
def test_model_switches_to_a_new_conversation_on_another_model(tmp_path):
    """/model lists the models on the disk; Tab completes a name after "/model "; /model NAME
    starts a new conversation on that model (loaded by the app's own worker: its header, its
    template) and the reply comes from it; each conversation is saved under its own model."""
    app = real_app(tmp_path, "smollm2-135m", max_tokens=4)

    async def scenario(pilot):
        app.prompt_input.insert("Hi")
        await pilot.press("enter")
        await wait_done(pilot, app, 2, 60, "first reply")
        app.prompt_input.insert("/model qwen2.5-coder-0")
        await pilot.press("tab")
        assert app.prompt_input.text == "/model qwen2.5-coder-0.5b"
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: app.engine is not None or errors(app),
            timeout=120,
            what="second model load",
        )
        assert not errors(app), errors(app)
        assert app.engine.model.config.family == "qwen2" and not app.engine.turns
        assert "Qwen2.5-Coder-0.5B" in str(app.query_one("#model-header").render())
        app.prompt_input.insert("Hi")
        await pilot.press("enter")
        await wait_done(pilot, app, 2, 60, "reply from the second model")
        saved = sorted((tmp_path / "conversations").glob("*.json"))
        models = [json.loads(p.read_text())["model"] for p in saved]
        assert models == [
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        ]

    run(app, scenario)
