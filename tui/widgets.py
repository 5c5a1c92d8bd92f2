"""The app's widgets: the prompt input, conversation bubbles (with a reply's reasoning block),
notes and the diagnosis panel."""

from __future__ import annotations

from collections.abc import Callable

from PIL import Image
from rich.color import Color
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, ProgressBar, Static, TextArea

from tui.commands import complete

# Textual 8 reports Shift+Enter as "shift+enter" where the terminal speaks the kitty keyboard
# protocol (kitty, WezTerm, foot, Ghostty, iTerm2 with the option on) and as "shift+\r" under
# xterm's modifyOtherKeys; other terminals send a plain Enter for it. Ctrl+J (a raw line feed)
# arrives as "ctrl+j" in every terminal.
NEWLINE_KEYS = ("shift+enter", "shift+\r", "ctrl+j", "alt+enter", "newline")


class PromptInput(TextArea):
    """Multi-line input: Enter submits, Shift+Enter / Ctrl+J insert a newline."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    # the names Tab completes after "/model " (set by the app)
    completions: Callable[[], list[str]] | None = None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "tab" and self.completions is not None:
            done = complete(self.text, self.completions())
            if done is not None:
                event.stop()
                event.prevent_default()
                self.text = done
                self.move_cursor(self.document.end)
                return
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self.replace("\n", start, end, maintain_selection_offset=False)
            return
        await super()._on_key(event)

    def restore(self, text: str) -> None:
        """Put text back (after a refused send) without losing what was typed since."""
        current = self.text
        self.text = text if not current.strip() else text + "\n" + current
        self.move_cursor(self.document.end)


class Thinking(Collapsible):
    """A reply's reasoning (its `<think>` block), apart from the answer: open under "Thinking…"
    while it streams, collapsed to "Thought for N tokens" once the answer starts."""

    def __init__(self, text: str = "", *, streaming: bool = True):
        self.text = text
        self.streaming = streaming
        super().__init__(
            Static(Text(text), classes="reasoning-text"),
            collapsed=not streaming,
            title="Thinking…" if streaming else "Thought",
            classes="thinking",
        )

    def append(self, text: str) -> None:
        self.text += text
        self.query_one(".reasoning-text", Static).update(Text(self.text))

    def finish(self, tokens: int, *, collapse: bool) -> None:
        """The reasoning ended (the answer started, or the reply stopped inside it)."""
        self.streaming = False
        self.title = f"Thought for {tokens} token{'s' if tokens != 1 else ''}"
        if collapse:
            self.collapsed = True


class Bubble(Vertical):
    """One message: a role label and the body (user text verbatim, replies as Markdown, after
    their reasoning block when the model reasoned)."""

    def __init__(
        self,
        role: str,
        text: str = "",
        *,
        raw: bool = False,
        stopped: bool = False,
        reasoning: str | None = None,
    ):
        super().__init__(classes=f"bubble {role}")
        self.role = role
        self.text = text
        self.raw = raw
        self._stopped = stopped
        self._reasoning = reasoning
        self.reasoning_tokens = 0  # as the stream last reported

    def compose(self) -> ComposeResult:
        if self.role == "user":
            yield Label("Prompt" if self.raw else "You", classes="role")
            yield Static(Text(self.text), classes="body")
        else:
            yield Label("Completion" if self.raw else "Assistant", classes="role")
            if self._reasoning is not None:
                yield Thinking(self._reasoning, streaming=False)
            yield Markdown(self.text, classes="body")
            if self._stopped:
                yield Label("■ stopped", classes="marker")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def thinking(self) -> Thinking | None:
        found = self.query(Thinking)
        return found.first() if found else None

    async def add_reasoning(self, text: str) -> None:
        """Stream reasoning text into the block above the answer (created on first use)."""
        block = self.thinking
        if block is None:
            block = Thinking()
            await self.mount(block, before=self.markdown)
        block.append(text)

    def answer_started(self) -> None:
        block = self.thinking
        if block is not None and block.streaming:
            block.finish(self.reasoning_tokens, collapse=True)

    def reply_ended(self) -> None:
        """A reply that stopped inside its reasoning keeps the block open, titled."""
        block = self.thinking
        if block is not None and block.streaming:
            block.finish(self.reasoning_tokens, collapse=False)

    def mark(self, text: str, kind: str = "stopped") -> None:
        """Add a marker under a reply: "■ stopped", "max_tokens reached", an error."""
        if kind == "stopped":
            self._stopped = True
        self.mount(Label(Text(text), classes=f"marker {kind}"))

    @property
    def stopped(self) -> bool:
        return self._stopped


class Note(Markdown):
    """Output of a command (help, params, history) shown in the conversation pane."""

    def __init__(self, text: str):
        super().__init__(text, classes="note")


class Thumbnail(Static):
    """An attached image drawn in the conversation: two pixels a cell, the upper one the
    cell's foreground colour, the lower its background ("▀"), at most `columns` wide. Rich
    maps the colours to what the terminal shows (truecolor, 256 or 16 colours). Written here
    rather than with textual-image, which learns the terminal's graphics protocols by reading
    its answers on stdin at import, before the app starts (racing the first keystrokes)."""

    def __init__(self, image: Image.Image, columns: int = 32, lines: int = 16):
        self.image = image
        super().__init__(self.cells(image, columns, lines), classes="thumbnail")

    @staticmethod
    def cells(image: Image.Image, columns: int, lines: int = 16) -> Text:
        """At most `columns` cells wide and `lines` high, the aspect ratio kept."""
        w, h = image.size
        cols = max(1, min(columns, w, round(lines * 2 * w / h)))  # a tall image: narrower
        rows = max(1, min(lines, round(h * cols / w / 2)))  # a cell is about twice as tall
        small = image.convert("RGB").resize((cols, rows * 2), Image.BILINEAR)
        px = small.load()
        text = Text()
        for r in range(rows):
            for c in range(cols):
                top, bottom = px[c, 2 * r], px[c, 2 * r + 1]
                text.append("▀", Style(color=Color.from_rgb(*top), bgcolor=Color.from_rgb(*bottom)))
            if r < rows - 1:
                text.append("\n")
        return text


class Diagnosis(Static):
    """Chat mode on a model with no template: why, and the explicit ways out."""

    def __init__(self, diagnosis: str):
        text = Text()
        text.append("No chat template — chat is disabled, nothing will be sent.\n\n", "bold")
        text.append(diagnosis.rstrip() + "\n")
        if "--no-chat" in diagnosis and "--chat-template" in diagnosis:
            super().__init__(text, classes="diagnosis")  # the engine already names the ways out
            return
        text.append("\nWays out:\n", "bold")
        text.append(
            "  mlxlis chat --no-chat -m MODEL       raw completion: your text is fed "
            "as is and continued\n"
        )
        text.append(
            "  mlxlis chat --chat-template FILE|NAME -m MODEL   use a template you "
            "choose (e.g. chatml, gemma)\n"
        )
        super().__init__(text, classes="diagnosis")


class Loading(Vertical):
    """Shown while the model is fetched and loaded."""

    def __init__(self, name: str):
        super().__init__(id="loading")
        self.model_name = name

    def compose(self) -> ComposeResult:
        yield Label(Text(f"Loading {self.model_name} …"), id="loading-stage")
        yield ProgressBar(total=None, show_eta=False, id="loading-bar")

    def progress(self, stage: str, done: int, total: int) -> None:
        label = f"{self.model_name}: {stage}" + (f" ({done}/{total})" if total else " …")
        self.query_one("#loading-stage", Label).update(Text(label))
        bar = self.query_one(ProgressBar)
        if total:
            bar.update(total=total, progress=done)
        else:
            bar.update(total=None)
