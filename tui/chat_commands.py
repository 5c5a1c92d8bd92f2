"""The slash commands and the F1 / F2 actions, mixed into ChatApp.

A command that fails raises (CommandError, OSError, an engine error): the app shows it as a
notification and the typed text stays in the input. A command that succeeds clears the input.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlxlis.generation.sampling import parse_value
from mlxlis.runtime.mlx_thread import shared as mlx_thread

from tui.commands import (
    HELP,
    CommandError,
    describe_json_format,
    format_params,
    parse_command,
    parse_json_format,
    parse_thinking,
)
from tui.engine import attachment_line, model_names
from tui.screens import PreviewScreen
from tui.store import atomic_write, list_records, new_id, summary, to_markdown
from tui.widgets import Bubble, Note, Thumbnail

# commands that change the conversation wait until a reply is finished
MUTATING = {"system", "clear", "open", "model"}


class CommandsMixin:
    """Needs from the app: engine, generating, conversation, prompt_input, data_dir,
    record_id, show_welcome(), update_status(), notify(), push_screen()."""

    async def run_command_text(self, text: str) -> bool:
        """Run `text` if it is a /command (True), else False (a message to send)."""
        parsed = parse_command(text)
        if parsed is None:
            return False
        name, arg = parsed
        if name != "help" and self.engine is None:
            raise CommandError(f"/{name}: the model is not loaded yet")
        if name in MUTATING and self.generating:
            raise CommandError(f"/{name} waits until the reply is finished (Esc stops it)")
        await getattr(self, f"cmd_{name}")(arg)
        self.prompt_input.clear()
        return True

    async def add_note(self, markdown: str) -> None:
        await self.conversation.mount(Note(markdown))
        self.conversation.scroll_end(animate=False)

    # --- F1 / F2 ---
    async def action_help(self) -> None:
        await self.cmd_help("")

    def action_preview(self, pending: str | None = None) -> None:
        if self.engine is None:
            self.notify("the model is not loaded yet", severity="warning")
            return
        if pending is None:
            typed = self.prompt_input.text
            if typed.strip() and parse_command_safe(typed) is None:
                pending = typed[1:] if typed.startswith("//") else typed
        try:
            prompt = self.engine.preview(pending)
            n = self.engine.count_tokens(prompt) if prompt else 0
        except Exception as e:  # noqa: BLE001 — e.g. NoChatTemplateError, a template bug
            self.notify(str(e), title="no prompt to preview", severity="error", timeout=15)
            return
        if self.engine.raw:
            title = f"Raw completion: this text is fed as is ({n} tokens), no chat template"
        else:
            what = "with your typed message" if pending else "as it stands (nothing typed)"
            title = (
                f"Exact prompt the model receives next, {what} — {n} tokens\n"
                f"template: {self.engine.template_source}"
            )
        self.push_screen(PreviewScreen(title, prompt))

    # --- commands ---
    async def cmd_help(self, arg: str) -> None:
        await self.add_note(HELP)

    async def cmd_preview(self, arg: str) -> None:
        self.action_preview(arg or None)

    async def cmd_system(self, arg: str) -> None:
        if not arg:
            current = self.engine.system
            await self.add_note(
                f"**System prompt:** {current}"
                if current
                else "*No system prompt.* `/system TEXT` sets one."
            )
            return
        self.engine.set_system(None if arg == "-" else arg)
        if self.engine.raw:
            self.notify(
                "raw completion has no system role: the system prompt is only kept "
                "in the saved record",
                severity="warning",
            )
        else:
            self.notify("system prompt cleared" if arg == "-" else "system prompt set")

    async def cmd_model(self, arg: str) -> None:
        """`/model`: the models on the disk; `/model NAME`: a new conversation on NAME (the
        model in use is let go first; --draft-model's speculation and --adapter's adapters
        stay with the first: they were made for it)."""
        names = await asyncio.to_thread(model_names)
        if not arg:
            rows = "\n".join(
                f"- `{n}`" + (" (in use)" if n == self.options.model else "") for n in names
            )
            await self.add_note(
                f"**Model:** `{self.options.model}`\n\n**On the disk** (`/model NAME`; Tab "
                f"completes; any `-m` reference works too):\n\n{rows or '*none*'}"
            )
            return
        self.persist()
        self.options.model = arg
        self.options.speculative = self.options.draft_model = self.options.draft = None
        self.options.chat_template = self.options.bindings = self.options.mmproj = None
        self.options.adapters, self.options.fuse = (), False
        self.engine = None  # the old model goes once nothing else holds it
        await self.conversation.remove_children()
        self.record_id = new_id()
        await self.start_loading()

    async def cmd_clear(self, arg: str) -> None:
        self.engine.reset()
        await self.conversation.remove_children()
        self.record_id = new_id()
        await self.show_welcome()
        self.update_status()
        self.notify("new conversation")

    async def cmd_temp(self, arg: str) -> None:
        if not arg:
            raise CommandError("usage: /temp X (e.g. /temp 0.7; 0 = greedy)")
        self.engine.sampling = self.engine.sampling.replace(
            temperature=parse_value("temperature", arg)
        )
        self.update_status()
        self.notify(f"temperature = {self.engine.sampling.temperature}")

    async def cmd_params(self, arg: str) -> None:
        if arg:
            self.engine.sampling = self.engine.sampling.with_text(arg)  # refused if any is bad
            self.update_status()
        note = "**Sampling:** " + format_params(self.engine.sampling)
        if self.engine.thinking_supported:
            note += f"\n\n**Thinking:** {self.engine.thinking_label()} (`/think`)"
        await self.add_note(note)

    async def cmd_think(self, arg: str) -> None:
        if not self.engine.thinking_supported:
            what = (
                "raw completion uses no template"
                if self.engine.raw
                else "this model's chat template has no thinking switch"
            )
            raise CommandError(f"/think: {what}")
        if not arg:
            await self.add_note(
                f"**Thinking:** {self.engine.thinking_label()} — `/think on`, "
                "`/think off`, or `/think default` (the template decides)"
            )
            return
        self.engine.thinking = parse_thinking(arg)
        self.update_status()
        self.notify(f"thinking: {self.engine.thinking_label()} (from the next message)")

    async def cmd_json(self, arg: str) -> None:
        if self.engine.raw and arg:
            raise CommandError("/json: raw completion constrains nothing (use chat mode)")
        if not arg:
            what = describe_json_format(self.engine.response_format)
            await self.add_note(f"**JSON:** {what} — `/json on`, `/json off` or `/json FILE`")
            return
        self.engine.response_format = parse_json_format(arg)
        self.update_status()
        self.notify(
            f"JSON: {describe_json_format(self.engine.response_format)} (from the next message)"
        )

    async def _listed_or_dropped(self, arg: str, none: str) -> bool:
        """`/image` or `/audio` without a path (the attachments listed, or `none` said) or with
        `-` (all of them dropped): True when that was the command."""
        pending = self.engine.attachments
        if not arg:
            lines = [f"- {attachment_line(a)}" for a in pending]
            await self.add_note(
                "**Attached to your next message:**\n\n" + "\n".join(lines) if lines else none
            )
            return True
        if arg == "-":
            pending.clear()
            self.notify("attachments dropped")
            return True
        return False

    async def cmd_image(self, arg: str) -> None:
        none = "*No image attached.* `/image PATH` attaches one to your next message."
        if await self._listed_or_dropped(arg, none):
            return
        image, opened = await asyncio.to_thread(self.engine.attach, arg)  # off the UI thread
        await self.add_note(f"📎 {attachment_line(image)} — goes with your next message")
        if not self.no_color:  # the image itself, where the terminal shows colour (NO_COLOR: not)
            await self.conversation.mount(Thumbnail(opened))
            self.conversation.scroll_end(animate=False)

    async def cmd_audio(self, arg: str) -> None:
        none = "*No audio attached.* `/audio PATH` attaches a clip to your next message."
        if await self._listed_or_dropped(arg, none):
            return
        clip = await asyncio.to_thread(self.engine.attach_audio, arg)  # off the UI thread
        await self.add_note(f"🔊 {attachment_line(clip)} — goes with your next message")

    async def cmd_save(self, arg: str) -> None:
        path = Path(arg).expanduser() if arg else Path.cwd() / f"mlxlis-chat-{self.record_id}.md"
        atomic_write(path, to_markdown(self.engine.record(self.record_id)))
        save = self.engine.session.save_cache  # None: a raw pad keeps no cache
        # MLX work (the cache's arrays written) on the process's MLX thread, not the UI's
        kept = save is not None and await asyncio.wrap_future(mlx_thread().submit(save))
        self.notify(f"saved {path}" + (" and the conversation's cache (for /open)" if kept else ""))

    async def cmd_history(self, arg: str) -> None:
        records = list_records(self.data_dir)
        if not records:
            await self.add_note("*No saved conversations yet.*")
            return
        lines = [f"{i}. {summary(r)}" for i, r in enumerate(records[:30], 1)]
        await self.add_note("**Saved conversations** (`/open N`)\n\n" + "\n".join(lines))

    async def cmd_open(self, arg: str) -> None:
        records = list_records(self.data_dir)
        try:
            rec = records[int(arg) - 1]
            if int(arg) < 1:
                raise IndexError
        except (ValueError, IndexError):
            raise CommandError(f"usage: /open N with N from /history (1..{len(records)})") from None
        self.engine.restore(rec)
        self.record_id = rec["id"]
        await self.conversation.remove_children()
        await self.show_welcome()
        raw = self.engine.raw
        await self.conversation.mount_all(
            Bubble(t.role, t.content, raw=raw, stopped=t.stopped, reasoning=t.reasoning)
            for t in self.engine.turns
        )
        self.conversation.scroll_end(animate=False)
        self.update_status()
        self.notify(f"reopened: {summary(rec)}")


def parse_command_safe(text: str):
    try:
        return parse_command(text)
    except CommandError:
        return ("?", "")
