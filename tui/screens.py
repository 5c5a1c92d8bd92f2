"""Modal screens: the exact-prompt preview."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static, TextArea


class PreviewScreen(ModalScreen[None]):
    """The exact text the model receives next, special tokens and whitespace as they are."""

    BINDINGS = [Binding("escape,f2,q", "dismiss", "Close")]

    DEFAULT_CSS = """
    PreviewScreen { align: center middle; }
    PreviewScreen > Vertical { width: 90%; height: 85%; border: thick $accent; padding: 0 1;
                               background: $surface; }
    PreviewScreen #preview-title { text-style: bold; }
    PreviewScreen #preview-text { height: 1fr; }
    """

    def __init__(self, title: str, prompt: str):
        super().__init__()
        self.title_text = title
        self.prompt = prompt

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self.title_text), id="preview-title")
            yield TextArea(
                self.prompt,
                read_only=True,
                soft_wrap=True,
                id="preview-text",
                show_line_numbers=True,
            )
            yield Label("Esc / F2 to close — read-only, select to copy", id="preview-hint")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()
