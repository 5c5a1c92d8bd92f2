"""Why a model has no chat template: four causes, four different fixes.

1. a base / pretrained model: no template by design, raw prompting (`--no-chat`) is right;
2. a template that exists but was not downloaded / picked up: fetch the file;
3. an instruction-tuned model whose author shipped no template;
4. a clone / finetune of a known family that never re-shipped the parent's template.

`diagnose_missing_template` weighs the evidence (names, GGUF metadata, files in the folder, the
family turn markers in the vocabulary) and names the likely cause and the explicit ways out.
It never picks a template: a family default is only used when the user names it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_INSTRUCT = re.compile(r"instruct|chat|(?:^|[-_ .])(?:it|sft|dpo|rlhf)(?:$|[-_ .])", re.I)
_BASE = re.compile(r"(?:^|[-_ .])(?:base|pt|pretrain(?:ed)?)(?:$|[-_ .])", re.I)
_TEMPLATE_FILE = re.compile(r"[\w.-]*(?:\.jinja|chat_template\.json)\b")
_README_HINT = re.compile(r"apply_chat_template|chat[ _]template", re.I)


@dataclass(frozen=True)
class _Family:
    marker: str  # a special token only this family's vocabularies define
    builtin: str  # the built-in template in that format
    label: str
    names: tuple[str, ...]  # name fragments of the family's own models


_FAMILIES = (
    _Family("<start_of_turn>", "gemma", "Gemma", ("gemma",)),
    _Family("<|start_header_id|>", "llama3", "Llama 3", ("llama-3", "llama3", "llama 3")),
    _Family("<|im_start|>", "chatml", "ChatML (Qwen, SmolLM, ...)", ("qwen", "smollm", "chatml")),
)

_SUMMARY = {
    1: "it looks like a base (pretrained) model, which has no chat template by design",
    2: "a chat template is expected but missing: it was probably not downloaded",
    3: "it looks instruction-tuned, but its author shipped no chat template",
    4: "it looks like a finetune of the {family} family that did not re-ship the template",
}
_MEANING = {
    1: "A base model continues text; it does not follow a chat format. Raw prompting is the "
    "right mode: give it a prefix the answer continues (autocomplete, few-shot), not a question.",
    2: "The model is instruction-tuned and needs its own template; fetch the missing file rather "
    "than prompting it raw (raw prompts make a chat model produce confident garbage).",
    3: "The model needs a template to behave; its model card may describe the format in prose. "
    "Raw prompting will likely give degenerate output.",
    4: "The parent family's format usually works for such finetunes, but it is a guess until the "
    "model card confirms it, so mlxlis only uses it when you name it.",
}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _read_text(path: Path, limit: int = 1 << 20) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""


def _vocab_markers(folder: Path | None, meta: dict) -> set[str]:
    """The family markers the model's vocabulary defines (GGUF tokens or tokenizer files)."""
    wanted = {f.marker for f in _FAMILIES}
    tokens = meta.get("tokenizer.ggml.tokens")
    found = {t for t in tokens if isinstance(t, str) and t in wanted} if tokens else set()
    if folder is not None:
        tok = _read_json(folder / "tokenizer.json") or {}
        cfg = _read_json(folder / "tokenizer_config.json") or {}
        added = [t.get("content") for t in tok.get("added_tokens") or () if isinstance(t, dict)]
        decoder = cfg.get("added_tokens_decoder") or {}
        added += [t.get("content") for t in decoder.values() if isinstance(t, dict)]
        vocab = (tok.get("model") or {}).get("vocab")
        found |= {m for m in wanted if m in added or (isinstance(vocab, dict) and m in vocab)}
    return found


def _missing_template_refs(folder: Path) -> list[str]:
    """Evidence that a template file was expected in `folder` but is absent (cause 2)."""
    evidence = []
    for name in ("tokenizer_config.json", "processor_config.json", "config.json"):
        text = _read_text(folder / name)
        for ref in sorted(set(_TEMPLATE_FILE.findall(text))):
            if not (folder / ref).exists():
                evidence.append(f"{name} refers to {ref}, which is not in the folder")
        if name == "tokenizer_config.json" and '"chat_template": null' in text:
            evidence.append("tokenizer_config.json has a chat_template key, but it is empty")
    download_dir = folder / ".cache" / "huggingface" / "download"
    if download_dir.is_dir():
        for meta in sorted(download_dir.glob("*.jinja*")):
            ref = meta.name.split(".jinja")[0] + ".jinja"
            if not (folder / ref).exists():
                evidence.append(f"the download manifest lists {ref}, which is not in the folder")
    if (folder / "chat_template.json").is_file():
        evidence.append(
            "chat_template.json (processor format) is present but mlxlis does not "
            "read it on its own: pass it with --chat-template"
        )
    readme = _read_text(folder / "README.md")
    if _README_HINT.search(readme):
        evidence.append("README.md mentions a chat template (apply_chat_template / chat_template)")
    return evidence


def _names(model_name: str, folder: Path | None, meta: dict) -> list[str]:
    names = [model_name]
    if folder is not None:
        names.append(Path(folder).name)
    for key in ("general.name", "general.basename", "general.finetune"):
        if isinstance(meta.get(key), str) and meta[key]:
            names.append(meta[key])
    return [n for i, n in enumerate(names) if n and n not in names[:i]]


def _base_models(meta: dict) -> list[str]:
    count = meta.get("general.base_model.count")
    out = []
    for i in range(count if isinstance(count, int) else 0):
        key = f"general.base_model.{i}"
        name = meta.get(f"{key}.name") or meta.get(f"{key}.repo_url")
        if isinstance(name, str):
            out.append(name)
    return out


def diagnose_missing_template(
    *, model_name: str, folder: Path | None, gguf_metadata: dict | None
) -> str:
    """The diagnosis for a model with no chat template: a one-line summary, then the
    evidence, what it means, and the explicit ways out (`--no-chat`, `--chat-template`)."""
    meta = gguf_metadata or {}
    folder = Path(folder) if folder is not None else None
    names = _names(model_name, folder, meta)
    joined = " | ".join(names).lower()
    tags = [str(t) for t in meta.get("general.tags") or ()]
    bases = _base_models(meta)
    evidence: list[str] = []

    instruct = [n for n in names if _INSTRUCT.search(n)] + [t for t in tags if _INSTRUCT.search(t)]
    base_marked = [n for n in names if _BASE.search(n)]
    if instruct:
        evidence.append(f"{instruct[0]!r} marks an instruction-tuned model")
    else:
        shown = ", ".join(repr(n) for n in names)
        evidence.append(f"no instruct/chat/-it marker in the name ({shown})")
    if base_marked:
        evidence.append(f"{base_marked[0]!r} marks a base (pretrained) model")
    if bases:
        evidence.append(f"GGUF general.base_model: {', '.join(bases)} (a finetune)")

    markers = _vocab_markers(folder, meta)
    family = next((f for f in _FAMILIES if f.marker in markers), None)
    own_family = family is not None and any(n in joined for n in family.names)
    if family is not None:
        evidence.append(f"the vocabulary defines {family.marker} ({family.label} turn markers)")

    missing = _missing_template_refs(folder) if folder is not None else []
    evidence += missing
    if missing:
        cause = 2
    elif family is not None and not base_marked and (bases or not own_family):
        cause = 4
    elif instruct and not base_marked:
        cause = 3
    else:
        cause = 1

    label = family.label if family is not None else ""
    lines = [f"No chat template for {model_name}: {_SUMMARY[cause].format(family=label)}."]
    lines.append(
        "Looked for: --chat-template, chat_template.jinja, tokenizer_config.json "
        "chat_template, GGUF tokenizer.chat_template."
    )
    lines.append("Evidence:")
    lines += [f"  - {e}" for e in evidence]
    lines.append(f"Cause {cause} of 4. {_MEANING[cause]}")
    lines.append("Ways out (mlxlis never picks a template for you):")
    lines += _ways_out(cause, family)
    return "\n".join(lines)


def _ways_out(cause: int, family: _Family | None) -> list[str]:
    raw = "  --no-chat                   raw prompting: text for the model to continue"
    path = "  --chat-template PATH        a .jinja file (or tokenizer_config.json) holding it"
    builtins = "  --chat-template NAME        a built-in format (chatml, gemma, llama2, llama3)"
    if family is None:
        named = [builtins + ", if the model card names it"]
    else:
        when = {1: "only if this is in fact a chat finetune", 4: "the parent family's format"}
        hint = when.get(cause, f"if the model card confirms the {family.label} format")
        named = [f"  --chat-template {family.builtin:<12}{hint}"]
    poor = " (poor results for a chat model)"
    if cause == 1:
        return [raw, *named, path]
    if cause == 2:
        fetch = "  fetch the missing file into the model folder (re-download it), or"
        return [fetch, path, *named, raw + poor]
    if cause == 4:
        return [*named, path, raw]
    return [path, *named, raw + poor]
