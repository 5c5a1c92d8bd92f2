"""The prefix cache's folder as untrusted input (mlxlis/cache/disk.py, sealed.py): files put
there or changed by someone without the folder's key, and a folder that cannot be written.

What is proved here, each on real files (and the last on a real `mlxlis serve`):
- an entry whose header's ids were rewritten (tensors and their old plain hash untouched, the
  header's length made consistent, as an attacker would) is not believed: the prompt those ids
  name is prefilled cold, one warning, the file deleted; so is a forged entry whose plain hash
  was recomputed and which carries a seal made without the folder's key;
- what is not a regular file of ours is never read nor deleted: a symbolic link to a genuine
  entry kept outside the folder (there at start, or swapped in after the folder was read), a
  hard link to it, a FIFO holding bytes (they are still in the pipe afterwards);
- the key is made once, mode 0600, and a key file anyone else may read is not used (one line);
- a folder that becomes unwritable while in use (an EROFS at a touch) is one line, then read
  only: entries still read back, nothing written;
- `mlxlis serve` on a folder mounted read-only (or, not as root, made read-only) answers every
  request — sharing an entry's prefix or not — reading the entry back, with one log line
  saying so, and leaves the folder as it was.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
from pathlib import Path

import mlxlis
from mlxlis.cache import sealed
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache

import mlx.core as mx
import pytest
from conftest import trajectory
from serve_process import TINY_TEMPLATE, ServeProcess


@pytest.fixture(scope="module")
def model(tiny):
    return mlxlis.load(tiny("llama_long")[0], "float32")  # the session's, as the server's


def tier(folder: Path, model, warns: list[str]) -> PrefixCache:
    return PrefixCache(
        1 << 30, disk=DiskCache(folder, 1 << 30, "fp", model.make_cache, warns.append)
    )


def filled(model, ids: list[int]) -> list:
    caches = model.make_cache()
    mx.eval(model.net(mx.array([ids]), cache=caches))
    return caches


def kept(model, folder: Path, ids: list[int]) -> Path:
    """`ids`' caches written to `folder` as its one entry (its path)."""
    tier(folder, model, []).put(ids, filled(model, ids))
    (path,) = folder.glob("*.safetensors")
    return path


def rewrite_header(path: Path, change) -> None:
    """The entry's header JSON changed by `change(meta)` in place, its tensor bytes untouched
    and the header's length field made to match (what an attacker with a hex editor does)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header["__metadata__"])
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def plain_hash(arrays: dict[str, mx.array]) -> str:
    """The format before the seal: a SHA-256 of the tensors alone (anyone can recompute it)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        h.update(memoryview(mx.contiguous(a).view(mx.uint8)))
    return h.hexdigest()


@pytest.mark.parametrize("how", ["ids rewritten", "forged"])
def test_an_entry_altered_without_the_key_is_not_believed(model, how, tmp_path):
    """An entry of prompt A (40 tokens); its header made to say it holds prompt B — only the
    ids rewritten; or re-saved with B's ids, the plain hash recomputed and a seal under some
    other key: B's next prompt is prefilled cold (A's caches would answer B wrongly), one
    warning names the file, and it is gone."""
    vocab = model.config.vocab_size
    a, b = trajectory(40, seed=1, vocab=vocab), trajectory(40, seed=2, vocab=vocab)
    path = kept(model, tmp_path, a)
    if how == "ids rewritten":
        rewrite_header(path, lambda meta: meta.update(ids=json.dumps(b)))
    else:
        arrays, meta = mx.load(str(path), return_metadata=True)
        meta |= {"ids": json.dumps(b), "sha256": plain_hash(arrays)}
        meta["mac"] = sealed.seal(os.urandom(32), meta, arrays)
        mx.save_safetensors(str(path), arrays, metadata=meta)
    warns: list[str] = []
    assert tier(tmp_path, model, warns).take(b + [5, 6], None) == (None, 0)
    assert len(warns) == 1 and path.name in warns[0] and "seal" in warns[0], warns
    assert not path.exists()


def outside_entry(model, tmp_path: Path) -> tuple[list[int], Path, Path, bytes]:
    """A genuine entry moved out of the folder: (its ids, the folder, the entry's name there,
    the bytes of the file outside)."""
    ids = trajectory(40, seed=3, vocab=model.config.vocab_size)
    folder, outside = tmp_path / "cache", tmp_path / "elsewhere.safetensors"
    folder.mkdir()
    path = kept(model, folder, ids)
    path.rename(outside)
    return ids, folder, path, outside.read_bytes()


@pytest.mark.parametrize("how", ["symlink", "symlink after the scan", "hard link"])
def test_a_link_in_the_folder_is_never_followed_nor_deleted(model, how, tmp_path):
    """A genuine entry of this folder's key moved outside, and a link to it put under its
    name — a symbolic link there when the cache starts, or swapped in for the file after the
    folder was read; or a hard link: it is not read (the prompt is prefilled cold: reading
    it would reuse 40 tokens), one warning says why, and both the link and the file outside
    are left as they were."""
    ids, folder, path, data = outside_entry(model, tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    warns: list[str] = []
    if how == "symlink after the scan":
        path.write_bytes(data)  # the genuine file, read when the cache starts
        cache = tier(folder, model, warns)
        path.unlink()
        path.symlink_to(outside)
    else:
        (path.symlink_to if how == "symlink" else path.hardlink_to)(outside)
        cache = tier(folder, model, warns)
    assert cache.take(ids + [5, 6], None) == (None, 0)
    why = "2 links" if how == "hard link" else "symbolic link"
    assert len(warns) == 1 and f"ignored {path.name}" in warns[0] and why in warns[0], warns
    assert os.path.lexists(path) and outside.read_bytes() == data


def test_a_fifo_in_the_folder_is_never_read(model, tmp_path):
    """A FIFO named as an entry, 8 bytes waiting in it (a header length): starting the cache
    neither blocks on it nor reads it — the 8 bytes are still in the pipe — nor deletes it,
    and one warning says it is not a regular file."""
    fifo = tmp_path / ("0" * 32 + ".safetensors")
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer, so that no open would block
    try:
        os.write(held, struct.pack("<Q", 1 << 40))
        warns: list[str] = []
        tier(tmp_path, model, warns)
        assert len(warns) == 1 and "not a regular file" in warns[0], warns
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert os.read(held, 16) == struct.pack("<Q", 1 << 40)
    finally:
        os.close(held)


def test_the_key_is_made_once_private_and_refused_when_not(model, tmp_path):
    """The first cache on a folder makes its key (32 bytes, mode 0600) and the next one uses
    it (an entry written by the first is read back); a key that others may read is not used:
    one warning, nothing read back, nothing written."""
    ids = trajectory(40, seed=4, vocab=model.config.vocab_size)
    kept(model, tmp_path, ids)
    key = tmp_path / sealed.KEY_NAME
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    warns: list[str] = []
    assert tier(tmp_path, model, warns).take(ids + [5], None)[1] == 40 and warns == []
    key.chmod(0o644)
    cache = tier(tmp_path, model, warns)
    assert len(warns) == 1 and "no usable key" in warns[0] and "mode 644" in warns[0], warns
    assert cache.take(ids + [5], None) == (None, 0)
    cache.put(ids[:20], filled(model, ids[:20]))
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_a_folder_that_stops_taking_writes_is_then_read_only(model, tmp_path, monkeypatch):
    """The folder remounted read-only while in use (EROFS at an entry's touch: os.utime made
    to fail so, as root writes anywhere else): the write that met it is kept, one warning
    says read-only, no later request fails, entries are still read back and nothing more is
    written."""
    vocab = model.config.vocab_size
    one, two = trajectory(40, seed=5, vocab=vocab), trajectory(40, seed=6, vocab=vocab)

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "utime", read_only)
    warns: list[str] = []
    cache = tier(tmp_path, model, warns)
    cache.put(one, filled(model, one))
    assert len(warns) == 1 and "read-only" in warns[0], warns
    assert cache.take(one + [5], None)[1] == 40  # from memory
    assert cache.take(one + [5], None)[1] == 40 and "read from disk" in cache.note
    cache.put(two, filled(model, two))
    assert len(list(tmp_path.glob("*.safetensors"))) == 1 and len(warns) == 1


MOUNT_RO = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0"'


def read_only_prefix(folder: Path) -> list[str] | None:
    """A command prefix under which `folder` cannot be written, found by trying: as root (whom
    no mode stops), a read-only bind mount of it in a mount namespace of the command's own
    (`unshare -m`, or `unshare -rm` in a user namespace too); not as root, the folder's mode
    (then [] — the caller makes it read-only). None when nothing works here."""
    if os.geteuid() != 0:
        return []
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):
        prefix = [*unshare, "sh", "-c", MOUNT_RO + ' && exec "$@"', str(folder)]
        try:
            r = subprocess.run(
                [*prefix, "sh", "-c", '! touch "$0/.t" 2>/dev/null && ls "$0"', str(folder)],
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and not (folder / ".t").exists():
            return prefix
    return None


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_serve_on_a_read_only_folder_answers_everything(tiny, tmp_path, monkeypatch):
    """A server fills the folder (one conversation's first turn); a second server, started
    on it read-only (a read-only bind mount as root, the folder's mode otherwise), answers a
    prompt sharing only the template's first tokens, raw text sharing next to nothing, and the
    conversation's second turn — the entry read back from disk each time — all 200; its log
    says read-only exactly once, and the folder is left as it was (nothing written, touched
    or deleted)."""
    folder = tmp_path / "cache"
    folder.mkdir()
    prefix = read_only_prefix(folder)
    if prefix is None:
        pytest.skip(
            "no way here to make a folder read-only for a root process (unshare -m and -rm fail)"
        )
    (tmp_path / "llama_long").symlink_to(tiny("llama_long")[0])
    (tmp_path / "t.jinja").write_text(TINY_TEMPLATE)
    args = ("-m", str(tmp_path / "llama_long"), "--chat-template", str(tmp_path / "t.jinja"))
    args += ("--prefix-cache-dir", str(folder), "--verbose")
    one = [{"role": "user", "content": "The first question, long enough to be worth keeping."}]
    kw = dict(model="llama_long", max_tokens=4, temperature=0)
    srv = ServeProcess(tmp_path, *args)
    try:
        reply = srv.client().chat.completions.create(messages=one, **kw)
    finally:
        assert srv.stop() == 0, srv.log()
    before = listing(folder)
    assert len([n for n in before if n.endswith(".safetensors")]) == 1
    said = {"role": "assistant", "content": reply.choices[0].message.content}
    two = [*one, said, {"role": "user", "content": "And?"}]
    if prefix:
        real = subprocess.Popen
        monkeypatch.setattr(subprocess, "Popen", lambda cmd, **k: real([*prefix, *cmd], **k))
    else:
        folder.chmod(0o555)
    try:
        srv = ServeProcess(tmp_path, *args)
        monkeypatch.undo()
        try:
            c = srv.client()
            other = c.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
            raw = c.completions.create(prompt="zebra", **kw)
            got = c.chat.completions.create(messages=two, **kw)
        finally:
            assert srv.stop() == 0, srv.log()
    finally:
        folder.chmod(0o755)
    log = srv.log()
    assert other.choices[0].message.content is not None and raw.choices[0].text is not None
    assert got.usage.prompt_tokens_details.cached_tokens > 0
    assert len([x for x in log.splitlines() if "read-only" in x]) == 1, log
    assert "read from disk" in log and "Traceback" not in log, log
    assert listing(folder) == before
