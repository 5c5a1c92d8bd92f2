"""The documentation holds together: every relative Markdown link in README.md and docs/*.md
points at a file that exists and, with an #anchor, at a heading of that file (GitHub's
anchors); the README stays a front page (at most 300 lines, its two set-up commands the
Makefile's); every docs page is reachable from the README and links back to it.

Reads a score of Markdown files: well under a second."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
FILES = [README, *PAGES]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).*?\1")


def prose(text: str, spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked unless
    `spans` (a heading's anchor keeps their text)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line if spans else CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, markup and punctuation dropped
    (letters, digits, `_`, `-` and spaces kept), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "N", "M"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of `path`'s headings (a repeated one gets -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose(path.read_text(), spans=True):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link (and image) in `path`'s prose."""
    return [(n, m.group(1)) for n, line in prose(path.read_text()) for m in LINK.finditer(line)]


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, …


def broken(path: Path) -> list[str]:
    """`path:line: target: why` for each relative link of `path` that leads nowhere."""
    out = []
    for n, target in links(path):
        if not relative(target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.name}:{n}: {target}"
        if not dest.exists():
            out.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where}: no heading with that anchor")
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken(path) == []


def test_the_checker_reads_markdown_as_github_does(tmp_path):
    """Self-check of the readers above: anchors (code kept, punctuation dropped, repeats
    numbered), links outside code only, and what counts as broken."""
    (tmp_path / "other.md").write_text("# Other\n")
    page = tmp_path / "p.md"
    page.write_text(
        "# Title\n\n## Agents' APIs: `serve`, Ollama\n\n## A\n\n## A\n\n"
        "[ok](#agents-apis-serve-ollama) [dup](#a-1) `[not](a-link.md)`\n"
        "```\n[not](either.md)\n# not a heading\n```\n"
        "![image](pic.png) [web](https://example.com) [o](other.md#other) [x](other.md#nope)\n"
    )
    assert anchors(page) == {"title", "agents-apis-serve-ollama", "a", "a-1"}
    assert [t for _, t in links(page)] == [
        "#agents-apis-serve-ollama",
        "#a-1",
        "pic.png",
        "https://example.com",
        "other.md#other",
        "other.md#nope",
    ]
    assert broken(page) == [
        "p.md:14: pic.png: no such file",
        "p.md:14: other.md#nope: no heading with that anchor",
    ]


def test_the_readme_is_a_front_page():
    """At most 300 lines; the two set-up commands are the Makefile's targets."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    makefile = (ROOT / "Makefile").read_text()
    for target in ("chat", "test"):
        assert re.search(rf"^make {target} +# ", text, re.M), target
        assert re.search(rf"^{target}:", makefile, re.M), target


def test_every_page_is_linked_from_the_readme_and_back():
    linked = {
        (README.parent / t.partition("#")[0]).resolve()
        for _, t in links(README)
        if relative(t) and t.partition("#")[0]
    }
    assert [p.name for p in PAGES if p.resolve() not in linked] == []
    for page in PAGES:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), page.name
        assert "(../README.md)" in lines[2], f"{page.name}: its summary line links back"
