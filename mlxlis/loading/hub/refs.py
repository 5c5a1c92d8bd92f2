"""Model references that name a Hugging Face Hub repo:

    ORG/NAME                 a repo (safetensors, MLX-quantized, or one GGUF model)
    ORG/NAME:QUANT           the GGUF whose file name carries QUANT (case-insensitive)
    ORG/NAME/PATH/FILE.gguf  one GGUF file of the repo (a split one: any of its parts)
    ...@REVISION             a branch, tag or commit (default: main)

A path that exists is never read as a reference (loading.resolve checks paths first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlxlis.errors import ModelNotFoundError

# the Hub's repo id rules (huggingface_hub.utils.validate_repo_id): letters, digits, - _ .,
# not starting or ending with - or ., no "--" or "..", at most 96 characters in all
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
QUANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
REVISION = re.compile(r"^[A-Za-z0-9_.\-/]+$")  # branch, tag, commit, refs/pr/N
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # ORG/NAME
    quant: str | None = None  # :QUANT
    filename: str | None = None  # a .gguf path inside the repo
    revision: str | None = None  # @REVISION; None: the repo's main branch

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def __str__(self) -> str:
        text = self.repo_id
        if self.filename:
            text += "/" + self.filename
        if self.quant:
            text += ":" + self.quant
        return text + (f"@{self.revision}" if self.revision else "")


def parse_ref(text: str) -> HubRef | None:
    """The Hub reference `text` spells, or None when it is not one (then it is a path or a
    name of another kind). A reference with a file and a quant both is an error."""
    if not isinstance(text, str) or text.startswith(("/", ".", "~")) or "\\" in text:
        return None
    rest, _, revision = text.partition("@")
    quant = None
    if ":" in revision:  # a git ref cannot hold ':' so ORG/NAME@REV:QUANT is unambiguous too
        revision, _, quant = revision.partition(":")
    if ":" in rest:
        rest, _, quant2 = rest.rpartition(":")
        if quant is not None:
            return None
        quant = quant2
    parts = rest.split("/")
    if len(parts) < 2:
        return None
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or None
    if not _valid_repo(repo_id) or ("@" in text and not revision):
        return None
    if revision and not (REVISION.match(revision) and ".." not in revision):
        return None
    if quant is not None and not QUANT.match(quant):
        return None
    if filename is None and parts[1].lower().endswith(".gguf"):
        return None  # ORG/NAME.gguf is a file path that does not exist, not a repo
    if filename is not None:
        if not filename.lower().endswith(".gguf") or any(p in ("", ".", "..") for p in parts[2:]):
            return None
        if quant is not None:
            raise ModelNotFoundError("name a GGUF file or a :QUANT, not both", path=text)
    return HubRef(repo_id, quant, filename, revision or None)


def _valid_repo(repo_id: str) -> bool:
    return (
        bool(REPO_ID.match(repo_id))
        and len(repo_id) <= 96
        and "--" not in repo_id
        and ".." not in repo_id
        and not repo_id.endswith(".git")
    )
