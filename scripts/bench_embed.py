"""`make bench` (embeddings part): sentences per second embedding with the catalog's
all-MiniLM-L6-v2, against sentence-transformers (torch, as many threads as CPUs) on the same
folder and llama.cpp (llama-cpp-python) on its GGUF when `llama_cpp` is importable: the file
MINILM_GGUF names, else the folder converted to F32 by llama.cpp's own converter
(scripts/fetch_references.py fetches it) into a temporary folder for the run.

Inputs of about 32 and 256 tokens (a repeated sentence, cut to the length), at batch 1 and 32;
each engine in its own process (so one's threads never wait on the other's), a warm-up call,
then the best of `--rounds` timed calls. Prints a Markdown table and the ratios; writes
bench-results/embed.json.

usage: python scripts/bench_embed.py [--rounds 5] [--mlxlis-path DIR]
  --mlxlis-path: import mlxlis from DIR instead of this checkout (to time another version)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the quick brown fox jumps over a lazy dog by the river bank at noon".split()
CASES = [(32, 1), (32, 32), (256, 1), (256, 32)]  # (tokens, batch)


def text(tokens: int) -> str:
    """About `tokens` WordPiece tokens with [CLS] and [SEP] (these words are one token each)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 2))


def best(fn, texts: list[str], rounds: int) -> float:
    """Sentences per second: the best of `rounds` calls after one warm-up."""
    fn(texts)
    t = min(_timed(fn, texts) for _ in range(rounds))
    return len(texts) / t


def _timed(fn, texts: list[str]) -> float:
    t0 = time.perf_counter()
    fn(texts)
    return time.perf_counter() - t0


def engine(name: str, rounds: int) -> dict[str, float | None]:
    """Run in a child process: {"tokens×batch": sentences/s} for one engine (None: absent)."""
    if name == "mlxlis":
        import mlxlis

        import mlx.core as mx

        model = mlxlis.load("all-minilm-l6-v2")

        def fn(texts):
            mx.eval(model.embed(texts))
    elif name == "sentence-transformers":
        from mlxlis.loading.catalog import model_path

        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(os.cpu_count() or 1)
        st = SentenceTransformer(str(model_path("all-minilm-l6-v2")), device="cpu")

        def fn(texts):
            st.encode(texts, batch_size=32, convert_to_numpy=True)
    else:  # llama.cpp
        try:
            import llama_cpp
        except ImportError:
            return {f"{t}x{b}": None for t, b in CASES}
        gguf = os.environ.get("MINILM_GGUF", "")
        if not gguf:
            return {f"{t}x{b}": None for t, b in CASES}
        llm = llama_cpp.Llama(gguf, embedding=True, n_threads=os.cpu_count(), verbose=False)

        def fn(texts):
            llm.embed(texts)

    for t, b in CASES:  # every shape once first: a process's first calls run slow here
        fn([text(t)] * b)
    return {f"{t}x{b}": best(fn, [text(t)] * b, rounds) for t, b in CASES}


def minilm_gguf(folder: Path) -> str:
    """MINILM_GGUF, else the catalog's all-MiniLM-L6-v2 converted to F32 by llama.cpp's
    converter into `folder`; "" where llama_cpp is not installed (nothing to compare)."""
    if os.environ.get("MINILM_GGUF") or importlib.util.find_spec("llama_cpp") is None:
        return os.environ.get("MINILM_GGUF", "")
    from mlxlis.loading.catalog import model_path

    from fetch_references import converter

    out = folder / "all-minilm-l6-v2-f32.gguf"
    cmd = [sys.executable, str(converter()), str(model_path("all-minilm-l6-v2"))]
    subprocess.run(
        [*cmd, "--outtype", "f32", "--outfile", str(out)], check=True, capture_output=True
    )
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mlxlis-path", default=str(ROOT))
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        sys.path.insert(0, args.mlxlis_path)
        print(json.dumps(engine(args.engine, args.rounds)))
        return
    names = ["mlxlis", "sentence-transformers", "llama.cpp"]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MINILM_GGUF": minilm_gguf(Path(tmp))}
        for name in names:
            cmd = [sys.executable, __file__, "--engine", name, "--rounds", str(args.rounds)]
            cmd += ["--mlxlis-path", args.mlxlis_path]
            run = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            got[name] = json.loads(run.stdout.strip().splitlines()[-1])
    load = os.getloadavg()[0]
    print(f"all-MiniLM-L6-v2, sentences/s, best of {args.rounds}; load average {load:.2f}\n")
    print("| tokens | batch | " + " | ".join(names) + " | mlxlis / ST | mlxlis / llama.cpp |")
    print("|---" * (len(names) + 4) + "|")
    for t, b in CASES:
        row = [got[n][f"{t}x{b}"] for n in names]
        cells = [f"{v:.1f}" if v is not None else "not installed" for v in row]
        ratios = [f"{row[0] / v:.2f}×" if v else "—" for v in row[1:]]
        print(f"| {t} | {b} | " + " | ".join(cells + ratios) + " |")
    out = ROOT / "bench-results" / "embed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"load": load, "sentences_per_s": got}, indent=1))


if __name__ == "__main__":
    main()
