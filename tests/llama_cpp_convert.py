"""llama.cpp's own HF -> GGUF converter run on a tiny checkpoint, as a subprocess: the
`convert_hf_to_gguf.py` of the pinned llama-cpp-python source (scripts/fetch_references.py puts
it, its `conversion/` package and its own `gguf-py` in the reference folder), with one change:
the BPE pre-tokenizer check. The converter names a tokenizer's pre-tokenizer by hashing its
encoding of a test text against a table of released models; the tiny checkpoints' tokenizer
trained here is in no table, so the check (get_vocab_base_pre) answers a fixed name instead of
refusing. Everything the converter writes about the model — tensor names, layouts, folded
conventions, metadata keys — is llama.cpp's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RUNNER = """
import json, runpy, sys
script, pre = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
import torch, transformers, conversion.base  # imported while the caller gets the jobs ready
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
for one in json.loads(sys.stdin.read()):
    sys.argv = [script, *one]
    runpy.run_path(script, run_name="__main__")
"""


def converter() -> Path:
    """convert_hf_to_gguf.py, or a skip naming the script that fetches it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from fetch_references import converter as where

    path = where()
    if not path.is_file():
        pytest.skip("llama.cpp's converter not fetched (scripts/fetch_references.py)")
    return path


def convert(folder: Path, out: Path, outtype: str = "f32", pre: str = "gpt-2") -> Path:
    """`folder` converted to the GGUF `out` by llama.cpp's converter (`--outtype outtype`), the
    tokenizer's pre-tokenizer named `pre`; the converter's log in the failure message."""
    convert_all([(folder, out, outtype)], pre)
    return out


def convert_all(jobs: list[tuple[Path, Path, str]], pre: str = "gpt-2") -> None:
    """Each (folder, out, outtype) converted as `convert` does, in one process (the
    converter's imports, most of a tiny conversion's time, paid once)."""
    start_converter(pre)(jobs)


def start_converter(pre: str = "gpt-2") -> Callable[[list[tuple[Path, Path, str]]], None]:
    """llama.cpp's converter started now, importing what it needs while the caller builds its
    folders; the function returned converts each (folder, out, outtype) as `convert` does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(converter()), pre],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def run(jobs: list[tuple[Path, Path, str]]) -> None:
        args = [[str(f), "--outtype", t, "--outfile", str(o)] for f, o, t in jobs]
        try:
            _, err = proc.communicate(json.dumps(args), timeout=120 * len(jobs))
        finally:
            proc.kill()
        assert proc.returncode == 0, err[-3000:]

    return run
