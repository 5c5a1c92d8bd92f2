"""Reference files from llama.cpp for the tests: its official chat templates and its tokenizer
test vocabularies, as shipped inside the llama-cpp-python source release on PyPI.

usage: python scripts/fetch_references.py   (run by `make test`; idempotent)

The source archive is downloaded from PyPI (pinned version and SHA-256), never built or run;
only `vendor/llama.cpp/models/templates/*` and `vendor/llama.cpp/models/ggml-vocab-*` are
extracted, into the folder `reference_dir()` names (published whole by a rename).
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
PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
WANTED = ("templates/", "ggml-vocab-")


def reference_dir() -> Path:
    return catalog.store_dir().parent / "references" / f"llama-cpp-python-{VERSION}"


def fetch() -> Path:
    out = reference_dir()
    if out.is_dir():
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
        staged = Path(tmp) / "models"
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                rel = member.name[len(PREFIX) :] if member.name.startswith(PREFIX) else None
                if rel and member.isfile() and rel.startswith(WANTED) and ".." not in rel:
                    target = staged / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        staged.rename(out)
    return out


if __name__ == "__main__":
    print(fetch())
