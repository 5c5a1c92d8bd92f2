"""transformers' references for the real catalog models, built by transformers' own GGUF
loader: its GGUF-built tokenizer (saved with save_pretrained) and its float32 logits for a
prompt tokenised by mlxlis' GGUF tokenizer (whose ids test_tokenizer compares separately).

transformers takes 20-50 s a model here (gguf-py dequantisation, tokenizer conversion), so the
test session starts this file as a background process as soon as tests that need it are
collected (conftest.py) and they wait for its files; run directly it builds them in-process.

usage: python tests/hf_references.py OUT_DIR NAME [NAME ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPT = (
    "The history of computing is a story of abstraction layered upon abstraction: "
    "early machines were programmed by rewiring them."
)


def tokenizer_dir(out: Path, name: str) -> Path:
    return out / f"hf-tokenizer-{name}"


def logits_file(out: Path, name: str) -> Path:
    return out / f"hf-logits-{name}.npz"


def build(out: Path, name: str) -> None:
    """Write the tokenizer folder, then the logits (each atomically: temp name, rename)."""
    from mlxlis.loading import catalog
    from mlxlis.loading.gguf_split import read_gguf
    from mlxlis.tokenizer import Tokenizer

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = catalog.model_path(name)
    folder = tokenizer_dir(out, name)
    if not folder.is_dir():
        tmp = out / f".tmp-tok-{name}"
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp)
        tmp.rename(folder)
    target = logits_file(out, name)
    if target.is_file():
        return
    with read_gguf(path) as f:
        ids = Tokenizer.from_gguf(f.metadata, path).encode(PROMPT)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float().numpy()
    tmp = out / f".tmp-logits-{name}.npz"
    with open(tmp, "wb") as fh:
        np.savez(fh, ids=np.array(ids), logits=logits)
    tmp.rename(target)


def main(argv: list[str]) -> int:
    out, names = Path(argv[0]), argv[1:]
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)  # leave the other cores to the test session running beside it
    for name in names:
        try:
            build(out, name)
        except Exception as e:  # noqa: BLE001 — reported to the waiting tests, then go on
            (out / f"failed-{name}.json").write_text(json.dumps(f"{type(e).__name__}: {e}"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main(sys.argv[1:]))
