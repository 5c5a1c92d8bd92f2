"""The GPU run (issue 60): MLX's CUDA backend as the stand-in for Metal, in one prepared process.

usage: python scripts/gpu_check.py [--dry-run] [--device gpu|cpu] [--out DIR] [--tiny DIR]
                                   [--models REF,REF] [--budget-s S]

For each catalog GGUF given (`--models`: paths or catalog names) and each tiny checkpoint of a
family (`--tiny`: the folders scripts/fingerprint.py builds, one per family), in float16 and
bfloat16 on `--device` against the CPU float32 reference of the same weights:
- logits along one fixed trajectory: top-1 agreement (share of positions whose argmax is the
  reference's) and max |Δlogit| (against the reference's own max |logit|), all finite;
- catalog models: 128 greedy tokens, the length of the prefix equal to the reference's;
  prefill and decode tok/s at batch 1 and 8, against mlx-lm 0.32 on the same weights (mlxlis
  convert --dequantize, safetensors in the same dtype); the decode figure as bytes read per
  token × tok/s against the H100's 3.35 TB/s; the server (`mlxlis serve --max-batch 8`)
  answering 8 concurrent clients the same greedy completion;
- the device policy as it ran: the device and dtype chosen, MLX's device info, the memory
  budget, the backend (MLX's own operations off the CPU) and whether a CPU-only kernel loaded.
Writes $OUT/gpu_check.json (rewritten after every entry, so a run cut short keeps what it
measured) and $OUT/gpu_check.md, a short table. `--dry-run`: the CPU, tiny shapes (16-token
prompts, 8 tokens, smollm2-135m only), every code path; for rehearsing before device minutes.
`--budget-s`: no new entry starts after that many seconds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)
from mlxlis.runtime import backend, device, memory, process  # noqa: E402
from mlxlis.settings import reload  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gpu_table import DTYPES, table  # noqa: E402

H100_BYTES_S = 3.35e12  # the H100 SXM's HBM3 bandwidth (an H200's is 4.8e12)
TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. "
    "Early machines were programmed by rewiring; later, stored programs let the same "
    "hardware do many things. Compilers, operating systems and networks followed. "
) * 40
NOT_DECODERS = {"gemma4_assistant": "a drafter: no tokens of its own (fingerprinted as one)"}


class Run:
    """The results so far, written out after every entry."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.t0, self.budget_s = out, time.monotonic(), budget_s
        self.data: dict = {"env": {}, "catalog": {}, "tiny": {}, "server": {}}
        out.mkdir(parents=True, exist_ok=True)

    def over(self) -> bool:
        return time.monotonic() - self.t0 > self.budget_s

    def put(self, section: str, key: str, value) -> None:
        self.data[section][key] = value
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        print(f"[{self.data['elapsed_s']:7.1f}s] {section} {key}: {short(value)}", flush=True)


def short(value) -> str:
    return json.dumps(value, default=str)[:300]


def use(dev: str) -> None:
    """Run what follows on `dev` ("cpu" or "gpu"), as MLXLIS_DEVICE would from the start."""
    os.environ["MLXLIS_DEVICE"] = dev
    reload()
    backend.reset()
    device.select_device()


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """Top-1 agreement and max |Δlogit| of `got` against the float32 reference `ref` (T, V)."""
    return {
        "top1": float((ref.argmax(-1) == got.argmax(-1)).mean()),
        "max_abs_diff": float(np.abs(ref - got).max()),
        "ref_max_abs": float(np.abs(ref).max()),
        "finite": bool(np.isfinite(got).all()),
    }


def logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model.logits(ids).astype(mx.float32))


def greedy(model, ids: list[int], n: int) -> list[int]:
    events = mlxlis.generate(model, ids, max_tokens=n, stop_ids=set())
    return [e.token for e in events if e.token is not None]


def same_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def environment(dev: str) -> dict:
    """The policy as it runs here: what MLX reports, what was chosen, the memory plan."""
    use(dev)
    chosen = device.policy(device.gpu_kind(), os.environ["MLXLIS_DEVICE"])
    info = mx.device_info(mx.gpu) if not device.on_cpu() else mx.device_info(mx.cpu)
    return {
        "mlx": mx.__version__,
        "gpu_reported": device.gpu_kind(),
        "policy": chosen.__dict__,
        "device_info": {k: v for k, v in info.items()},
        "memory_budget": memory.memory_budget(),
        "process": process.describe(),
        "backend": backend.current().name,
    }


def tiny(run: Run, folder: Path, dev: str, n: int) -> None:
    name = folder.name
    if name in NOT_DECODERS:
        return run.put("tiny", name, {"skipped": NOT_DECODERS[name]})
    entry: dict = {}
    try:
        use("cpu")
        ref_model = mlxlis.load(folder, "float32")
        vocab = ref_model.config.vocab_size
        ids = [int(i) for i in np.random.default_rng(1).integers(3, vocab, n)]
        ref = logits(ref_model, ids)
        del ref_model
        use(dev)
        for dtype in DTYPES:
            try:
                entry[dtype] = compare(ref, logits(mlxlis.load(folder, dtype), ids))
            except Exception as e:  # noqa: BLE001 — recorded, the run goes on
                entry[dtype] = {"error": f"{type(e).__name__}: {e}"[:300]}
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {e}"[:300]
    run.put("tiny", name, entry)


def rows_speed(model, ids: list[int], n: int, b: int) -> dict:
    """b sequences (the prompt, shifted a token each) prefilled, then n steps decoded together."""
    from mlxlis.generation.steps import prefill

    caches = [model.make_cache() for _ in range(b)]
    t0 = time.perf_counter()
    for i, c in enumerate(caches):
        mx.eval(prefill(model.net, ids[i : len(ids) - b + i], c))
    t1 = time.perf_counter()
    tokens = mx.array(ids[len(ids) - b :])
    if b == 1:
        step = lambda t: model.net(t[None], cache=caches[0], last_only=True)[0, -1:]  # noqa: E731
    else:
        step = lambda t: model.net.decode_batch(t, caches)  # noqa: E731
    mx.eval(tokens := step(tokens).argmax(-1))
    t2 = time.perf_counter()
    for _ in range(n - 1):
        mx.eval(tokens := step(tokens).argmax(-1))
    t3 = time.perf_counter()
    return {"prefill_tps": b * (len(ids) - b) / (t1 - t0), "decode_tps": b * (n - 1) / (t3 - t2)}


def best_of(runs: list[dict]) -> dict:
    """Each rate's best over the runs (the first on a GPU includes compiling its kernels)."""
    return {k: max(r[k] for r in runs) for k in runs[0]}


def bytes_per_token(net) -> int:
    """Bytes of weights read to decode one token: every parameter but an untied embedding
    table, of which one row is read (as scripts/bench_worker.py counts them)."""
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for _, v in tree_flatten(net.parameters()))
    if "lm_head" in net:  # untied: the embedding is only indexed
        emb = net.model.embed_tokens
        size = sum(v.nbytes for _, v in tree_flatten(emb.parameters()))
        total -= size - size // emb.weight.shape[0]
    return total


def mlx_lm_speed(folder: Path, ids: list[int], n: int) -> dict:
    """mlx-lm on the same weights (its safetensors copy): batch 1 through generate_step,
    batch 8 through batch_generate (its own statistics)."""
    from mlx_lm import load
    from mlx_lm.generate import batch_generate, generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = load(str(folder))
    prompt = mx.array(ids)

    def one() -> dict:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        model(prompt[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        t1 = time.perf_counter()
        steps = generate_step(prompt[-1:], model, max_tokens=n, prompt_cache=cache)
        next(steps)
        t2 = time.perf_counter()
        count = 1 + sum(1 for _ in steps)
        t3 = time.perf_counter()
        return {"prefill_tps": (len(ids) - 1) / (t1 - t0), "decode_tps": (count - 1) / (t3 - t2)}

    def eight() -> dict:
        prompts = [ids[i : len(ids) - 8 + i] for i in range(8)]
        stats = batch_generate(model, tok, prompts, max_tokens=n).stats
        return {"prefill_tps": stats.prompt_tps, "decode_tps": stats.generation_tps}

    return {
        "b1": best_of([one(), one()]),
        "b8": best_of([eight(), eight()]),
        "bytes_per_token": bytes_per_token(model),
    }


def convert(path: Path, dtype: str, work: Path) -> Path:
    """`mlxlis convert --dequantize` of the GGUF into a safetensors folder mlx-lm reads."""
    out = work / f"{path.stem}-{dtype}"
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "mlxlis", "convert", str(path), "-o", str(out)]
        cmd += ["--dtype", dtype, "--dequantize", "--force"]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def catalog_model(run: Run, path: Path, dev: str, n_prompt: int, n_gen: int, work: Path) -> None:
    use("cpu")
    ref_model = mlxlis.load(path, "float32")
    ids = ref_model.tokenizer.encode(TEXT)[:n_prompt]
    ref, ref_tokens = logits(ref_model, ids), greedy(ref_model, ids, n_gen)
    del ref_model
    for dtype in DTYPES:
        key = f"{path.name} {dtype}"
        if run.over():
            return run.put("catalog", key, {"skipped": "over the time budget"})
        entry: dict = {}
        try:
            use(dev)
            model = mlxlis.load(path, dtype)
            entry["parity"] = compare(ref, logits(model, ids))
            tokens = greedy(model, ids, n_gen)
            entry["greedy_equal_prefix"] = [same_prefix(tokens, ref_tokens), n_gen]
            entry["mlxlis"] = {
                f"b{b}": best_of([rows_speed(model, ids, n_gen, b) for _ in range(2)])
                for b in (1, 8)
            }
            entry["bytes_per_token"] = bytes_per_token(model.net)
            # on a GPU: "MLX's own" and "mlx" (a CPU-only primitive on a GPU stream would
            # have raised above: MLX has no GPU implementation of it)
            entry["kernels"] = process.describe()["kernels"]
            entry["backend"] = backend.current().name
            del model
            entry["mlx_lm"] = mlx_lm_speed(convert(path, dtype, work), ids, n_gen)
        except Exception as e:  # noqa: BLE001 — recorded, the run goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:400]
        for engine in ("mlxlis", "mlx_lm"):
            if engine in entry:  # bytes a token over the time a token, against the bandwidth
                per = entry[engine].get("bytes_per_token", entry.get("bytes_per_token", 0))
                entry[engine]["bandwidth_share"] = (
                    per * entry[engine]["b1"]["decode_tps"] / (H100_BYTES_S)
                )
        run.put("catalog", key, entry)


def serve_8(run: Run, path: Path, dev: str, n_gen: int, log: Path) -> None:
    """`mlxlis serve` answering 8 concurrent clients the same greedy completion."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLXLIS_DEVICE": dev}
    cmd = [sys.executable, "-m", "mlxlis", "serve", "-m", f"m={path}", "--port", str(port)]
    with open(log, "wb") as f:
        proc = subprocess.Popen([*cmd, "--max-batch", "8"], stdout=f, stderr=f, env=env, cwd=ROOT)
    entry: dict = {}
    try:
        deadline = time.monotonic() + 300
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (see {log.name})")
            time.sleep(0.5)
        texts: list = [None] * 8
        body = {"model": "m", "prompt": TEXT[:400], "max_tokens": n_gen, "temperature": 0}

        def client(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "json"})
            resp = conn.getresponse()
            texts[i] = (resp.status, json.loads(resp.read()))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ok = [r for r in texts if r and r[0] == 200]
        outs = {r[1]["choices"][0]["text"] for r in ok}
        tokens = sum(r[1]["usage"]["completion_tokens"] for r in ok)
        entry = {"answered": len(ok), "identical": len(outs) == 1, "tok_s": tokens / wall}
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        proc.terminate()
        proc.wait(60)
    run.put("server", path.name, entry)


def _answers(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/v1/models")
        return conn.getresponse().status == 200
    except OSError:
        return False


def resolve(ref: str) -> Path | None:
    """A GGUF path, or a pulled catalog model's; None for anything else."""
    from mlxlis.errors import MlxlisError
    from mlxlis.loading import catalog

    if Path(ref).is_file():
        return Path(ref)
    try:
        return catalog.model_path(ref) if catalog.is_pulled(ref) else None
    except MlxlisError:  # not a catalog name
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the CPU, tiny shapes, every path")
    ap.add_argument("--device", choices=("gpu", "cpu"), default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results/gpu"))
    ap.add_argument("--tiny", default="gpu-carry/tiny", help="the tiny checkpoints' folder")
    ap.add_argument("--models", default=None, help="GGUF paths or catalog names, comma-separated")
    ap.add_argument("--budget-s", type=float, default=420)
    a = ap.parse_args()
    dev = a.device or ("cpu" if a.dry_run else "gpu")
    n_prompt, n_gen, n_tiny = (16, 8, 24) if a.dry_run else (512, 128, 96)
    default = "smollm2-135m" if a.dry_run else "smollm2-135m,gemma3-270m"
    refs = [r for r in (default if a.models is None else a.models).split(",") if r]
    run = Run(Path(a.out), a.budget_s)
    work = Path(a.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    run.data["args"] = {**vars(a), "device": dev, "n_prompt": n_prompt, "n_gen": n_gen}
    run.put("env", "policy", environment(dev))
    found = {r: resolve(r) for r in refs}
    paths = [p for p in found.values() if p is not None]
    for missing in [r for r, p in found.items() if p is None]:
        run.put("catalog", missing, {"skipped": "not here (not carried / not pulled)"})
    for path in paths[:1]:
        catalog_model(run, path, dev, n_prompt, n_gen, work)
        serve_8(run, path, dev, n_gen, Path(a.out) / "serve.log")
    for folder in sorted(p.parent for p in Path(a.tiny).glob("*/config.json")):
        if run.over():
            run.put("tiny", folder.name, {"skipped": "over the time budget"})
            continue
        tiny(run, folder, dev, n_tiny)
    for path in paths[1:]:
        if not run.over():
            catalog_model(run, path, dev, n_prompt, n_gen, work)
    (Path(a.out) / "gpu_check.md").write_text(table(run.data))
    print(table(run.data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
