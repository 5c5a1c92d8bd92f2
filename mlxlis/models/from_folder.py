"""A Hugging Face style safetensors folder (plain or MLX-quantized) as a Model.

Safetensors folders bind through a binding manifest (`loading/manifest.py`): the one given
with `bindings=` (a JSON/YAML file or a dict), else the identity manifest (every parameter to
the tensor of the same name). Either way the whole mapping is validated from the headers
before a tensor is read; `strict=False` turns tensors no parameter takes into a warning.
"""

from __future__ import annotations

from pathlib import Path

from mlxlis.bounded import check_folder_json
from mlxlis.errors import UnsupportedError
from mlxlis.loading.binding import bind
from mlxlis.loading.manifest import Manifest, as_manifest
from mlxlis.loading.plan import plan_bindings
from mlxlis.loading.safetensors import module_sizes
from mlxlis.models import build_model, config_from_hf, family
from mlxlis.models.config import read_json
from mlxlis.models.model import Model
from mlxlis.models.multimodal import CachedVision, Hearing
from mlxlis.models.placement import Placement
from mlxlis.models.quantized import Kernels
from mlxlis.prompt.template import discover_template
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx


def load_folder(
    folder: Path,
    dtype: mx.Dtype,
    *,
    chat_template: str | None,
    bindings: Manifest | str | Path | dict | None = None,
    strict: bool = True,
    placement: Placement | None = None,
    task: str | None = None,
) -> Model:
    """A safetensors folder as a Model: config.json parsed by its family, the tensors bound
    through the manifest (validated from the headers first), the tokenizer and the chat
    template found beside them. Under a `placement` (a pipeline), this rank's share only.
    `task`: None (what the folder says: decoder_encoder.decoder_task), "generate", "embed"
    or "rerank"."""
    manifest = as_manifest(bindings)
    cfg_path = folder / "config.json"
    gen_path = folder / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else None
    cfg = config_from_hf(read_json(cfg_path), str(cfg_path), generation)
    spec = family(cfg.family)
    if spec.kind == "decoder":  # an embedding model or reranker where the folder or task says
        from mlxlis.models.decoder_encoder import decoder_task

        model = decoder_task(folder, cfg, task, dtype)
        if model is not None:
            return model
    # an encoder embeds or reranks: its own files beside the weights; loaded whole on every
    # rank of a launcher (small models: nothing to gain from splitting them)
    if spec.kind == "encoder":
        if manifest.origin is not None:
            raise UnsupportedError(
                "an encoder binds by its own names, not a manifest", path=folder, field="bindings"
            )
        from mlxlis.models.from_encoder import load_encoder_folder

        model = load_encoder_folder(folder, cfg, dtype)
        if task not in (None, model.task):
            raise UnsupportedError(
                f"an encoder that does {model.task}, not {task}", path=folder, field="task"
            )
        return model
    part = None
    if placement is not None:  # under a launcher: this rank's share of the layers only
        part = placement.place(cfg, module_sizes(folder, spec.hf.name), str(folder))
    stage = {} if part is None else dict(layers=part.layers, embeds=part.first, heads=part.last)
    own = cfg if part is None else part.local(cfg)  # a tensor rank's heads and rows only
    net = build_model(own, **stage)
    # validates names, dtypes and shapes from the headers (family renames such as Gemma 3's
    # multimodal prefixes via net.sanitize), and quantizes the modules whose scales are bound
    plan = plan_bindings(
        net,
        cfg,
        manifest,
        folder,
        strict=strict,
        layouts=spec.mlx.layouts,
        held=part.holds if part is not None else None,
        quantizer=Kernels(dtype),  # products through mlxlis's CPU kernels where they apply
        cut=part.cut if part is not None else None,  # a tensor rank reads its slices only
    )
    weights = plan.load()
    if plan.relaid:  # saved by mlx-lm after its sanitize: undo what that folded in
        weights = {
            n: spec.undo(n, a, own, n.rsplit(".", 1)[1], spec.mlx.conventions)
            for n, a in weights.items()
        }
    bind(net, weights, plan.origin or folder, dtype)
    quantized = bool(plan.quantized)
    check_folder_json(folder)  # bounds the tokenizer's JSON files before they are parsed
    tokenizer = Tokenizer.from_folder(folder)
    template = discover_template(explicit=chat_template, folder=folder)
    fmt = "safetensors (MLX quantized)" if quantized else "safetensors"
    skipped = plan.dropped
    vision = None
    # a pipeline's ranks read text only; of tensor ranks rank 0 holds the tower (Share.sees)
    if spec.vision is not None and (part is None or (part.sees and part.rank == 0)):
        vision = spec.vision(folder, read_json(cfg_path), tokenizer, dtype)
        if isinstance(vision, Hearing):  # its own vocabulary's ids, embedded by its embedder
            vision.attach(net)
        if vision is not None:
            vision = CachedVision(vision)  # an image's features kept for the next requests
            skipped = [n for n in skipped if not vision.uses(n)]
    if part is not None:
        net = placement.wrap(net, part, dtype)
    model = Model(
        cfg,
        net,
        tokenizer,
        dtype=dtype,
        path=folder,
        fmt=fmt,
        template=template,
        skipped=skipped,
        part=part,
        vision=vision,
        sees=spec.vision is not None,
    )
    if task == "rerank":
        from mlxlis.models.decoder_rerank import as_reranker

        return as_reranker(model)
    return model
