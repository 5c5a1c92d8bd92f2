"""The loaded model: network + config + tokenizer + chat template, behind the public API."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxlis.cache import Cache, KVFormat
from mlxlis.cache.store import KVChoice, resolve
from mlxlis.errors import (
    AdapterError,
    ContextLimitError,
    MlxlisError,
    NoChatTemplateError,
    UnsupportedError,
)
from mlxlis.loading.adapters import Adapter
from mlxlis.loading.hub import display_name
from mlxlis.models import lora
from mlxlis.models.config import ModelConfig
from mlxlis.models.embedding import Embedder
from mlxlis.models.experts import QuantizedSwitchLinear, SwitchLinear
from mlxlis.models.multimodal import (
    CachedVision,
    Hearing,
    ImageSpan,
    Inserts,
    Prompt,
    PromptImage,
    Vision,
    image_spans,
)
from mlxlis.models.network import Network
from mlxlis.models.placement import Share
from mlxlis.prompt.audio import part_source
from mlxlis.prompt.images import ImageError, open_image
from mlxlis.prompt.template import ChatTemplate, diagnose_missing_template, end_of_turn_tokens
from mlxlis.prompt.thinking_switch import has_thinking_switch, thinking_vars
from mlxlis.tokenizer import Tokenizer

import mlx.core as mx
import mlx.nn as nn

# skipped tensors that are a vision tower's (a multimodal folder read text only)
VISION_NAMES = ("vision_tower.", "model.vision_tower.", "model.visual.", "visual.", "embed_vision.")
VISION_NAMES += ("model.embed_vision.", "multi_modal_projector.", "model.multi_modal_projector.")
VISION_NAMES += ("vision_model.",)


class Model:
    def __init__(
        self,
        config: ModelConfig,
        net: Network,
        tokenizer: Tokenizer,
        *,
        dtype: mx.Dtype,
        path: Path,
        fmt: str,
        template: ChatTemplate | None = None,
        quant_summary: str = "",
        diagnosis: str | None = None,
        skipped: list[str] | None = None,
        part: Share | None = None,
        vision: Vision | None = None,
        sees: bool = False,
        task: str = "generate",
        embedder: Embedder | None = None,
    ):
        self.config = config
        self.net = net
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.path = Path(path)
        self.format = fmt
        self.template = template
        self.quant_summary = quant_summary or _quant_summary(net)
        self._diagnosis = diagnosis
        self.adapters: list[Adapter] = []  # LoRA adapters applied, in order (api.load)
        self.fused: str | None = None  # how they were merged into the weights (lora.fuse)
        # LoRA adapters a request may choose (select_adapter), by name: lane i is the i-th
        self.selectable: dict[str, Adapter] = {}
        self.skipped = sorted(skipped or [])  # file tensors not used (a vision tower, an MTP head)
        self.part = part  # this rank's share of the layers when pipelined, else None
        self.kv_format: KVFormat | None = None  # quantized KV caches (set_kv_format), or dense
        self.vision = vision  # how it sees images (multimodal.Vision), None: text only
        self.sees = sees  # its family has a vision tower (Family.vision), loaded or not
        # "generate" (a decoder), "embed" (vectors: embed) or "rerank" (scores: rerank)
        self.task = task
        self.embedder = embedder  # an encoder's tokenizer, pooling and head (embedding.py)

    @property
    def name(self) -> str:
        return display_name(self.path) or self.path.name  # a Hub snapshot: its repo's name

    @property
    def template_source(self) -> str | None:
        return self.template.source if self.template is not None else None

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def rank(self) -> int:
        """This process's rank when the model runs pipelined under a launcher, else 0."""
        return self.part.rank if self.part is not None else 0

    def _encoder(self, task: str) -> Embedder:
        """The embedder when this model does `task`, else UnsupportedError saying what it is."""
        if self.task != task or self.embedder is None:
            what = {"generate": "a generative (chat) model", "embed": "an embedding model"}
            kind = what.get(self.task, "a reranking model")
            does = "embed texts" if task == "embed" else "rerank documents"
            raise UnsupportedError(f"{self.name} is {kind}: it does not {does}", field="model")
        return self.embedder

    def embed(
        self,
        texts: Sequence[str | Sequence[int]],
        *,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        truncate: bool = True,
    ) -> mx.array:
        """(len(texts), d) float32 vectors of an embedding model, as its files say to pool,
        project and normalise them. `texts`: strings, or lists of token ids taken as they are
        (special tokens included). `dimensions`: the first d values (Matryoshka), renormalised
        when the model normalises. `prompt_name`: a prompt from the model's
        config_sentence_transformers.json put before each text (default: its
        default_prompt_name). An input longer than the model's maximum is cut when `truncate`,
        else refused (MlxlisError, field "input[i]")."""
        return self._encoder("embed").embed(
            texts, dimensions=dimensions, prompt_name=prompt_name, truncate=truncate
        )

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> list[float]:
        """A reranker's relevance score of each document to `query`, in the documents' order: a
        cross-encoder's sigmoid of its logit (as sentence-transformers' CrossEncoder.predict
        gives), a causal LM loaded with task="rerank" its p(yes) (models/decoder_rerank.py),
        its prompt stating `instruction` (default: Qwen3-Reranker's web search task)."""
        return self._encoder("rerank").rerank(
            query, documents, truncate=truncate, instruction=instruction
        )

    def make_cache(self, kv: KVChoice = "model") -> list[Cache]:
        """Fresh caches of one sequence, in the model's KV format or the one `kv` names."""
        return self.net.make_cache(resolve(kv, self.kv_format))

    def check_kv(self, kv: KVChoice) -> None:
        """MlxlisError (naming the field) where `kv`'s groups do not divide a head dimension."""
        try:
            self.net.make_cache(resolve(kv, self.kv_format))  # checks; allocates nothing
        except MlxlisError as e:
            message = str(e).removeprefix(f"{e.field}: ")
            raise MlxlisError(message, path=self.path, field=e.field) from None

    def cache_key(self) -> str:
        """Names the caches this model makes: its file (path, size, modification time), dtype
        and weight form — a cache saved under another key is not this model's (each saved
        cache also says its KV format)."""
        try:
            st = self.path.stat()
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            stamp = "?"
        adapters = ",".join(a.key for a in self.adapters)  # another adapter: another model
        if self.fused:  # merged weights round differently from the unmerged sum
            adapters += f"|fused {self.fused}"
        key = f"{self.path}|{stamp}|{self.dtype}|{self.quant_summary}|{adapters}"
        return "kv_" + hashlib.sha256(key.encode()).hexdigest()[:16]

    def select_adapter(
        self, name: str, adapter: Adapter, names: lora.Names, undo: lora.Undo | None = None
    ) -> None:
        """`adapter` made choosable per request as `name` (lora.select: rows on different
        adapters share one forward), its module names mapped by `names` and its tensors put
        in this network's layout by `undo` (lora.naming). Checked whole first: an
        AdapterError leaves the model as it was."""
        if name in self.selectable:
            raise AdapterError(f"an adapter named {name!r} is selectable already", field=name)
        if self.part is not None:
            raise UnsupportedError("adapters on a pipelined model", field="adapters")
        lora.select(self.net, adapter, names, self.dtype, undo)
        self.selectable[name] = adapter

    def lane(self, name: str | None, scale: float = 1.0) -> tuple[int, float, str]:
        """The adapter a request names (None: none): its lane (-1: none), its scale
        multiplier, and the tag its caches are kept under ("": the base's; a prefix cached
        under one adapter or scale is never taken under another)."""
        if name is None:
            return -1, 1.0, ""
        adapter = self.selectable.get(name)
        if adapter is None:
            known = ", ".join(self.selectable) or "none"
            why = f"no adapter {name!r} on this model (it has: {known})"
            raise MlxlisError(why, field="adapter")
        if not math.isfinite(scale) or scale < 0:
            why = f"an adapter's scale must be 0 or above, not {scale}"
            raise MlxlisError(why, field="adapter")
        if scale == 0.0:  # its delta scaled to nothing: the base
            return -1, 1.0, ""
        lane = list(self.selectable).index(name)
        return lane, scale, f"{adapter.key}*{scale!r}"

    def set_kv_format(self, kv: KVFormat | None) -> None:
        """Store every request's keys and values quantized in `kv` from now on (None: dense);
        refused (MlxlisError) where the groups do not divide a head dimension."""
        self.check_kv(kv)
        self.kv_format = kv

    def logits(self, ids: Sequence[int], images: Sequence[PromptImage] = ()) -> mx.array:
        """[len(ids), vocab] float32 logits of one full forward pass, no cache (pipelined:
        on the last rank; the others return their hidden states, passed on). `images`: the
        preprocessed images whose placeholder runs `ids` hold (`encode_chat`'s prompt)."""
        if self.task != "generate":
            raise UnsupportedError(
                f"{self.name} is an encoder ({self.task}): it has no logits; use model.{self.task}",
                field="model",
            )
        inputs = mx.array([list(ids)], dtype=mx.int32)
        spans = self.image_spans(ids, images)
        if not spans:
            return self.net(inputs)[0].astype(mx.float32)
        parts = [(s.start, self.image_features(s.image)) for s in spans]
        inserts = self.inserts(parts, spans, 0, len(ids))
        return self.net(inputs, inserts=inserts)[0].astype(mx.float32)

    def inserts(
        self, parts: list[tuple[int, mx.array]], spans: Sequence[ImageSpan], at: int, n: int
    ) -> Inserts:
        """What a forward over the prompt's ids [at, at + n) takes beside them: the features
        of the images it holds (`parts`: offset in the chunk, features) and, where the family
        needs them, its explicit RoPE positions."""
        v = self.vision
        pos = v.positions(spans, at, n)
        return Inserts(parts, v.fill_id, v.bidirectional, pos)

    # --- images ---
    def image_spans(
        self, ids: Sequence[int], images: Sequence[PromptImage]
    ) -> tuple[ImageSpan, ...]:
        """Each image's placeholder run in `ids`; an MlxlisError where the model takes no
        images or the runs and the images do not pair up (multimodal.image_spans)."""
        if self.vision is None:
            if images:
                raise UnsupportedError(self.text_only_reason(), path=self.path, field="images")
            return ()
        if self.part is not None and not self.part.sees and images:
            raise UnsupportedError(
                "images with a model pipelined across ranks are not supported", field="images"
            )
        return image_spans(ids, images, self.vision.image_token_id)

    def image_features(self, image: PromptImage) -> mx.array:
        """(tokens per image, hidden) embeddings of `image` (a loader's tower keeps the last
        few: multimodal.CachedVision)."""
        if self.vision is None:
            raise UnsupportedError(self.text_only_reason(), path=self.path, field="images")
        return self.vision.features(image)

    def prepare_image(self, source: Any, field: str = "image", name: str = "") -> PromptImage:
        """`source` (a path, bytes or a PIL image) opened and preprocessed for this model; an
        ImageError naming `field` for a bad image, UnsupportedError for a text-only model."""
        if isinstance(source, PromptImage):
            return source  # prepared already (a chat's earlier turn)
        if self.vision is None:
            raise UnsupportedError(self.text_only_reason(), path=self.path, field=field)
        image = open_image(source, field)
        if not name:
            name = Path(source).name if isinstance(source, (str, Path)) else "image"
        try:
            return self.vision.prepare(image, name)
        except MlxlisError as e:  # an image the processor cannot take (an aspect ratio past 200)
            raise ImageError(e.message, field=field) from None

    def image_part(self, part: Any, field: str) -> PromptImage | None:
        """A content part's image ({"type": "image", "image" | "path": ...}) prepared, None
        for another part; MlxlisError naming `field` for a bad one."""
        if not (isinstance(part, dict) and part.get("type") == "image"):
            return None
        source = part.get("image", part.get("path"))
        if source is None:
            raise MlxlisError("an image part needs its image", field=field)
        return self.prepare_image(source, field, part.get("name", ""))

    @property
    def hearing(self) -> Hearing | None:
        """The model's audio part (multimodal.Hearing), None where it hears nothing."""
        v = self.vision
        tower = v.tower if isinstance(v, CachedVision) else v
        return tower if isinstance(tower, Hearing) else None

    def audio_part(self, part: Any, field: str) -> PromptImage | None:
        """A content part's audio (prompt.audio.part_source's forms) prepared, None for
        another part or where the model hears nothing; MlxlisError naming `field`."""
        source = part_source(part, field) if self.hearing is not None else None
        if source is None or isinstance(source, PromptImage):
            return source  # not audio, or prepared already (a chat's earlier turn)
        return self.hearing.prepare_audio(source, field, part.get("name", ""))

    def text_only_reason(self) -> str:
        """Why this model takes no images, in words."""
        if self.part is not None and not self.part.sees:
            return "images with a model pipelined across ranks are not supported"
        if any(n.startswith(VISION_NAMES) or ".vision" in n for n in self.skipped):
            if not self.sees:
                return f"{self.name}'s vision tower is not implemented: text only"
            return (
                f"{self.name}'s vision tower is not loaded (it needs the image processor's "
                "settings beside it, preprocessor_config.json): text only"
            )
        if self.format == "gguf" and self.sees:
            return (
                f"{self.name} is loaded text only: a GGUF's vision tower is llama.cpp's mmproj "
                "file (--mmproj FILE, or one beside the model)"
            )
        return f"{self.name} is a text-only model: it takes no images"

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        max_image_tokens: int | None = None,
        **template_vars: Any,
    ) -> Prompt:
        """`messages` rendered, each image expanded into its placeholders as the processor
        does, and tokenized: the ids and the preprocessed images. An image is a content part
        {"type": "image", "image": PATH | bytes | PIL.Image | PromptImage}; a bad one is an
        ImageError naming its part (messages[i].content[j]), and so is the one whose
        placeholders pass `max_image_tokens` in all (a ContextLimitError: the images after it
        are not read)."""
        images: list[PromptImage] = []
        spent = 0
        shown = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                shown.append(m)
                continue
            parts = []
            for j, part in enumerate(content):
                field = f"messages[{i}].content[{j}]"
                image = self.image_part(part, field)
                if image is None:
                    image = self.audio_part(part, field)
                if image is not None:
                    spent += sum(run.tokens for run in image.runs())
                    if max_image_tokens is not None and spent > max_image_tokens:
                        raise ContextLimitError(
                            f"the images up to this one take {spent} tokens, more than the "
                            f"context's {max_image_tokens}: send fewer or smaller images",
                            field=field,
                        )
                    images.append(image)
                    # the template writes the marker only
                    part = {"type": "audio" if self.hearing is not None else "image"}
                parts.append(part)
            shown.append({**m, "content": parts})
        text = self.render_chat(shown, add_generation_prompt, **template_vars)
        if images:
            markers = self.vision.marker_count(text)
            if markers != len(images):
                raise MlxlisError(
                    f"the chat template wrote {markers} image markers for {len(images)} "
                    "images (an image where the template does not take one?)",
                    field="messages",
                )
            text = self.vision.expand(text, images)
        ids = self.tokenizer.encode(text, special=True)
        runs = tuple(run for image in images for run in image.runs())  # pan and scan's crops
        sources = tuple(k for k, image in enumerate(images) for _ in image.runs())
        self.image_spans(ids, runs)  # the runs pair up with the images
        return Prompt(ids, runs, text, sources)

    def stop_ids(self) -> set[int]:
        """EOS ids from config and tokenizer, plus the template's end-of-turn tokens; in a
        harmony vocabulary (gpt-oss: <|return|> and <|call|> end a reply) <|end|> only ends
        a message and more follow, so it is not one (llama.cpp's o200k_harmony rule)."""
        ids = set(self.config.special.eos) | set(self.tokenizer.stop_ids)
        if self.template is not None:
            ids |= set(end_of_turn_tokens(self.template.text, self.tokenizer.special_tokens))
        special = self.tokenizer.special_tokens
        if "<|return|>" in special and "<|call|>" in special and "<|end|>" in special:
            ids.discard(special["<|end|>"])
            ids |= {special["<|return|>"], special["<|call|>"]}
        return ids

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (empty without a template)."""
        return self.template.variables if self.template is not None else frozenset()

    @property
    def supports_thinking(self) -> bool:
        """The chat template has a thinking switch (`enable_thinking`, `thinking_budget`,
        `reasoning_effort`, ...: mlxlis.prompt.thinking_switch)."""
        return self.template is not None and has_thinking_switch(self.template)

    def thinking_vars(self, on: bool) -> dict[str, Any]:
        """The template variables that turn the chat template's thinking on or off (empty
        without a switch)."""
        return thinking_vars(self.template, on) if self.template is not None else {}

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """The prompt text for `messages`; `template_vars` reach the template as variables
        (e.g. enable_thinking=False)."""
        if self.template is None:
            raise NoChatTemplateError(self.missing_template_diagnosis(), path=self.path)
        self._refuse_unread_parts(messages)
        tok = self.tokenizer
        return self.template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            **template_vars,
        )

    def _refuse_unread_parts(self, messages: list[dict]) -> None:
        """UnsupportedError naming the first content part this model cannot read: a template
        renders an audio part as its marker token (Gemma 3n's, Gemma 4's) though the tower that
        would hear it is not loaded, and the reply would pretend it heard nothing."""
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("text", "image"):
                    continue
                if kind in ("audio", "input_audio"):
                    if self.hearing is not None:
                        continue
                    towers = any("audio" in n for n in self.skipped)
                    why = "its audio tower is not loaded" if towers else "it takes no audio"
                    message = f"{self.name} cannot hear this audio part: {why}"
                else:
                    message = f"only text and image parts are read, not {kind!r}"
                raise UnsupportedError(message, field=f"messages[{i}].content[{j}].type")

    def missing_template_diagnosis(self) -> str:
        if self._diagnosis is not None:
            return self._diagnosis
        return diagnose_missing_template(
            model_name=self.name,
            folder=self.path if self.path.is_dir() else None,
            gguf_metadata=None,
        )

    def describe(self) -> dict[str, str]:
        """The model, in words (what the process runs it on: runtime.process.describe)."""
        details = {
            "model": self.name,
            "family": self.config.family,
            "format": self.format,
            "quant": self.quant_summary,
            "dtype": str(self.dtype).replace("mlx.core.", ""),
            "template": self.template_source or "none",
        }
        if self.task != "generate":
            details["task"] = self.task  # an encoder: embed or rerank, no chat
        if self.adapters:
            details["adapters"] = "; ".join(a.describe() for a in self.adapters)
            if self.fused:
                details["adapters"] += f" — in the weights: {self.fused}"
        if self.vision is not None:
            details["audio" if self.hearing is not None else "vision"] = self.vision.describe()
        if self.skipped:
            details["skipped"] = skipped_summary(self.skipped, self.vision is None)
        if self.part is not None:
            details["ranks"] = self.part.describe()  # its share: layers, or a slice of each
        return details


def skipped_summary(names: list[str], text_only: bool = True) -> str:
    """'N tensors not used (prefix.*, ...)': what a load left out of the file."""
    groups = sorted({".".join(n.split(".")[:2]) + ".*" for n in names})
    shown = ", ".join(groups[:4]) + (f", +{len(groups) - 4} more" if len(groups) > 4 else "")
    return f"{len(names)} tensors not used ({shown})" + (": text only" if text_only else "")


def _quant_summary(net: nn.Module) -> str:
    counts: dict[str, int] = {}
    for _, m in net.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            mode = getattr(m, "mode", "affine")
            key = mode if mode != "affine" else f"{m.bits}-bit g{m.group_size}"
        elif isinstance(m, (nn.Linear, nn.Embedding, SwitchLinear)):
            key = "dense"
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k}×{v}" for k, v in sorted(counts.items())) or "dense"
