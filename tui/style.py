"""The app's stylesheet (a Python string, so it ships with the package without package-data)."""

CSS = """
/* mlxlis chat */
#model-header {
    height: auto;
    padding: 0 1;
    background: $primary-background;
    color: $text;
    text-style: bold;
}
#conversation {
    height: 1fr;
    padding: 0 1;
}
.bubble {
    height: auto;
    margin: 1 0 0 0;
}
.bubble .role {
    text-style: bold;
    color: $text-muted;
}
.bubble.user .role { color: $accent; }
.bubble.assistant .role { color: $success; }
.bubble.user .body {
    padding: 0 1;
    background: $boost;
}
.bubble .body {
    height: auto;
    margin: 0;
}
.bubble Markdown { padding: 0 1; }
.bubble .thinking {
    height: auto;
    margin: 0 0 0 1;
    padding: 0;
    border: none;
    background: transparent;
}
.bubble .thinking .reasoning-text {
    color: $text-muted;
    text-style: italic;
    padding: 0 1;
}
.marker {
    color: $warning;
    text-style: italic;
}
.marker.length { color: $text-muted; }
.note {
    height: auto;
    margin: 1 0 0 0;
    border-left: thick $secondary;
    padding: 0 1;
}
.diagnosis {
    height: auto;
    margin: 1 0;
    padding: 1 2;
    border: heavy $error;
}
#loading {
    height: auto;
    padding: 1 2;
}
#input {
    height: auto;
    min-height: 3;
    max-height: 10;
    border: tall $accent;
}
#status {
    height: 1;
    padding: 0 1;
    background: $panel;
    color: $text-muted;
}
"""
