"""Conversations on disk: JSON records in the user data dir, Markdown exports, atomic writes.

Records live in `$MLXLIS_DATA/conversations/` when MLXLIS_DATA is set, else in
`$XDG_DATA_HOME/mlxlis/conversations/` (default `~/.local/share/mlxlis/conversations/`).
Every file is written to a temporary name in the same folder and renamed with os.replace, so a
crash never leaves half a file behind.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path

from mlxlis.settings import settings


def data_dir() -> Path:
    """The folder holding saved conversations (not created here)."""
    if (folder := settings().data) is not None:
        return folder / "conversations"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "mlxlis" / "conversations"


def atomic_write(path: str | Path, text: str) -> Path:
    """Write `text` to `path` via a temp file in the same folder + os.replace."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def new_id() -> str:
    """A sortable, practically unique conversation id."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def save_record(record: dict, folder: Path | None = None) -> Path:
    """Write one conversation record (needs record["id"]) as JSON; returns its path."""
    folder = folder or data_dir()
    record = dict(record, updated=time.time())
    return atomic_write(
        folder / f"{record['id']}.json", json.dumps(record, ensure_ascii=False, indent=1)
    )


def list_records(folder: Path | None = None) -> list[dict]:
    """Saved conversations, most recently updated first (unreadable files are skipped)."""
    folder = folder or data_dir()
    if not folder.is_dir():
        return []
    records = []
    for p in folder.glob("*.json"):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("turns"), list):
            rec.setdefault("id", p.stem)
            records.append(rec)
    records.sort(key=lambda r: r.get("updated", 0), reverse=True)
    return records


def summary(rec: dict, width: int = 60) -> str:
    """One line describing a record: date, model, number of turns, first user message."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.get("updated", 0)))
    first = next((t.get("content", "") for t in rec["turns"] if t.get("role") == "user"), "")
    first = " ".join(first.split())
    if len(first) > width:
        first = first[: width - 1] + "…"
    mode = " (raw)" if rec.get("mode") == "raw" else ""
    return f"{when} · {rec.get('model', '?')}{mode} · {len(rec['turns'])} turns · {first}"


def to_markdown(rec: dict) -> str:
    """A conversation record as a Markdown document."""
    raw = rec.get("mode") == "raw"
    lines = [f"# mlxlis {'completion' if raw else 'chat'} — {rec.get('model', '?')}", ""]
    meta = [f"template: {rec.get('template') or 'none'}"]
    if rec.get("sampling"):
        meta.append("sampling: " + ", ".join(f"{k}={v}" for k, v in rec["sampling"].items()))
    lines += [f"*{' · '.join(meta)}*", ""]
    if rec.get("system"):
        lines += ["## System", "", rec["system"], ""]
    for t in rec["turns"]:
        if t.get("role") == "user":
            title = "Prompt" if raw else "User"
        else:
            title = "Completion" if raw else "Assistant"
        if t.get("stopped"):
            title += " (stopped)"
        lines += [f"## {title}", ""]
        if t.get("reasoning"):
            quoted = "\n".join("> " + line for line in str(t["reasoning"]).splitlines())
            lines += ["> *Thinking:*", ">", quoted, ""]
        lines += [t.get("content", ""), ""]
    return "\n".join(lines).rstrip() + "\n"
