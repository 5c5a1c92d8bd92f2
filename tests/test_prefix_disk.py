"""The prefix cache on disk (mlxlis/cache/disk.py; `mlxlis serve --prefix-cache-dir`).

What is proved here:
- an entry written by one process's prefix cache is read back by a fresh one (a restart:
  nothing in memory) on every cache kind — full attention (trimmed back into the entry),
  sliding-window rings past their window, the hybrid's recurrent layers (their snapshot), a
  quantized KV cache — and the logits of the rest of the prompt equal a cold run's
  (self-consistency against the plain prefill, which the parity tests tie to transformers);
- nothing doubtful is loaded: a truncated file, a flipped byte, an entry of the format before
  the seal, an entry of another model and a write that fails (the file-size limit hit: EFBIG,
  as a full disk gives ENOSPC) each give a cold prefill, one warning line and no file left
  behind; an entry of another KV format of the same model is not taken, and stays (hostile
  files: test_prefix_disk_hostile.py);
- the folder stays within its bound, least recently used first;
- a real `mlxlis serve --prefix-cache-dir` stopped and started again answers a conversation's
  second turn from the file (cached_tokens > 0, only the new tokens prefilled) with the tokens
  and log-probabilities of a server that never saw the first turn.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlxlis
from mlxlis.cache import KVFormat
from mlxlis.cache.disk import DiskCache
from mlxlis.cache.prefix import PrefixCache
from mlxlis.cache.rewind import snapshot
from mlxlis.cache.sealed import KEY_NAME, seal

import mlx.core as mx
import pytest
from conftest import TINY, build_tiny, tiny_models, trajectory
from serve_process import TINY_TEMPLATE, ServeProcess
from test_gemma_parity import SPECS as GEMMA
from test_qwen3_5 import SPECS as QWEN35
from test_qwen3_5 import build as build_qwen35

SPECS = {
    "llama": {**TINY["llama"], "head_dim": 64},
    "gemma3": {"kind": "gemma3", "pad_token_id": 0, **GEMMA["gemma3"]},  # window 8
    "qwen3_5": QWEN35["qwen3_5"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    get = tiny_models(
        tmp_path_factory,
        SPECS,
        build=lambda folder, spec: (build_qwen35 if "qwen3_5" in spec["kind"] else build_tiny)(
            folder, spec
        ),
    )
    return lambda name: mlxlis.load(get(name)[0], "float32")


def tier(folder: Path, model, warns: list[str], fp: str = "fp", max_bytes: int = 1 << 30):
    return PrefixCache(
        1 << 30, disk=DiskCache(folder, max_bytes, fp, model.make_cache, warns.append)
    )


def first_turn(model, cache: PrefixCache, ids: list[int], at: int) -> None:
    """`ids` fed with a snapshot at `at` only (where a next turn returns), then kept."""
    caches = model.make_cache()
    mx.eval(model.net(mx.array([ids[:at]]), cache=caches))
    snapshot(caches)
    mx.eval(model.net(mx.array([ids[at:]]), cache=caches))
    cache.put(ids, caches)


def rest_logits(model, caches, ids: list[int], reused: int) -> mx.array:
    return model.net(mx.array([ids[reused:]]), cache=caches)[0, -1]


def cold_logits(model, ids: list[int]) -> mx.array:
    return model.net(mx.array([ids]), cache=model.make_cache())[0, -1]


CASES = [("llama", None), ("gemma3", None), ("qwen3_5", None), ("llama", KVFormat(8, 64))]


@pytest.mark.parametrize(("name", "fmt"), CASES, ids=lambda x: str(x))
def test_an_entry_read_back_after_a_restart(models, name, fmt, tmp_path):
    """Turn 1 (60 tokens, a snapshot at 50) written; a fresh prefix cache on the same folder
    gives turn 2 — turn 1's first 50 tokens, then new ones — the entry back at 50: the
    logits of the 30 new tokens are bit for bit those of the same entry kept in memory, and
    equal a cold prefill of the whole prompt up to the chunking's rounding (measured ≤ 1.1e-5,
    on Gemma 3's tiny random model; bound 3e-5)."""
    model = models(name)
    model.set_kv_format(fmt)
    try:
        vocab = model.config.vocab_size
        one = trajectory(60, seed=1, vocab=vocab)
        two = one[:50] + trajectory(30, seed=2, vocab=vocab)
        warns: list[str] = []
        first_turn(model, tier(tmp_path, model, warns), one, 50)
        assert len(list(tmp_path.glob("*.safetensors"))) == 1
        restarted = tier(tmp_path, model, warns)
        caches, reused = restarted.take(two, fmt)
        assert reused == 50 and "read from disk" in restarted.note
        got = rest_logits(model, caches, two, reused)
        memory = PrefixCache(1 << 30)
        first_turn(model, memory, one, 50)
        kept, n = memory.take(two, fmt)
        assert n == 50 and mx.array_equal(got, rest_logits(model, kept, two, n))
        assert float(mx.abs(got - cold_logits(model, two)).max()) < 3e-5
        assert warns == []
    finally:
        model.set_kv_format(None)


def bad(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":
        data[-3] ^= 0x40  # a byte of the last tensor
        path.write_bytes(bytes(data))
    elif how == "reshaped":  # a first layer's keys cut to 5 positions, sealed with the key
        arrays, meta = mx.load(str(path), return_metadata=True)
        arrays["L0.k.0"] = arrays["L0.k.0"][:, :, :5]
        meta["mac"] = seal((path.parent / KEY_NAME).read_bytes(), meta, arrays)
        mx.save_safetensors(str(path), arrays, metadata=meta)
    elif how == "old":  # an entry of the format before the seal
        arrays, meta = mx.load(str(path), return_metadata=True)
        mx.save_safetensors(str(path), arrays, metadata=meta | {"mlxlis": "prefix-1"})


@pytest.mark.parametrize("how", ["truncated", "flipped", "reshaped", "old", "foreign"])
def test_a_bad_entry_is_skipped_warned_and_deleted(models, how, tmp_path):
    """The entry spoilt (cut in half; one byte of a tensor flipped; a layer's keys holding
    fewer positions than its facts say, under a valid seal; marked as the format before the
    seal), or opened by another model's cache: the next prompt is prefilled cold, one warning
    names the file, and the file is gone."""
    model = models("llama")
    one = trajectory(40, vocab=model.config.vocab_size)
    warns: list[str] = []
    first_turn(model, tier(tmp_path, model, warns), one, 30)
    (path,) = tmp_path.glob("*.safetensors")
    bad(path, how)
    fp = "another model" if how == "foreign" else "fp"
    caches, reused = tier(tmp_path, model, warns, fp=fp).take(one + [5, 6], None)
    assert caches is None and reused == 0
    assert len(warns) == 1 and path.name in warns[0], warns
    assert not path.exists()


def test_an_entry_of_another_kv_format_is_not_taken_and_stays(models, tmp_path):
    """A dense entry, asked for by an 8-bit prompt (a request's own kv_bits) after a restart:
    not taken, no warning, the file kept; a dense prompt then reads it (and an 8-bit entry
    of the same ids is a file of its own)."""
    model = models("llama")
    one = trajectory(40, vocab=model.config.vocab_size)
    warns: list[str] = []
    first_turn(model, tier(tmp_path, model, warns), one, 30)
    (path,) = tmp_path.glob("*.safetensors")
    restarted = tier(tmp_path, model, warns)
    assert restarted.take(one + [5, 6], KVFormat(8, 64)) == (None, 0)
    assert warns == [] and path.exists()
    assert restarted.take(one + [5, 6], None)[1] == 40
    model.set_kv_format(KVFormat(8, 64))
    try:
        first_turn(model, restarted, one, 30)
    finally:
        model.set_kv_format(None)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and warns == []
    caches, n = tier(tmp_path, model, warns).take(one + [5, 6], KVFormat(8, 64))
    assert n == 40 and caches[0].store.fmt == KVFormat(8, 64)


def test_the_folder_keeps_within_its_bound_least_recently_used_first(models, tmp_path):
    """Three entries of ~the same size in a folder bounded to two and a half of them: the
    oldest written is gone; reading one makes it the most recent."""
    model = models("llama")
    vocab, warns = model.config.vocab_size, []
    first = [trajectory(40, seed=s, vocab=vocab) for s in (1, 2)]
    cache = tier(tmp_path, model, warns)
    for ids in first:
        first_turn(model, cache, ids, 30)
    size = max(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    cache = tier(tmp_path, model, warns, max_bytes=int(size * 2.5))
    assert cache.take(first[0] + [7], None)[1] == 40  # read: now the most recent
    first_turn(model, cache, trajectory(40, seed=3, vocab=vocab), 30)
    fresh = tier(tmp_path, model, warns, max_bytes=int(size * 2.5))
    assert fresh.take(first[1] + [7], None) == (None, 0)  # the least recently used went
    assert fresh.take(first[0] + [7], None)[1] == 40 and warns == []


def test_a_write_that_fails_leaves_no_entry(models, tmp_path):
    """The file-size limit (RLIMIT_FSIZE, what a full disk does to a write) hit while an entry
    is written: one warning line, no entry, no temporary file left (the folder's key alone);
    the process goes on."""
    model = models("llama")
    script = r"""
import resource, signal, sys
import mlxlis
from mlxlis.cache.disk import DiskCache
from mlxlis.generation.steps import prefill
import mlx.core as mx
model = mlxlis.load(sys.argv[1], "float32")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
disk = DiskCache(sys.argv[2], 1 << 30, "fp", model.make_cache, print)
caches = model.make_cache()
mx.eval(prefill(model.net, list(range(3, 60)), caches))
disk.write(list(range(3, 60)), caches)
print("went on")
"""
    r = subprocess.run(
        [sys.executable, "-c", script, str(model.path), str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    assert len(lines) == 2 and "could not write" in lines[0] and lines[1] == "went on"
    assert [p.name for p in (tmp_path / "d").rglob("*") if p.is_file()] == [KEY_NAME]


def test_serve_answers_a_second_turn_from_disk_after_a_restart(tiny, tiny_server, tmp_path):
    """`mlxlis serve --prefix-cache-dir` answers turn 1, is stopped and started again: turn 2
    (turn 1's messages, its reply and a new question) reuses turn 1's prompt from the file and
    gives the tokens and top log-probabilities of the test session's other server, which
    never saw the conversation."""
    (tmp_path / "llama_long").symlink_to(tiny("llama_long")[0])
    (tmp_path / "t.jinja").write_text(TINY_TEMPLATE)
    args = ("-m", str(tmp_path / "llama_long"), "--chat-template", str(tmp_path / "t.jinja"))
    disk = ("--prefix-cache-dir", str(tmp_path / "cache"), "--verbose")
    one = [{"role": "user", "content": "The first question, long enough to be worth keeping."}]
    kw = dict(model="llama_long", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    srv = ServeProcess(tmp_path, *args, *disk)
    try:
        reply = srv.client().chat.completions.create(messages=one, **kw)
    finally:
        assert srv.stop() == 0, srv.log()
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    said = {"role": "assistant", "content": reply.choices[0].message.content}
    two = [*one, said, {"role": "user", "content": "And now?"}]
    srv = ServeProcess(tmp_path, *args, *disk)
    try:
        got = srv.client().chat.completions.create(messages=two, **kw)
        assert "read from disk" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
    want = tiny_server.client().chat.completions.create(messages=two, **kw)
    assert got.usage.prompt_tokens_details.cached_tokens > 0
    assert got.choices[0].message.content == want.choices[0].message.content
    for a, b in zip(got.choices[0].logprobs.content, want.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4


def test_a_chat_session_saved_resumes_from_its_cache(models, tmp_path):
    """ChatSession(cache_dir=…).save_cache() after two turns; a new session of the same model
    on the folder, given the saved turns (what `mlxlis chat`'s /save then /open do), answers
    the next message reusing the saved prompt (last_reused_tokens > 0) with the tokens of a
    session that had to read the whole conversation."""
    from mlxlis import ChatSession
    from mlxlis.prompt.template import ChatTemplate

    from serve_process import TINY_TEMPLATE

    model = models("llama")
    model.template = ChatTemplate(source="test", text=TINY_TEMPLATE)
    kw = dict(max_tokens=8, temperature=0.0)

    def reply(session, text):
        return [e.token for e in session.send(text, **kw) if e.token is not None]

    first = ChatSession(model, cache_dir=tmp_path)
    for text in ("Hello there, how are you today?", "Tell me more about that."):
        reply(first, text)
    assert first.save_cache() and first.warnings == []
    resumed, cold = ChatSession(model, cache_dir=tmp_path), ChatSession(model)
    for s in (resumed, cold):
        s.turns.extend(first.turns)
    assert reply(resumed, "And then?") == reply(cold, "And then?")
    assert resumed.last_reused_tokens > 0 and cold.last_reused_tokens == 0
    assert resumed.last_prompt_tokens == cold.last_prompt_tokens


def test_of_entries_sharing_as_much_the_one_that_returns_there_is_taken(models, tmp_path):
    """Gemma 3's rings (window 8): an entry holding turn 1 and its reply's first token (a
    snapshot at turn 1's end) put after a longer one sharing turn 1 (its snapshot later): the
    next turn, sharing turn 1 with both, reuses all of it — from memory, and from disk after
    a restart — rather than prefilling cold from the longer entry it cannot rewind."""
    model = models("gemma3")
    vocab = model.config.vocab_size
    one = trajectory(60, seed=1, vocab=vocab)
    longer, reply = one + trajectory(20, seed=2, vocab=vocab), one + [7]
    nxt = one + [8, 9, 10]
    warns: list[str] = []
    cache = tier(tmp_path, model, warns)
    first_turn(model, cache, longer, 70)
    first_turn(model, cache, reply, 60)
    assert cache.take(nxt, None)[1] == 60
    assert tier(tmp_path, model, warns).take(nxt, None)[1] == 60 and warns == []
