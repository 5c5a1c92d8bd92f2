"""Models by Hugging Face name, end to end, with no network: `mlxlis` runs as a process whose
HF_ENDPOINT is a stand-in Hub on 127.0.0.1 (tests/hub_server.py) and whose HF_HOME is a fresh
folder, so huggingface_hub reads both at import, as it does for a user.

A model opened by name is shown to be the right one by its logits: equal, exactly, to those of
the same files opened by path in this process (same files, same code: any other file, quant or
revision gives other logits).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlxlis

import gguf
import numpy as np
import pytest
from conftest import CTRL_C_CHILD, trajectory
from hub_server import HubServer, git_blob_id
from test_conventions import write_llama_gguf
from test_hub_split import requantize, split_gguf

IDS = trajectory(24)
LOGITS = """
import json, sys
import numpy as np
import mlxlis
refs, ids = json.loads(sys.argv[1]), json.loads(sys.argv[2])
models = [mlxlis.load(r, "float32") for r in refs]
np.savez(sys.argv[3], *[np.array(m.logits(ids)) for m in models])
print(json.dumps([m.name for m in models]))
"""


# --- the files the stand-in Hub serves ---------------------------------------------------------


def shard(src: Path, dst: Path) -> None:
    """The tiny checkpoint as two shards + model.safetensors.index.json (as transformers
    shards a big one)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    wmap = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / fname, metadata={"format": "pt"})
        wmap.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory) -> dict[str, Path]:
    from mlx_lm import convert

    folder, ref = tiny("llama")
    root = tmp_path_factory.mktemp("hubfiles")
    shard(folder, root / "sharded")
    classic = root / "classic"  # mlx-lm reads only the classic rope_theta key
    shutil.copytree(folder, classic)
    cfg = json.loads((classic / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (classic / "config.json").write_text(json.dumps(cfg))
    convert(
        str(classic), str(root / "mlx4"), quantize=True, q_group_size=32, q_bits=4, dtype="float32"
    )
    write_llama_gguf(root / "tiny-llama-F32.gguf", ref, folder)
    for q in ("Q8_0", "Q4_0"):
        requantize(
            root / "tiny-llama-F32.gguf",
            root / f"tiny-llama-{q}.gguf",
            gguf.GGMLQuantizationType[q],
        )
    (root / "split").mkdir()
    split_gguf(root / "tiny-llama-Q8_0.gguf", root / "split" / "tiny-llama-Q8_0", per_part=12)
    return {
        "folder": folder,
        "sharded": root / "sharded",
        "mlx4": root / "mlx4",
        "F32": root / "tiny-llama-F32.gguf",
        "Q8_0": root / "tiny-llama-Q8_0.gguf",
        "Q4_0": root / "tiny-llama-Q4_0.gguf",
        "split": root / "split",
    }


@pytest.fixture(scope="module")
def expected(files) -> dict[str, np.ndarray]:
    """Logits of each set of files opened by path, here."""
    return {
        k: np.array(mlxlis.load(files[k], "float32").logits(IDS))
        for k in ("folder", "sharded", "mlx4", "F32", "Q8_0", "Q4_0")
    }


@pytest.fixture
def hub():
    server = HubServer()
    yield server
    server.close()


def gguf_repo(hub: HubServer, files, repo: str = "org/tiny-GGUF", **kw) -> str:
    return hub.add(
        repo,
        {
            "README.md": b"# tiny",
            "mmproj-tiny-f16.gguf": b"\0" * 64,
            **{f"tiny-llama-{q}.gguf": files[q] for q in ("F32", "Q8_0", "Q4_0")},
        },
        **kw,
    )


# --- running mlxlis as the user does -------------------------------------------------------------


def environ(hub: HubServer | None, home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"
    }
    env.update(
        HF_HOME=str(home / "hf"),
        MLXLIS_DEVICE="cpu",
        HF_ENDPOINT=hub.endpoint if hub else "http://127.0.0.1:9",  # port 9: refused
        MLXLIS_LMSTUDIO_MODELS=str(home / "lmstudio"),
        LLAMA_CACHE=str(home / "llama.cpp"),
        **extra,
    )
    return env


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxlis", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """Exit 2 and one error line on stderr (after the progress lines of what was fetched)."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("mlxlis: error: "), r.stderr
    assert all(line.startswith("mlxlis: download") for line in lines[:-1]), r.stderr
    return lines[-1]


def logits_by_name(env: dict, refs: list[str], tmp: Path) -> tuple[list[np.ndarray], list[str]]:
    out = tmp / f"logits-{time.monotonic_ns()}.npz"
    r = subprocess.run(
        [sys.executable, "-c", LOGITS, json.dumps(refs), json.dumps(IDS), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        return [z[f"arr_{i}"] for i in range(len(refs))], json.loads(r.stdout)


def cache(home: Path, repo: str) -> Path:
    return home / "hf" / "hub" / ("models--" + repo.replace("/", "--"))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolved(hub: HubServer) -> set[str]:
    """The repo files whose bytes were sent (git files by the Hub, LFS ones by the CDN)."""
    shas = set(hub.fetched())
    out = {
        r.path.split("/resolve/", 1)[1].split("/", 1)[1]
        for r in hub.requests("hub", "GET")
        if "/resolve/" in r.path
    }
    for repo in hub.repos.values():
        for commit in repo.commits.values():
            out |= {p for p, b in commit.items() if hashlib.sha256(b).hexdigest() in shas}
    return out


# --- the tests ---------------------------------------------------------------------------------


def test_safetensors_and_mlx_repos_download_then_open_by_name(hub, files, expected, tmp_path):
    """`mlxlis pull` of a sharded safetensors repo and of an MLX 4-bit repo fetches exactly the
    index, its shards and the config / tokenizer / generation files (no pickle, README, image,
    ONNX, subfolder or consolidated.safetensors), shows each file's progress, and lays them out
    as huggingface_hub's cache (scan_cache_dir reads it); opened by name afterwards they give
    the logits of the same files opened by path, with only the listing call made."""
    from huggingface_hub import scan_cache_dir

    junk = {
        "pytorch_model.bin": b"\x80" * 99,
        "README.md": b"# m",
        "figure.png": b"png",
        "onnx/model.onnx": b"onnx",
        "original/model.safetensors": b"st",
        "consolidated.safetensors": b"a copy the index does not list",
    }
    hub.add_folder("org/tiny-llama", files["sharded"], junk)
    hub.add_folder("mlx-community/tiny-llama-4bit", files["mlx4"], {"README.md": b"# 4bit"})
    env = environ(hub, tmp_path)
    r = cli(env, "pull", "org/tiny-llama", "mlx-community/tiny-llama-4bit")
    assert r.returncode == 0, r.stderr
    assert "downloaded model-00002-of-00002.safetensors: " in r.stderr and " MB/s)" in r.stderr
    snapshot = Path(r.stdout.split("org/tiny-llama: ", 1)[1].splitlines()[0])
    assert snapshot.parent.parent == cache(tmp_path, "org/tiny-llama")
    wanted = {p.name for folder in ("sharded", "mlx4") for p in files[folder].iterdir()}
    assert "README.md" in wanted  # mlx_lm.convert writes one: the repo's, not fetched
    assert resolved(hub) == wanted - {"README.md"}  # nothing else was sent
    assert {p.name for p in snapshot.iterdir()} == {p.name for p in files["sharded"].iterdir()}
    info = scan_cache_dir(tmp_path / "hf" / "hub")
    assert {r.repo_id for r in info.repos} == {"org/tiny-llama", "mlx-community/tiny-llama-4bit"}
    assert not info.warnings

    before = len(hub.log)
    (st, mlx4), names = logits_by_name(
        env, ["org/tiny-llama", "mlx-community/tiny-llama-4bit"], tmp_path
    )
    assert np.array_equal(st, expected["sharded"]) and np.array_equal(mlx4, expected["mlx4"])
    assert np.array_equal(expected["sharded"], expected["folder"])  # sharding changed nothing
    assert names == ["org/tiny-llama", "mlx-community/tiny-llama-4bit"]
    later = [q.path for q in hub.log[before:] if q.path != "/api/agent-harnesses"]
    assert sorted(later) == [
        "/api/models/mlx-community/tiny-llama-4bit/revision/main",
        "/api/models/org/tiny-llama/revision/main",
    ]


@pytest.mark.extended  # `make test-all` (6 s): repos by name are opened in make test
def test_gguf_repos_fetch_only_the_chosen_model(hub, files, expected, tmp_path):
    """In a repo of three quants, no quant is an error listing them (nothing fetched);
    `:q8_0` fetches that file (and the vision projector beside it, as llama.cpp's -hf does),
    `/FILE.gguf` that file; a split GGUF fetches its three parts and opens as one model. Each
    gives its own file's logits, exactly."""
    gguf_repo(hub, files)
    split = {f"Q8_0/{p.name}": p for p in sorted(files["split"].iterdir())}
    hub.add("org/split-GGUF", {**split, "tiny-llama-F32.gguf": files["F32"]})
    env = environ(hub, tmp_path)
    line = one_error_line(cli(env, "pull", "org/tiny-GGUF"))
    assert (
        "3 GGUF models in the repo; name one: org/tiny-GGUF:F32, org/tiny-GGUF:Q4_0, "
        "org/tiny-GGUF:Q8_0"
        in line
        and not hub.fetched()
    )

    r = cli(env, "pull", "org/tiny-GGUF:q8_0", "org/split-GGUF:Q8_0")
    assert r.returncode == 0, r.stderr
    projector = hashlib.sha256(b"\0" * 64).hexdigest()  # gguf_repo's mmproj-tiny-f16.gguf
    want = [sha(p) for p in [files["Q8_0"], *split.values()]] + [projector]
    assert sorted(hub.fetched()) == sorted(want)
    refs = ["org/tiny-GGUF:q8_0", "org/tiny-GGUF/tiny-llama-F32.gguf", "org/split-GGUF:Q8_0"]
    (q8, f32, parts), names = logits_by_name(env, refs, tmp_path)
    assert np.array_equal(q8, expected["Q8_0"]) and np.array_equal(parts, expected["Q8_0"])
    assert np.array_equal(f32, expected["F32"]) and not np.array_equal(q8, f32)
    assert names == [
        "tiny-llama-Q8_0.gguf",
        "tiny-llama-F32.gguf",
        "tiny-llama-Q8_0-00001-of-00003.gguf",
    ]
    assert sha(files["Q4_0"]) not in hub.fetched()


def test_revision_pins_and_offline_reopening(hub, files, expected, tmp_path):
    """`@TAG` and `@COMMIT` open that commit's model, no revision opens main's; each revision
    fetched is written to refs/ so that, with HF_HUB_OFFLINE=1, the same names open from the
    cache with no request to the Hub at all."""
    old = hub.add("org/pinned-GGUF", {"tiny-Q8_0.gguf": files["Q8_0"]}, refs=("v1",))
    hub.add("org/pinned-GGUF", {"tiny-F32.gguf": files["F32"]})
    refs = ["org/pinned-GGUF@v1", f"org/pinned-GGUF@{old}", "org/pinned-GGUF"]
    online, _ = logits_by_name(environ(hub, tmp_path), refs, tmp_path)
    assert [
        np.array_equal(a, expected[k]) for a, k in zip(online, ["Q8_0", "Q8_0", "F32"], strict=True)
    ] == [True] * 3
    assert (cache(tmp_path, "org/pinned-GGUF") / "refs" / "v1").read_text() == old
    before = len(hub.log)
    offline, _ = logits_by_name(environ(hub, tmp_path, HF_HUB_OFFLINE="1"), refs, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(online, offline, strict=True))
    assert len(hub.log) == before  # not one request


def hand_built_cache(home: Path, repo: str, folder: Path) -> str:
    """`folder` placed in the Hugging Face cache as huggingface_hub lays it out: blobs named by
    SHA-256 (LFS files) or git blob id, snapshot entries as relative links, refs/main."""
    storage = cache(home, repo)
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (storage / "blobs").mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    snap = storage / "snapshots" / commit
    snap.mkdir(parents=True)
    for p in folder.iterdir():
        data = p.read_bytes()
        name = hashlib.sha256(data).hexdigest() if p.suffix == ".safetensors" else git_blob_id(data)
        (storage / "blobs" / name).write_bytes(data)
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / name)
    return commit


def test_offline_cache_hit_and_miss(hub, files, expected, tmp_path):
    """A model placed in the cache layout opens by repo name with HF_HUB_OFFLINE=1 and no
    request at all, and also when the Hub cannot be reached; a model the cache lacks fails at
    once with one line saying it is not cached and how to fetch it; a GGUF quant of a
    safetensors-only snapshot is refused, not guessed."""
    hand_built_cache(tmp_path, "org/cached-llama", files["folder"])
    offline = environ(hub, tmp_path, HF_HUB_OFFLINE="1")
    (got,), names = logits_by_name(offline, ["org/cached-llama"], tmp_path)
    assert np.array_equal(got, expected["folder"]) and names == ["org/cached-llama"]
    assert not hub.log
    line = one_error_line(cli(offline, "-m", "org/absent", "--no-chat", "hi"))
    assert "org/absent: the repo is not in the Hugging Face cache" in line
    assert "HF_HUB_OFFLINE is set; fetch it with network access: mlxlis pull org/absent" in line
    line = one_error_line(cli(offline, "pull", "org/cached-llama:Q8_0"))
    assert "holds no GGUF file; open its safetensors as org/cached-llama" in line
    assert not hub.log
    unreachable = environ(None, tmp_path)
    r = cli(unreachable, "inspect", "org/cached-llama")
    assert r.returncode == 0 and "org/cached-llama" in r.stdout, r.stderr
    line = one_error_line(cli(unreachable, "pull", "org/absent"))
    assert "127.0.0.1:9 cannot be reached (ConnectError)" in line


BIG = 24 << 20  # over huggingface_hub's 10 MiB write chunk, so a partial file holds bytes
CHUNK = 10 << 20


@pytest.mark.extended  # `make test-all` (7 s): downloads themselves are proved in make test
def test_resume_after_a_dropped_connection_and_after_ctrl_c(hub, tmp_path):
    """A connection cut at 15 MiB is resumed in the same run with a Range request from the
    bytes written (10 MiB); a pull stopped by Ctrl+C exits 130 leaving no blob and no snapshot
    entry, only the hub's `.incomplete` file, and the next run resumes it with a Range
    request; both blobs end with the Hub's SHA-256."""
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, BIG, dtype=np.uint8).tobytes() for _ in range(2))
    sha_a, sha_b = (hashlib.sha256(x).hexdigest() for x in (a, b))
    hub.add("org/big-GGUF", {"big-Q8_0.gguf": a, "big-Q4_0.gguf": b})
    env = environ(hub, tmp_path)
    blobs = cache(tmp_path, "org/big-GGUF") / "blobs"

    hub.cut[sha_a] = 15 << 20
    r = cli(env, "pull", "org/big-GGUF:Q8_0")
    assert r.returncode == 0, r.stderr
    gets = [q for q in hub.requests("cdn", "GET") if q.path.endswith(sha_a)]
    assert [q.range for q in gets] == [None, f"bytes={CHUNK}-"]
    assert sha(blobs / sha_a) == sha_a

    hub.stall[sha_b] = 15 << 20
    code = CTRL_C_CHILD + "from mlxlis.commands.cli import main; raise SystemExit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "pull", "org/big-GGUF:Q4_0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    partial = blobs / f"{sha_b}.incomplete"
    deadline = time.monotonic() + 120
    while not (partial.is_file() and partial.stat().st_size >= CHUNK):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert partial.stat().st_size == CHUNK and not (blobs / sha_b).exists()
    assert not list((cache(tmp_path, "org/big-GGUF") / "snapshots").rglob("big-Q4_0.gguf"))

    del hub.stall[sha_b]
    hub.release.set()
    r = cli(env, "pull", "org/big-GGUF:Q4_0")
    assert r.returncode == 0, r.stderr
    assert hub.requests("cdn", "GET")[-1].range == f"bytes={CHUNK}-"
    assert sha(blobs / sha_b) == sha_b and not partial.exists()


def test_corrupted_download_is_deleted_and_disk_full_is_one_line(hub, files, tmp_path):
    """Bytes that do not hash to the Hub's SHA-256 fail the pull (exit 2, one line naming the
    file and both hashes) and leave no blob, partial file or snapshot entry; a clean retry
    then succeeds. Too little free space stops a download before it starts, in one line."""
    gguf_repo(hub, files, "org/bad-GGUF")
    env = environ(hub, tmp_path)
    hub.corrupt.add(sha(files["Q8_0"]))
    line = one_error_line(cli(env, "pull", "org/bad-GGUF:Q8_0"))
    assert (
        "tiny-llama-Q8_0.gguf: SHA-256 " in line
        and f"differs from the Hub's {sha(files['Q8_0'])}" in line
    )
    storage = cache(tmp_path, "org/bad-GGUF")
    assert not list((storage / "blobs").iterdir()) and not list(storage.rglob("*.gguf"))
    hub.corrupt.clear()
    assert cli(env, "pull", "org/bad-GGUF:Q8_0").returncode == 0
    assert sha(storage / "blobs" / sha(files["Q8_0"])) == sha(files["Q8_0"])

    full = (
        "import shutil, collections; U = collections.namedtuple('U', 'total used free');"
        "shutil.disk_usage = lambda p: U(10**9, 10**9, 1000)\n"  # a full disk, as the OS says
        "from mlxlis.commands.cli import main; raise SystemExit(main())"
    )
    r = subprocess.run(
        [sys.executable, "-c", full, "pull", "org/bad-GGUF:F32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_error_line(r)
    assert "tiny-llama-F32.gguf needs " in line and "1000 are free" in line


@pytest.mark.extended  # `make test-all` (8 s): three more refusals of the stand-in server
def test_gated_missing_and_weightless_repos(hub, files, tmp_path):
    """A gated repo without a token, a repo that does not exist, an unknown revision and a repo
    of pickles only: each exit 2 with one line saying so. With HF_TOKEN the gated repo downloads;
    the token goes to the Hub, never to the CDN."""
    gguf_repo(hub, files, "org/gated-GGUF", gated=True)
    hub.add("org/pickles", {"config.json": b"{}", "pytorch_model.bin": b"\x80" * 64})
    env = environ(hub, tmp_path)
    assert (
        "gated repo: accept its terms at https://huggingface.co/org/gated-GGUF"
        in one_error_line(cli(env, "pull", "org/gated-GGUF:Q8_0"))
    )
    assert "org/nothing: no such model repo on the Hugging Face Hub" in one_error_line(
        cli(env, "-m", "org/nothing", "--no-chat", "hi")
    )
    assert "org/pickles@v9: the repo has no revision v9" in one_error_line(
        cli(env, "pull", "org/pickles@v9")
    )
    assert "only pickled PyTorch files (pytorch_model.bin)" in one_error_line(
        cli(env, "pull", "org/pickles")
    )
    assert not hub.fetched()
    before = len(hub.log)
    r = cli(environ(hub, tmp_path, HF_TOKEN=hub.token), "pull", "org/gated-GGUF:Q8_0")
    assert r.returncode == 0, r.stderr
    projector = hashlib.sha256(b"\0" * 64).hexdigest()  # its mmproj comes with it
    assert sorted(hub.fetched()) == sorted([sha(files["Q8_0"]), projector])
    to_repo = [q for q in hub.log[before:] if "gated-GGUF" in q.path]
    assert to_repo and all(q.authorized for q in to_repo)
    assert not any(q.authorized for q in hub.requests("cdn"))


@pytest.mark.extended  # `make test-all` (8 s): the downloads themselves are in make test
def test_models_lists_scans_and_rm_removes(hub, files, tmp_path):
    """`mlxlis models` lists the cached safetensors repo and GGUF quant with format, quant,
    size and family; `--scan` adds LM Studio's and llama.cpp's GGUFs under names -m opens;
    `mlxlis rm` removes one quant's file, then a whole repo, and refuses files it does not own."""
    gguf_repo(hub, files)
    hub.add_folder("org/tiny-llama", files["folder"])
    env = environ(hub, tmp_path)
    assert (
        cli(env, "pull", "org/tiny-GGUF:Q8_0", "org/tiny-GGUF:F32", "org/tiny-llama").returncode
        == 0
    )
    lms = tmp_path / "lmstudio" / "pub" / "tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(files["Q4_0"], lms)
    shutil.copytree(files["split"], tmp_path / "llama.cpp")
    r = cli(env, "models", "--scan")
    assert r.returncode == 0, r.stderr
    rows = {
        line.split()[0]: line.split() for line in r.stdout.splitlines() if line.startswith("  ")
    }
    assert (
        rows["org/tiny-llama"][1:3] == ["safetensors", "float32"]
        and rows["org/tiny-llama"][-1] == "llama"
    )
    assert (
        rows["org/tiny-GGUF:Q8_0"][1:3] == ["gguf", "Q8_0"]
        and rows["org/tiny-GGUF:Q8_0"][-1] == "llama"
    )
    assert rows["lmstudio:pub/tiny-GGUF/tiny-llama-Q4_0.gguf"][1:3] == ["gguf", "Q4_0"]
    split_name = "llama.cpp:tiny-llama-Q8_0-00001-of-00003.gguf"
    assert rows[split_name][1:3] == ["gguf", "Q8_0"]
    assert "org/tiny-GGUF:Q4_0" not in rows  # never fetched
    r = cli(env, "inspect", "lmstudio:pub/tiny-GGUF/tiny-llama-Q4_0.gguf")
    assert r.returncode == 0 and "Q4_0" in r.stdout, r.stderr

    storage = cache(tmp_path, "org/tiny-GGUF")
    r = cli(env, "rm", "org/tiny-GGUF:Q8_0")
    assert r.returncode == 0 and "org/tiny-GGUF/tiny-llama-Q8_0.gguf@" in r.stdout, r.stderr
    assert not (storage / "blobs" / sha(files["Q8_0"])).exists()
    assert (storage / "blobs" / sha(files["F32"])).exists()
    assert cli(env, "rm", "org/tiny-llama").returncode == 0
    assert not cache(tmp_path, "org/tiny-llama").exists()
    listed = cli(env, "models").stdout
    assert "org/tiny-GGUF:F32" in listed and "org/tiny-GGUF:Q8_0" not in listed
    assert "org/tiny-llama" not in listed
    assert "removes only what is in the Hugging Face cache" in one_error_line(
        cli(env, "rm", split_name)
    )
    assert (tmp_path / "llama.cpp" / split_name.split(":", 1)[1]).is_file()


def test_chat_app_reports_download_progress(hub, files, tmp_path):
    """The chat app's loader fetches a Hub model through its progress callback: per file,
    'downloading FILE: … of …' while it runs and 'downloaded FILE: SIZE in …' with the byte
    counts of the file; the app shows each stage in its header while nothing is loaded."""
    gguf_repo(hub, files)
    code = (
        "import json\nfrom tui.engine import Options, load_model\nseen = []\n"
        "m = load_model(Options(model='org/tiny-GGUF:Q8_0'), lambda *a: seen.append(a))\n"
        "print(json.dumps([seen, m.name]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=environ(hub, tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    seen, name = json.loads(r.stdout)
    size = files["Q8_0"].stat().st_size
    assert name == "tiny-llama-Q8_0.gguf"
    done = {s[0].split(":")[0]: s[1:] for s in seen if s[0].startswith("downloaded ")}
    assert done == {  # the model, and the vision projector beside it (as llama.cpp's -hf)
        "downloaded tiny-llama-Q8_0.gguf": [size, size],
        "downloaded mmproj-tiny-f16.gguf": [64, 64],
    }
    assert seen[-1] == ["loading weights", 0, 0]


def test_chat_header_shows_download_progress(tmp_path):
    """While the loader reports a download, the chat app's header names the model and shows
    the stage line (file, bytes, speed, ETA) where the model details will be."""
    import asyncio
    import threading

    from tui.app import ChatApp
    from tui.engine import Options

    gate = threading.Event()
    stage = "downloading m-Q8_0.gguf: 1.0 MB of 2.0 MB, 5.0 MB/s, ETA 0s"

    def load(options, progress):
        progress(stage, 1_000_000, 2_000_000)
        gate.wait(10)
        raise RuntimeError("stopped here")

    app = ChatApp(Options(model="org/m-GGUF:Q8_0"), load=load, data_dir=tmp_path)

    async def main():
        async with app.run_test() as pilot:
            for _ in range(100):
                await pilot.pause(0.05)
                header = str(app.query_one("#model-header").render())
                if stage in header:
                    break
            assert header == f"mlxlis chat · loading org/m-GGUF:Q8_0 — {stage}"
            gate.set()
            for _ in range(100):  # the loader's error lands before the app closes
                await pilot.pause(0.05)
                if "failed to load" in str(app.query_one("#model-header").render()):
                    break

    asyncio.run(main())
