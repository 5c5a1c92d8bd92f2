"""Which files of a Hub repo (or of its cached snapshot) make the model a reference names.

A safetensors repo: the weights the folder loader reads (the shards of
model.safetensors.index.json, else model.safetensors, else every top-level .safetensors) and
the config, tokenizer, chat-template and generation files beside them; never pickled weights,
never the README or images; the image processor's settings where the repo has them (a model
that sees). A GGUF repo: the files of one model (all parts of a split one) and, where its folder
has one, its vision projector (an mmproj file, of several the one whose precision is nearest the
model's, as llama.cpp's -hf chooses); never the other quants. A LoRA adapter's repo
(`adapter`): its adapter_config.json and weights (PEFT's or mlx-lm's), else its one GGUF
adapter (or the one named). Ambiguity is an error listing choices.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from mlxlis.errors import AmbiguousModelError, HubError
from mlxlis.loading.hub.refs import HubRef

INDEX = "model.safetensors.index.json"
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",  # a multimodal model's image processor
    "processor_config.json",
    INDEX,
)
# a LoRA adapter's files (PEFT's config and weights, mlx-lm's weights), as loading/adapters.py
# reads them
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapters.safetensors")
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SPLIT_PART = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)
# the quant in a GGUF file name as llama.cpp's tools and the usual uploaders write it
QUANT_LABEL = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d+_(?:K(?:_[A-Z]{1,2})?|\d+|[A-Z]{1,3})|BF16|F16|F32|FP16|"
    r"TQ\d_\d|MXFP4(?:_MOE)?)(?![A-Za-z0-9])",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class GGUFModel:
    files: tuple[str, ...]  # repo paths in part order (one unless split)
    count: int  # parts it should have
    label: str | None  # the quant its name carries, e.g. "Q4_K_M"

    @property
    def stem(self) -> str:
        """The file name without the folder, the split suffix and .gguf."""
        name = self.files[0].rsplit("/", 1)[-1]
        m = SPLIT_PART.match(name)
        return m["prefix"] if m else name[: -len(".gguf")]


@dataclass(frozen=True)
class Selection:
    kind: str  # "safetensors" | "gguf"
    files: tuple[str, ...]  # repo paths to fetch
    target: str  # what to open: "" (the snapshot folder) or the first GGUF part
    label: str  # "safetensors" or the GGUF's quant / file name
    needs_index: bool = False  # fetch INDEX first, then select again with its shards


def quant_label(name: str) -> str | None:
    """The quant a GGUF file name carries ("Q4_K_M"), the last one when several match."""
    found = QUANT_LABEL.findall(name.rsplit("/", 1)[-1])
    return found[-1].upper() if found else None


def gguf_models(paths: Collection[str]) -> list[GGUFModel]:
    """The GGUF models among repo paths: single files, and split parts grouped per model.
    Vision projectors (mmproj) are not models."""
    groups: dict[tuple[str, int], dict[int, str]] = {}
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or "mmproj" in name.lower():
            continue
        m = SPLIT_PART.match(name)
        if m and int(m["count"]) > 1:
            folder = path[: len(path) - len(name)]
            groups.setdefault((folder + m["prefix"], int(m["count"])), {})[int(m["no"])] = path
        else:
            groups[(path, 1)] = {1: path}
    models = [
        GGUFModel(tuple(parts[i] for i in sorted(parts)), count, None)
        for (_, count), parts in groups.items()
    ]
    return sorted(
        (GGUFModel(m.files, m.count, quant_label(m.stem)) for m in models), key=lambda m: m.files[0]
    )


def choice(repo: str, model: GGUFModel, models: list[GGUFModel]) -> str:
    """How a reference names `model`: REPO:QUANT when that is unique, else REPO/FILE."""
    if model.label and sum(m.label == model.label for m in models) == 1:
        return f"{repo}:{model.label}"
    return f"{repo}/{model.files[0]}"


def select(
    ref: HubRef,
    listing: Mapping[str, int | None],
    shards: Collection[str] | None = None,
    vision: bool = True,
    adapter: bool = False,
) -> Selection:
    """The files `ref` needs from a repo whose files are `listing` (path -> size); `vision`
    False: a GGUF's mmproj left out (loading text only); `adapter`: a LoRA adapter's files."""
    if adapter:
        return _adapter(ref, listing)
    if not vision:
        listing = {p: n for p, n in listing.items() if "mmproj" not in p.rsplit("/", 1)[-1].lower()}
    models = gguf_models(listing)
    top = {p for p in listing if "/" not in p}
    has_weights = any(p.endswith(".safetensors") for p in top)
    if ref.quant is None and ref.filename is None:
        if has_weights and "config.json" in top:
            return _safetensors(ref, top, shards)
        if len(models) == 1:
            return _gguf(ref, models[0], listing)
        if models:
            raise AmbiguousModelError(
                f"{len(models)} GGUF models in the repo; name one: "
                + ", ".join(choice(ref.repo_id, m, models) for m in models),
                path=str(ref),
            )
        raise HubError(_no_weights(listing, has_weights), path=str(ref))
    if not models:
        raise HubError(
            "the repo holds no GGUF file"
            + (f"; open its safetensors as {ref.repo_id}" if has_weights else ""),
            path=str(ref),
        )
    if ref.filename is not None:
        want = ref.filename.lower()
        found = [m for m in models if want in (f.lower() for f in m.files)]
        what = f"no file {ref.filename} in the repo"
    else:
        pattern = re.compile(
            rf"(?<![A-Za-z0-9]){re.escape(ref.quant or '')}(?![A-Za-z0-9_])", re.IGNORECASE
        )
        found = [m for m in models if pattern.search(m.stem)]
        what = f"no GGUF file name in the repo carries {ref.quant}"
    names = ", ".join(choice(ref.repo_id, m, models) for m in found or models)
    if not found:
        raise HubError(f"{what}; choices: {names}", path=str(ref))
    if len(found) > 1:
        raise AmbiguousModelError(
            f"{len(found)} GGUF models match; name one: {names}", path=str(ref)
        )
    return _gguf(ref, found[0], listing)


def _adapter(ref: HubRef, listing: Mapping[str, int | None]) -> Selection:
    """A PEFT / mlx-lm adapter folder's config and weights, else a GGUF adapter (the one
    named, or the repo's only one); never a model's weights or a projector."""
    top = {p for p in listing if "/" not in p}
    if ref.filename is None and ADAPTER_CONFIG in top:
        weights = tuple(w for w in ADAPTER_WEIGHTS if w in top)
        if not weights:
            raise HubError(
                f"{ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})",
                path=str(ref),
            )
        return Selection("adapter", (ADAPTER_CONFIG, *weights), "", "adapter")
    ggufs = sorted(p for p in listing if p.lower().endswith(".gguf"))
    if ref.filename is not None:
        found = [p for p in ggufs if p.lower() == ref.filename.lower()]
        if not found:
            raise HubError(f"no file {ref.filename} in the repo", path=str(ref))
    else:
        found = ggufs
    if len(found) == 1:
        return Selection("gguf", (found[0],), found[0], found[0].rsplit("/", 1)[-1])
    if found:
        raise AmbiguousModelError(
            f"{len(found)} GGUF files in the repo; name one: "
            + ", ".join(f"{ref.repo_id}/{p}" for p in found),
            path=str(ref),
        )
    raise HubError(f"no LoRA adapter in the repo (no {ADAPTER_CONFIG}, no .gguf)", path=str(ref))


def _gguf(ref: HubRef, model: GGUFModel, listing: Collection[str]) -> Selection:
    if len(model.files) != model.count:
        raise HubError(
            f"split GGUF {model.stem} has {len(model.files)} of its {model.count} "
            "parts in the repo",
            path=str(ref),
        )
    label = model.label or model.files[0].rsplit("/", 1)[-1]
    proj = mmproj_for(model, listing)
    return Selection("gguf", model.files + ((proj,) if proj else ()), model.files[0], label)


def mmproj_for(model: GGUFModel, listing: Collection[str]) -> str | None:
    """The vision projector beside `model` in the repo: an mmproj .gguf in its folder (else
    the repo's top), of several the one whose precision is nearest the model's."""
    folder = model.files[0][: len(model.files[0]) - len(model.files[0].rsplit("/", 1)[-1])]
    found = []
    for where in dict.fromkeys((folder, "")):
        found = sorted(
            p
            for p in listing
            if p.lower().endswith(".gguf")
            and "mmproj" in p.rsplit("/", 1)[-1].lower()
            and p[: len(p) - len(p.rsplit("/", 1)[-1])] == where
        )
        if found:
            break
    if not found:
        return None
    want = _bits(model.label or model.stem)
    return min(found, key=lambda p: (abs(_bits(quant_label(p) or p) - want), p))


def _bits(label: str) -> int:
    """The precision a quant label says (Q4_K_M -> 4, BF16 -> 16, F32 -> 32; unknown: 16)."""
    m = re.search(r"(?:^|[^A-Za-z])(?:I?Q|B?F|FP)(\d+)", label.upper())
    return int(m.group(1)) if m else 16


def _safetensors(ref: HubRef, top: set[str], shards: Collection[str] | None) -> Selection:
    extra = tuple(f for f in FOLDER_FILES if f in top)
    if INDEX in top and shards is None:
        return Selection("safetensors", (INDEX,), "", "safetensors", needs_index=True)
    if shards is not None:
        lacking = sorted(set(shards) - top)
        if lacking:
            raise HubError(
                f"{INDEX} lists {', '.join(lacking)}, which the repo lacks", path=str(ref)
            )
        weights = tuple(sorted(set(shards)))
    elif "model.safetensors" in top:
        weights = ("model.safetensors",)
    else:
        weights = tuple(sorted(p for p in top if p.endswith(".safetensors")))
    return Selection("safetensors", weights + extra, "", "safetensors")


def _no_weights(listing: Mapping[str, int | None], has_weights: bool) -> str:
    if has_weights:
        return "has .safetensors weights but no config.json: not a loadable model folder"
    pickles = sorted(p for p in listing if p.lower().endswith(PICKLES))
    if pickles:
        return (
            f"no loadable weights: only pickled PyTorch files ({', '.join(pickles[:3])}), "
            "which mlxlis refuses; look for a safetensors or GGUF version of the model"
        )
    return "no loadable weights (no .safetensors or .gguf file in the repo)"
