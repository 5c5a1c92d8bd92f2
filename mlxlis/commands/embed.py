"""`mlxlis embed -m MODEL TEXT...`: one vector per text from an embedding model, printed as
JSON (`--json`: a list of lists, for scripts) or one line per text (its first values, its
dimensions and the text's start, for a person)."""

from __future__ import annotations

import argparse
import json

from mlxlis.commands.common import guard, say

DEFAULT = "all-minilm-l6-v2"  # the catalog's embedding model


def embed_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlxlis embed",
        description="Embed texts with an embedding model (a sentence-transformers folder, a "
        "Hugging Face BERT / XLM-RoBERTa folder or a catalog name): one vector per text.",
    )
    p.add_argument("-m", "--model", default=DEFAULT, help=f"the model (default {DEFAULT})")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="the texts, one vector each")
    p.add_argument("--json", action="store_true", help="print a JSON list of lists")
    p.add_argument(
        "--dimensions",
        type=int,
        default=None,
        metavar="N",
        help="the first N values (Matryoshka), renormalised when the model normalises",
    )
    p.add_argument(
        "--prompt-name",
        default=None,
        metavar="NAME",
        help="a prompt of the model's config_sentence_transformers.json put before each text",
    )
    p.add_argument(
        "--no-truncate",
        action="store_true",
        help="refuse a text longer than the model's maximum instead of cutting it",
    )
    p.add_argument("--dtype", default=None, help="compute dtype (default: the device's)")
    p.add_argument("--debug", action="store_true", help="tracebacks on errors")
    return p


def run_embed(argv: list[str]) -> int:
    a = embed_parser().parse_args(argv)
    return guard(a.debug, lambda: _embed(a))


def _embed(a: argparse.Namespace) -> int:
    from mlxlis import load

    model = load(a.model, a.dtype)
    vectors = model.embed(
        a.texts,
        dimensions=a.dimensions,
        prompt_name=a.prompt_name,
        truncate=not a.no_truncate,
    ).tolist()
    if a.json:
        print(json.dumps(vectors))
        return 0
    for text, v in zip(a.texts, vectors, strict=True):
        head = ", ".join(f"{x:.4f}" for x in v[:4])
        shown = text if len(text) <= 40 else text[:39] + "…"
        print(f"[{head}{', …' if len(v) > 4 else ''}] {len(v)} dims  {shown}")
    say(f"{model.name}: {len(vectors)} vectors")
    return 0
