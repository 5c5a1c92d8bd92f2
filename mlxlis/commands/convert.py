"""`mlxlis convert`: a GGUF (or a folder) to an MLX / Hugging Face layout folder that mlx-lm
loads, with quantized blocks written unchanged (no requantisation) and conventions undone.
With adapters, they are merged first (lora.fuse: the modules they adapt requantized with their
own bits and group size, or dense) and the folder is the fine-tuned model.

The output is assembled in a temporary sibling folder, verified by reopening it (its logits must
equal the source's bit for bit), and only then renamed into place: nothing half-written remains
after an error or Ctrl+C.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxlis.errors import MlxlisError, UnsupportedError
from mlxlis.models import family
from mlxlis.models.config import ModelConfig, yarn_keys
from mlxlis.models.experts import QuantizedSwitchLinear, SwitchLinear
from mlxlis.models.model import Model

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

MAX_SHARD_BYTES = 5 * 2**30


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hf_config(cfg: ModelConfig, dtype: mx.Dtype, quant: dict | None) -> dict[str, Any]:
    """config.json in the classic keys that mlx-lm and transformers both read."""
    export = family(cfg.family).export
    out: dict[str, Any] = {
        "architectures": [export.architecture],
        "model_type": export.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.mlp.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norms.eps,
        "rope_theta": cfg.rope.theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.mlp.hidden_act,
        "torch_dtype": str(dtype).replace("mlx.core.", ""),
        "bos_token_id": cfg.special.bos,
        "eos_token_id": list(cfg.special.eos) if len(cfg.special.eos) != 1 else cfg.special.eos[0],
    }
    if cfg.rope.type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope.factor}
    elif cfg.rope.type == "llama3":
        r = cfg.rope
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
    elif cfg.rope.type == "yarn":
        out["rope_scaling"] = yarn_keys(cfg.rope)
    out.update(export.config(cfg))
    if export.wrapper:  # readers know this family under its multimodal wrapper type only
        out = {
            "architectures": out.pop("architectures"),
            "model_type": export.wrapper,
            "tie_word_embeddings": out["tie_word_embeddings"],
            "eos_token_id": out["eos_token_id"],
            "text_config": out,
        }
    if quant:  # per-module overrides under the names the tensors are written with
        quant = {(export.name(k) if isinstance(v, dict) else k): v for k, v in quant.items()}
        out["quantization"] = quant
        out["quantization_config"] = quant
    return out


def quantization_block(net: nn.Module) -> tuple[dict | None, list[str], list[str]]:
    """mlx-lm's "quantization" block (most common bits as default, per-module overrides) and
    the lists of quantized and dense weight modules."""
    qmods: dict[str, tuple[int, int, str]] = {}
    dense: list[str] = []
    for name, m in net.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            qmods[name] = (m.group_size, m.bits, getattr(m, "mode", "affine"))
        elif isinstance(m, (nn.Linear, nn.Embedding, SwitchLinear)):
            dense.append(name)
    if not qmods:
        return None, [], sorted(dense)
    (group, bits, mode), _ = Counter(qmods.values()).most_common(1)[0]
    block: dict[str, Any] = {"group_size": group, "bits": bits, "mode": mode}
    for name, (g, b, md) in sorted(qmods.items()):
        if (g, b, md) != (group, bits, mode):
            block[name] = {"group_size": g, "bits": b, "mode": md}
    return block, sorted(qmods), sorted(dense)


def with_copies(block: dict | None, copies: dict[str, str]) -> dict | None:
    """A quantization block with each copied module's override (where its source has one)."""
    if not block:
        return block
    return {**block, **{c: block[s] for c, s in copies.items() if isinstance(block.get(s), dict)}}


def write_weights(
    net: nn.Module,
    folder: Path,
    max_shard: int = MAX_SHARD_BYTES,
    name: Callable[[str], str] = lambda k: k,
    copies: dict[str, str] | None = None,
    layout: Callable[[str, mx.array], mx.array] | None = None,
    regroup: Callable[[dict[str, mx.array]], dict[str, mx.array]] | None = None,
) -> list[str]:
    """The parameters as safetensors shards under `name(k)`; `copies` {module: source}: the
    source module's tensors written again under the copy's name; `layout(k, array)`: the
    array as written; `regroup(params)`: the tensors as the reader expects them grouped."""
    params = dict(tree_flatten(net.parameters()))
    for mod, m in net.named_modules():  # an embedding's float16 scales held beside float32
        # compute (binding.kept_narrow) are written wide: other readers' lookups dequantize in
        # the scales' dtype
        if isinstance(m, nn.QuantizedEmbedding) and getattr(m, "_lookup_dtype", None) is not None:
            for part in ("scales", "biases"):
                v = params.get(f"{mod}.{part}")
                if v is not None and v.dtype == mx.float16:
                    params[f"{mod}.{part}"] = v.astype(m._lookup_dtype)
    if layout is not None:
        params = {k: layout(k, v) for k, v in params.items()}
    if regroup is not None:
        params = regroup(params)
    for copy, src in (copies or {}).items():
        params.update(
            {copy + k[len(src) :]: v for k, v in params.items() if k.startswith(src + ".")}
        )
    weights = {name(k): v for k, v in params.items()}
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name, arr in weights.items():
        if size and size + arr.nbytes > max_shard:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], {"format": "mlx"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        mx.save_safetensors(str(folder / fname), shard, {"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for a in weights.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return names + ["model.safetensors.index.json"]


def write_tokenizer(model: Model, folder: Path) -> None:
    """Tokenizer files: copied from a folder source; from a GGUF, built by transformers' own GGUF
    tokenizer conversion (the optional `convert` extra)."""
    src = model.path
    if src.is_dir():
        for name in (
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "added_tokens.json",
        ):
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)
        return
    _need_transformers(src)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    # AutoTokenizer picks the class from the model type, which it would first read from the
    # GGUF's config through gguf-py's reader of the whole file (for a 262k-token vocabulary
    # most of a conversion: 32 s of 40 here); the type we export names the same class, and the
    # files come out the same. A type with no class of its own gets the generic fast
    # tokenizer, as AutoTokenizer gives it.
    kind = family(model.config.family).export.model_type
    try:
        if TOKENIZER_MAPPING_NAMES.get(kind):
            tok = AutoTokenizer.from_pretrained(
                str(src.parent), gguf_file=src.name, tokenizer_type=kind
            )
        else:
            tok = PreTrainedTokenizerFast.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception:  # noqa: BLE001 — any failure of transformers' class-specific reading
        tok = PreTrainedTokenizerFast.from_pretrained(str(src.parent), gguf_file=src.name)
    if model.template is not None:
        tok.chat_template = model.template.text
    tok.save_pretrained(str(folder))


def _need_transformers(src: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise MlxlisError(
            "converting a GGUF needs transformers for its tokenizer files: "
            "pip install 'mlxlis[convert]'",
            path=src,
        )


def convert(
    source: str | Path,
    output: str | Path,
    *,
    dtype: str | None = None,
    dequantize: bool = False,
    force: bool = False,
    adapters: Sequence[str | Path] = (),
    adapter_scale: float = 1.0,
    merged: Callable[[str], None] | None = None,
) -> Path:
    """Convert `source` (GGUF file, folder or catalog name) into the folder `output`;
    `adapters` (LoRA folders) merged into its weights first, `merged` told how."""
    from mlxlis import load
    from mlxlis.loading.resolve import resolve

    output = Path(output).expanduser().resolve()
    if output.exists() and not force:
        raise MlxlisError("destination exists (use --force to replace it)", path=output)
    path = resolve(source)
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if is_gguf:
        _need_transformers(path)  # before any work: the tokenizer files are written last
    # GGUF blocks stay quantized unless asked; a folder's weights are written as stored
    model = load(
        path,
        dtype,
        dequantize=dequantize if is_gguf or dequantize else None,
        adapters=adapters,
        adapter_scale=adapter_scale,
        fuse=True,
    )
    if model.task != "generate":  # its folder is already what mlxlis and its users read
        raise UnsupportedError(
            f"converting an {model.task} model is not supported (load its folder as it is)",
            path=path,
            field="model",
        )
    if model.fused and merged is not None:
        merged(model.fused)
    if model.net.rope_freq_factors is not None:
        raise UnsupportedError(
            "rope_freqs (per-frequency RoPE factors stored as a tensor: Llama 3 scaling, "
            "Gemma 4's proportional RoPE) cannot be expressed in config.json yet",
            path=model.path,
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        export = family(model.config.family).export
        copies = export.copies(model.config) if export.copies else {}
        quant, qmods, dense = quantization_block(model.net)
        quant = with_copies(quant, copies)
        files = write_weights(
            model.net,
            tmp,
            name=export.name,
            copies=copies,
            layout=export.layout,
            regroup=export.regroup,
        )
        (tmp / "config.json").write_text(
            json.dumps(hf_config(model.config, model.dtype, quant), indent=2)
        )
        gen = {"bos_token_id": model.config.special.bos, "eos_token_id": sorted(model.stop_ids())}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        write_tokenizer(model, tmp)
        _verify(model, tmp)
        src_file = model.path if model.path.is_file() else None
        manifest = {
            "source": str(model.path),
            "source_sha256": sha256_file(src_file) if src_file else None,
            "dtype": str(model.dtype).replace("mlx.core.", ""),
            "quantized_modules": qmods,
            "dense_modules": dense,
            "adapters": [{"path": str(a.path), "scale": a.multiplier} for a in model.adapters],
            "adapters_merged": model.fused,
            "files": {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()},
        }
        (tmp / "mlxlis-manifest.json").write_text(json.dumps(manifest, indent=2))
        del files
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _verify(model: Model, folder: Path) -> None:
    """Reopen the written folder; its logits must equal the source model's exactly."""
    from mlxlis import load

    # a few positions use every weight (CPU products of quantized blocks are slow to run)
    ids = model.tokenizer.encode("Verification: the quick brown fox.")[:6] or [0]
    again = load(folder, model.dtype)
    a, b = model.logits(ids), again.logits(ids)
    if not bool(mx.array_equal(a, b)):
        delta = float(mx.abs(a - b).max())
        raise MlxlisError(
            f"written model does not reproduce the source (max |Δ| {delta})", path=folder
        )


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl+C until the block ends (main thread only), then raise it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: caught.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _publish(tmp: Path, output: Path) -> None:
    """Move the finished folder into place; an existing destination is swapped out and only
    deleted once the new one is in place (restored if the swap fails)."""
    if not output.exists():
        os.rename(tmp, output)
        return
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    with _sigint_deferred():
        os.rename(output, old)
        try:
            os.rename(tmp, output)
        except BaseException:
            os.rename(old, output)
            raise
    shutil.rmtree(old, ignore_errors=True)
