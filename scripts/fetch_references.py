"""Reference files from llama.cpp for the tests: its official chat templates and its tokenizer
test vocabularies, as shipped inside the llama-cpp-python source release on PyPI.

usage: python scripts/fetch_references.py   (run by `make test`; idempotent)

The source archive is downloaded from PyPI (pinned version and SHA-256), never built; from it
`vendor/llama.cpp/models/templates/*` and `vendor/llama.cpp/models/ggml-vocab-*` are extracted
into the folder `reference_dir()` names (published whole by a rename), and llama.cpp's own HF ->
GGUF converter (`convert_hf_to_gguf.py`, its `conversion/` package and the `gguf-py/gguf`
it puts first on its path) into its `llama.cpp/` subfolder (published by a rename of its own,
so a folder fetched before the converter was wanted gets it on the next run). The tests run
that converter on their tiny checkpoints.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxlis.loading import catalog  # noqa: E402

VERSION = "0.3.36"
URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    f"llama_cpp_python-{VERSION}.tar.gz"
)
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
MODELS = "models/"
WANTED = ("templates/", "ggml-vocab-")  # under MODELS
CONVERTER = "llama.cpp"  # the subfolder the converter is published in
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")


def reference_dir() -> Path:
    return catalog.store_dir().parent / "references" / f"llama-cpp-python-{VERSION}"


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py in the reference folder (there once `fetch` ran)."""
    return reference_dir() / CONVERTER / "convert_hf_to_gguf.py"


def fetch() -> Path:
    out = reference_dir()
    want_models, want_converter = not out.is_dir(), not converter().is_file()
    if not (want_models or want_converter):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as tmp:
        archive = Path(tmp) / "src.tar.gz"
        digest = hashlib.sha256()
        with urllib.request.urlopen(URL, timeout=120) as resp, open(archive, "wb") as f:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != SHA256:
            sys.exit(f"fetch_references: SHA-256 mismatch for {URL}")
        staged, tool = Path(tmp) / "models", Path(tmp) / CONVERTER
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                rel = member.name[len(VENDOR) :] if member.name.startswith(VENDOR) else None
                if not rel or not member.isfile() or ".." in rel:
                    continue
                if want_models and rel.startswith(MODELS) and rel[len(MODELS) :].startswith(WANTED):
                    target = staged / rel[len(MODELS) :]
                elif want_converter and (
                    rel == CONVERTER_FILES[0] or rel.startswith(CONVERTER_FILES[1:])
                ):
                    target = tool / rel
                else:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if want_models:
            staged.mkdir(exist_ok=True)
            tool.rename(staged / CONVERTER)
            _publish(staged, out)
        else:
            _publish(tool, out / CONVERTER)
    return out


def _publish(staged: Path, target: Path) -> None:
    """Rename `staged` to `target`; a concurrent fetch that published it first wins."""
    try:
        staged.rename(target)
    except OSError:
        if not target.is_dir():
            raise


if __name__ == "__main__":
    print(fetch())
