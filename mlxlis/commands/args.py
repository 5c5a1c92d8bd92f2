"""Command-line options shared by the mlxlis commands and the chat app (`mlxlis chat`): the
model options, --think / --no-think and the sampling flags, whose defaults, ranges and help
come from mlxlis.generation.sampling."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from mlxlis.bounded import read_json_file
from mlxlis.errors import MlxlisError
from mlxlis.loading import catalog

MODEL_HELP = (
    "model folder, .gguf file, catalog name, Hugging Face repo "
    "ORG/NAME[:QUANT | /FILE.gguf][@REVISION] (fetched into the Hugging Face cache) or a "
    "name `mlxlis models --scan` lists; a path that exists wins over a name"
)


def adapter_scale(text: str) -> float:
    """--adapter-scale's value: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text!r}")
    return value


def add_adapter_args(p: argparse.ArgumentParser, how: str) -> None:
    """--adapter (several) and --adapter-scale; `how`: what is done with an adapter."""
    p.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="PATH",
        help=f"a LoRA adapter {how}: PEFT's or mlx-lm's folder, llama.cpp's GGUF LoRA, or a "
        "Hugging Face name; may be given several times",
    )
    p.add_argument(
        "--adapter-scale",
        type=adapter_scale,
        default=1.0,
        metavar="S",
        help="a multiplier on every --adapter's scale (above 0; default 1)",
    )


def add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    """The model's flags; `several`: -m may be given more than once, as [NAME=]REF (a server's
    models), and defaults to none."""
    if several:
        p.add_argument(
            "-m",
            "--model",
            action="append",
            default=None,
            metavar="[NAME=]REF",
            help=MODEL_HELP + "; may be given several times, NAME= names it for requests "
            "(default: every model on the disk: the catalog's, the Hugging Face cache's and "
            "--models-dir's, each loaded when a request names it)",
        )
    else:
        p.add_argument(
            "-m",
            "--model",
            default=catalog.DEFAULT_MODEL,
            help=f"{MODEL_HELP} (default {catalog.DEFAULT_MODEL})",
        )
        add_adapter_args(p, "applied unmerged to the model (--fuse merges it)")
        p.add_argument(
            "--fuse",
            action="store_true",
            help="merge the --adapters into the weights once (a quantized weight is "
            "requantized with its bits and group size): the base's decode speed",
        )
        p.add_argument(
            "--task",
            choices=("generate", "embed", "rerank"),
            default=None,
            help="what the model does (default: what its folder says); rerank: a causal LM "
            "such as Qwen3-Reranker scoring by p(yes)",
        )
    p.add_argument(
        "--dtype", default=None, help="float32 | float16 | bfloat16 (default: per device)"
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        default=None,
        help="make every quantized GGUF weight dense in the compute dtype "
        "(default: per device — dense on CPU when it fits, quantized on Metal/CUDA)",
    )
    p.add_argument(
        "--quantized",
        dest="dequantize",
        action="store_false",
        help="keep GGUF quantized blocks quantized (exact MLX affine arrays) on any device",
    )
    vision = p.add_mutually_exclusive_group()
    vision.add_argument(
        "--mmproj",
        metavar="FILE",
        default=None,
        help="llama.cpp's vision file (mmproj GGUF) for a GGUF model that sees (default: a "
        '.gguf beside the model whose name holds "mmproj")',
    )
    vision.add_argument(
        "--no-mmproj",
        dest="mmproj",
        action="store_false",
        help="text only: no vision file, even one beside the model (nor fetched with a Hub GGUF)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        default=None,
        help="a .jinja file or a built-in template name, used instead of the model's",
    )
    p.add_argument(
        "--bindings",
        metavar="FILE",
        default=None,
        help="binding manifest (JSON or YAML) mapping the model's parameter paths to the "
        "checkpoint's tensor names (safetensors folders)",
    )
    strictness = p.add_mutually_exclusive_group()
    strictness.add_argument(
        "--strict",
        dest="strict",
        action="store_true",
        default=True,
        help="tensors that no parameter takes are an error (default)",
    )
    strictness.add_argument(
        "--lenient",
        dest="strict",
        action="store_false",
        help="ignore tensors that no parameter takes (listed on stderr with --verbose)",
    )
    p.add_argument(
        "--layers-split",
        metavar="N,N,...",
        type=_layers_split,
        default=None,
        help="under mlx.launch: layers per rank, in rank order (e.g. 14,14; default: balanced "
        "by weight bytes)",
    )
    p.add_argument(
        "--tensor",
        metavar="N",
        type=_tensor,
        default=None,
        help="under mlx.launch -n N: split every layer across the N ranks (tensor parallelism: "
        "attention heads, MLP and expert rows, vocabulary) instead of pipelining the layers; "
        "--tensor 2 under -n 4: two pipeline stages of 2 tensor ranks",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(8, 4),
        default=None,
        help="store the KV cache quantized at 8 or 4 bits (MLX affine) and attend on it in "
        "that form, the newest block of up to 255 positions in full precision: about 1.9x / "
        "3.6x the context of float16 in the same memory (default: dense)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="elements per scale and bias of a quantized KV cache (default 64)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="model details and stats on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _layers_split(text: str) -> list[int]:
    from mlxlis.errors import LayersSplitError
    from mlxlis.settings import parse_split

    try:
        return parse_split(text)
    except LayersSplitError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--layers-split: ")) from None


def _tensor(text: str) -> int:
    from mlxlis.errors import PipelineError
    from mlxlis.settings import parse_tensor

    try:
        return parse_tensor(text)
    except PipelineError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--tensor: ")) from None


def add_thinking_args(p: argparse.ArgumentParser) -> None:
    """--think / --no-think: the chat template's thinking switch, spelled as the template
    spells it (mlxlis.prompt.thinking_switch; dest `thinking`: True, False, or None for the
    template's default)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--think",
        dest="thinking",
        action="store_const",
        const=True,
        default=None,
        help="reasoning models: turn the chat template's thinking switch on (enable_thinking, "
        "thinking, thinking_mode, reasoning_effort, ... as the template reads it)",
    )
    g.add_argument(
        "--no-think",
        dest="thinking",
        action="store_const",
        const=False,
        help="reasoning models: turn the chat template's thinking switch off (e.g. "
        "enable_thinking=false, thinking_budget=0) and show no reasoning",
    )


def check_thinking(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--think / --no-think need a chat template: refused (exit 2) with --no-chat."""
    if getattr(a, "no_chat", False) and a.thinking is not None:
        flag = "--think" if a.thinking else "--no-think"
        p.exit(
            2,
            f"{p.prog}: error: {flag} sets the chat template's thinking switch; "
            "--no-chat uses no template\n",
        )


# flag -> SamplingParams field; defaults, ranges and help come from mlxlis.generation.sampling
SAMPLING_FLAGS = {
    "--max-tokens": "max_tokens",
    "--temp": "temperature",
    "--top-p": "top_p",
    "--top-k": "top_k",
    "--min-p": "min_p",
    "--repetition-penalty": "repetition_penalty",
    "--repeat-last-n": "repetition_context",
    "--presence-penalty": "presence_penalty",
    "--frequency-penalty": "frequency_penalty",
    "--logit-bias": "logit_bias",
    "--typical-p": "typical_p",
    "--top-n-sigma": "top_n_sigma",
    "--dry-multiplier": "dry_multiplier",
    "--dry-base": "dry_base",
    "--dry-allowed-length": "dry_allowed_length",
    "--dry-penalty-last-n": "dry_penalty_last_n",
    "--dry-sequence-breakers": "dry_sequence_breakers",
    "--xtc-probability": "xtc_probability",
    "--xtc-threshold": "xtc_threshold",
    "--mirostat": "mirostat",
    "--mirostat-tau": "mirostat_tau",
    "--mirostat-eta": "mirostat_eta",
    "--seed": "seed",
}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    from mlxlis.generation.sampling import FIELDS, SamplingParams

    defaults = SamplingParams()
    for flag, name in SAMPLING_FLAGS.items():
        what = FIELDS[name][2]
        p.add_argument(
            flag,
            dest=name,
            default=None,
            metavar="X",
            help=f"{what}; default {getattr(defaults, name)}",
        )


def sampling_params(p: argparse.ArgumentParser, a: argparse.Namespace):
    """SamplingParams from the flags; a bad value ends the command (exit 2) naming the flag."""
    from mlxlis.generation import sampling as s

    changes = {}
    for flag, name in SAMPLING_FLAGS.items():
        raw = getattr(a, name)
        if raw is not None:
            try:
                changes[name] = s.parse_value(name, raw)
            except s.SamplingError as e:
                p.exit(2, f"{p.prog}: error: {flag}: {str(e).split(': ', 1)[1]}\n")
    params = s.SamplingParams(**changes)
    speculating = getattr(a, "speculative", None) or getattr(a, "draft_model", None)
    if speculating and (name := s.draws_of_its_own(params)) is not None:
        flag = next(f for f, n in SAMPLING_FLAGS.items() if n == name)
        p.exit(2, f"{p.prog}: error: {flag}: not with speculative decoding\n")
    return params


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (generation/speculative.py): drafts verified in one forward."""
    from mlxlis.generation.speculative import KINDS, MAX_DRAFT

    g = p.add_argument_group("speculative decoding (the same tokens, sooner)")
    g.add_argument(
        "--speculative",
        choices=KINDS,
        default=None,
        help="draft the next tokens and verify them in one forward: ngram (prompt lookup: "
        "continuations found earlier in the text), draft (a draft model; the default "
        "with --draft-model) or mtp (the model's own multi-token-prediction head: "
        "Qwen3.5 / Qwen3.6 checkpoints that ship one)",
    )
    g.add_argument(
        "--draft-model",
        metavar="REF",
        default=None,
        help="a smaller model of the same vocabulary (any reference -m takes)",
    )
    g.add_argument(
        "--draft-tokens",
        metavar="K",
        default=None,
        help=f"tokens per verification, 1..{MAX_DRAFT} (default: chosen as it runs from the "
        "measured acceptance and step costs; speculation rests where it does not pay)",
    )


def speculative_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Check the speculative flags together (exit 2 naming the flag); sets `a.speculative`
    to the kind asked for (None: none) and `a.draft_tokens` to an int or None."""
    from mlxlis.generation.speculative import MAX_DRAFT

    kind = a.speculative or ("draft" if a.draft_model else None)
    if kind == "draft" and not a.draft_model:
        p.exit(2, f"{p.prog}: error: --speculative draft: needs --draft-model REF\n")
    if kind in ("ngram", "mtp") and a.draft_model:
        p.exit(2, f"{p.prog}: error: --draft-model: drafts with --speculative draft, not {kind}\n")
    if a.draft_tokens is not None:
        if kind is None:
            p.exit(2, f"{p.prog}: error: --draft-tokens: needs --speculative or --draft-model\n")
        try:
            k = int(a.draft_tokens)
        except ValueError:
            k = 0
        if not 1 <= k <= MAX_DRAFT:
            p.exit(
                2,
                f"{p.prog}: error: --draft-tokens: must be an integer in [1, {MAX_DRAFT}], "
                f"not {a.draft_tokens!r}\n",
            )
        a.draft_tokens = k
    a.speculative = kind


def load_speculation(a: argparse.Namespace, target, load_draft=None):
    """The Speculation the (checked) flags ask for, None for none: a draft model loaded as
    the target is (`load_draft(ref)`, default mlxlis.load with the same dtype and quantization)
    and checked to share its vocabulary (SpeculativeError otherwise)."""
    from mlxlis.generation.sampling import SamplingParams
    from mlxlis.generation.speculative import Speculation, check_vocabulary

    kind = getattr(a, "speculative", None)
    if kind is None:
        return None
    draft = None
    if kind == "draft":
        if load_draft is None:
            from mlxlis import load
            from mlxlis.distributed import held_alone

            def load_draft(ref: str):
                with held_alone():  # on rank 0 only, whole, beside a target split across ranks
                    return load(ref, a.dtype, dequantize=a.dequantize)

        draft = load_draft(a.draft_model)
        check_vocabulary(target, draft)
    spec = Speculation(kind, draft, a.draft_tokens)
    if kind == "mtp":  # the block loaded now: a model without one is refused before any prompt
        spec.drafter(SamplingParams(), target)
    return spec


def add_format_args(p: argparse.ArgumentParser) -> None:
    """Structured output: the reply constrained token by token (generation/constraints)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="the reply is one JSON object")
    g.add_argument("--json-schema", metavar="FILE", help="the reply follows this JSON schema")
    g.add_argument("--regex", metavar="PATTERN", help="the reply matches this regular expression")
    g.add_argument(
        "--grammar",
        metavar="FILE",
        help="the reply follows this grammar (Lark; GBNF for a .gbnf file)",
    )


def response_format(a: argparse.Namespace) -> dict | None:
    """The response_format dict the flags ask for (a file that cannot be read or parsed is a
    MlxlisError naming it: exit 2)."""
    if a.json:
        return {"type": "json_object"}
    if a.json_schema:
        schema = read_json_file(a.json_schema, error=MlxlisError, what="--json-schema")
        return {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    if a.regex:
        return {"type": "regex", "regex": a.regex}
    if a.grammar:
        path = Path(a.grammar)
        try:
            text = path.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MlxlisError(f"cannot read the grammar: {e}", path=path) from None
        return {
            "type": "grammar",
            "grammar": text,
            "syntax": "gbnf" if path.suffix.lower() == ".gbnf" else "lark",
        }
    return None
