"""The app's only door into mlxlis: load a model, then chat (ChatSession) or complete raw text.

Everything the UI needs from the engine goes through `Engine`, built from an already loaded
model; tests build it around a fake model and a fake session factory / generate function.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlxlis
from mlxlis.api import LoadOptions
from mlxlis.errors import MlxlisError
from mlxlis.generation.context import fit_context
from mlxlis.generation.events import Event
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.session import Turn
from mlxlis.loading import catalog
from mlxlis.models.model import Model
from mlxlis.models.multimodal import PromptImage
from mlxlis.prompt.images import open_image
from mlxlis.runtime import process

from tui.store import data_dir

# a model that does not generate, in words
KINDS = {"embed": "an embedding model", "rerank": "a reranking model"}
Progress = Callable[[str, int, int], None]  # (stage, done, total), as catalog.pull reports


@dataclass
class Options(LoadOptions):
    """What `mlxlis chat` was asked for on the command line: how the model loads (the
    LoadOptions it is) and the chat's own options."""

    model: str = catalog.DEFAULT_MODEL
    system: str | None = None
    no_chat: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool | None = None  # --think / --no-think; None: the template's default
    speculative: str | None = None  # --speculative / --draft-model: "ngram" | "draft" | None
    draft_model: str | None = None
    draft_tokens: int | None = None
    draft: Model | None = None  # the draft model, once load_model loaded it


def parse_args(argv: list[str]) -> Options:
    """Options from `mlxlis chat`'s command line."""
    from mlxlis.commands.args import (
        add_model_args,
        add_sampling_args,
        add_speculative_args,
        add_thinking_args,
        check_thinking,
        sampling_params,
        speculative_flags,
    )

    p = argparse.ArgumentParser(
        prog="mlxlis chat", description="Chat with a model in the terminal."
    )
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="raw completion pad: text is fed as is, no chat template",
    )
    add_thinking_args(p)
    add_speculative_args(p)
    a = p.parse_args(argv)
    check_thinking(p, a)
    speculative_flags(p, a)
    return Options(
        model=a.model,
        dtype=a.dtype,
        dequantize=a.dequantize,
        chat_template=a.chat_template,
        system=a.system,
        no_chat=a.no_chat,
        sampling=sampling_params(p, a),
        bindings=a.bindings,
        strict=a.strict,
        thinking=a.thinking,
        speculative=a.speculative,
        draft_model=a.draft_model,
        draft_tokens=a.draft_tokens,
        kv_bits=a.kv_bits,
        kv_group_size=a.kv_group_size,
        mmproj=a.mmproj,
        adapters=tuple(a.adapter or ()),
        adapter_scale=a.adapter_scale,
        fuse=a.fuse,
    )


def model_names() -> list[str]:
    """The names `/model` takes from the disk: the catalog's pulled models and the Hugging
    Face cache's (what `mlxlis models` lists)."""
    from mlxlis.loading.hub.store import cached_models

    names = [n for n in catalog.CATALOG if catalog.is_pulled(n)]
    try:
        names += [e.name for e in cached_models()]
    except Exception:  # noqa: BLE001 — an unreadable cache lists nothing, /model NAME still works
        pass
    return names


@functools.cache
def model_names_cached() -> list[str]:
    """`model_names` read once, for Tab's completion (the disk is scanned on the first Tab)."""
    return model_names()


def load_model(options: Options, progress: Progress):
    """Pull a catalog model if it is not in the store yet, or fetch a Hugging Face repo the
    cache lacks (reporting progress: per file bytes, speed and ETA), then load it."""
    name = options.model
    if name in catalog.CATALOG and not Path(name).exists() and not catalog.is_pulled(name):
        catalog.pull(name, progress)
    elif name not in catalog.CATALOG and not Path(name).expanduser().exists():
        from mlxlis.loading.resolve import resolve

        vision = options.mmproj is not False  # --no-mmproj: a GGUF's mmproj not fetched
        name = str(resolve(name, progress=progress, vision=vision))  # a Hub repo, scanned name
    progress("loading weights", 0, 0)
    model = mlxlis.load(name, **options.kwargs())
    if model.task != "generate":  # an embedding or reranking model: nothing to chat with
        raise MlxlisError(
            f"{options.model} is {KINDS.get(model.task, 'not a chat model')}: the chat app needs "
            "a chat model "
            "(mlxlis embed, or mlxlis serve's /v1/embeddings and /v1/rerank, use it)",
            field="model",
        )
    if options.draft_model:  # --draft-model: fetched and loaded the same way
        draft = Options(**{**vars(options), "model": options.draft_model, "draft_model": None})
        draft.chat_template = draft.bindings = None
        draft.mmproj = False
        draft.adapters = ()
        progress("loading the draft model", 0, 0)
        options.draft = load_model(draft, progress)
    return model


class RawPad:
    """--no-chat: each text is fed as is (no template) and the continuation streamed back.

    Same surface as ChatSession (send, turns, reset, prompt_preview, context_*, save_cache),
    so the UI does not care which one it drives. Earlier turns are kept for display and saving
    only.
    """

    save_cache: Callable[[], bool] | None = None  # always: a raw pad keeps no cache for /save

    def __init__(self, model: Model, generate: Callable[..., Iterator] | None = None):
        self.model = model
        self.system: str | None = None
        self.turns: list[Turn] = []
        self.context_limit = model.context_length
        self.context_used = 0
        self.last_prompt_tokens = 0
        self._generate = generate or mlxlis.generate
        self.speculation = None  # --speculative: drafts verified in one forward
        self.thinking: bool | None = None  # always: no template, no thinking switch
        self.response_format: dict | None = None  # always: raw completion constrains nothing

    def reset(self) -> None:
        self.turns.clear()
        self.context_used = 0

    def set_system(self, text: str | None) -> None:
        self.system = text or None  # kept for the record; raw completion has no system role

    def prompt_preview(self, pending_user: str | None = None) -> str:
        return pending_user or ""

    def send(self, text: str, should_stop=None, **sampling) -> Iterator:
        ids = self.model.tokenizer.encode(text)
        sampling = dict(sampling)
        limited = fit_context(
            len(ids),
            SamplingParams().replace(**sampling),
            self.context_limit,
            hint="start over (/clear) or shorten the text",
        )
        sampling.pop("max_tokens", None)
        max_tokens = limited.max_tokens
        if self.speculation is not None:
            sampling["speculation"] = self.speculation
        self.last_prompt_tokens = len(ids)
        self.turns.append(Turn("user", text))
        out: list[str] = []
        final = None
        try:
            for ev in self._generate(
                self.model, ids, max_tokens=max_tokens, should_stop=should_stop, **sampling
            ):
                out.append(ev.text)
                if ev.finish_reason is not None:
                    final = ev
                yield ev
        finally:
            stopped = final is None or final.finish_reason == "cancelled"
            self.context_used = len(ids) + (final.stats.generated_tokens if final else 0)
            self.turns.append(Turn("assistant", "".join(out), stopped=stopped))


def default_session(model: Model, system: str | None) -> mlxlis.ChatSession:
    """A chat session whose caches /save keeps beside the saved conversations (what /open of
    the conversation then reads back instead of the prompt)."""
    return mlxlis.ChatSession(model, system=system, cache_dir=data_dir().parent / "caches")


class Engine:
    """One loaded model behind the operations the app performs."""

    def __init__(
        self,
        model: Model,
        options: Options,
        *,
        session_factory: Callable[[object, str | None], object] | None = None,
        generate: Callable[..., Iterator] | None = None,
    ):
        self.model = model
        self.raw = options.no_chat
        self.sampling = options.sampling.validate()
        if self.raw:
            self.session = RawPad(model, generate)
            self.session.set_system(options.system)
        else:
            self.session = (session_factory or default_session)(model, options.system)
            if options.thinking is not None:
                self.thinking = options.thinking
        self.info = {**model.describe(), **process.describe()}  # the model and what runs it
        self._turns_before = 0
        # what the next message carries: images (PromptImage, /image) and clips (/audio)
        self.attachments: list = []
        self._sent_attachments: list = []
        self.speculation = None
        if options.speculative is not None:  # the draft must speak the target's vocabulary
            from mlxlis.generation.speculative import Speculation, check_vocabulary

            if options.draft is not None:
                check_vocabulary(model, options.draft)
            self.speculation = Speculation(options.speculative, options.draft, options.draft_tokens)
            self.session.speculation = self.speculation

    # --- what the header shows ---
    @property
    def template_source(self) -> str | None:
        return self.model.template_source

    @property
    def blocked(self) -> bool:
        """Chat mode on a model without a chat template: refuse to send."""
        return not self.raw and self.template_source is None

    def diagnosis(self) -> str:
        return self.model.missing_template_diagnosis()

    def header(self) -> str:
        i = self.info
        fmt = " ".join(x for x in (i.get("format"), i.get("quant")) if x)
        parts = [
            i.get("model", "?"),
            i.get("family", "?"),
            fmt,
            i.get("dtype", "?"),
            i.get("device", "?"),
        ]
        if self.raw:
            tail = "RAW COMPLETION (--no-chat): text is fed as is, no chat template"
        else:
            tail = f"template: {self.template_source or 'NONE — chat disabled'}"
        if i.get("notice"):  # a slow CPU path is worth saying where the user looks
            tail += f"\nslow BLAS: {i['notice']}"
        return " · ".join(p for p in parts if p) + "\n" + tail

    # --- the conversation ---
    @property
    def system(self) -> str | None:
        return self.session.system

    def set_system(self, text: str | None) -> None:
        self.session.set_system(text)

    @property
    def turns(self) -> list:
        return self.session.turns

    @property
    def context(self) -> tuple[int, int]:
        return self.session.context_used, self.session.context_limit

    def streaming_context(self, generated: int) -> int:
        return self.session.last_prompt_tokens + generated

    # --- reasoning models ---
    @property
    def thinking_supported(self) -> bool:
        """The chat template has a thinking switch (prompt/thinking_switch.py)."""
        return not self.raw and self.model.supports_thinking

    @property
    def thinking(self) -> bool | None:
        return self.session.thinking

    @thinking.setter
    def thinking(self, value: bool | None) -> None:
        self.session.thinking = value

    @property
    def response_format(self) -> dict | None:
        """What the next replies are constrained to (/json), None: free."""
        return self.session.response_format

    @response_format.setter
    def response_format(self, value: dict | None) -> None:
        self.session.response_format = value

    def thinking_label(self) -> str:
        return {True: "on", False: "off", None: "default"}[self.thinking]

    def attach(self, path: str):
        """An image for the next message (`/image PATH`), opened and preprocessed now: its
        PromptImage and the opened image (to draw); MlxlisError for a bad image, raw
        completion or a model that does not see."""
        if self.raw:
            raise MlxlisError("raw completion takes no images (chat mode does)", field="/image")
        field = f"/image {path}"
        if self.model.vision is None:  # said before the file is read
            raise MlxlisError(self.model.text_only_reason(), field=field)
        opened = open_image(Path(path).expanduser(), field)
        image = self.model.prepare_image(opened, field, Path(path).name)
        self.attachments.append(image)
        return image, opened

    def attach_audio(self, path: str) -> Clip:
        """A clip for the next message (`/audio PATH`), decoded, resampled and turned into
        the model's features now; MlxlisError for bad audio, raw completion or a model that
        does not hear."""
        field = f"/audio {path}"
        if self.raw:
            raise MlxlisError("raw completion takes no audio (chat mode does)", field="/audio")
        hearing = self.model.hearing
        if hearing is None:  # said before the file is read
            raise MlxlisError(f"{self.model.name} takes no audio", field=field)
        prepared = hearing.prepare_audio(str(Path(path).expanduser()), field, Path(path).name)
        clip = Clip(prepared, prepared.size[0] / hearing.rate)  # size: (samples at its rate, 1)
        self.attachments.append(clip)
        return clip

    def _parts(self) -> list[dict]:
        return [
            {"type": "audio", "audio": a.prepared, "seconds": a.seconds}
            if isinstance(a, Clip)
            else {"type": "image", "image": a}
            for a in self.attachments
        ]

    def send(self, text: str, should_stop: Callable[[], bool]) -> Iterator[Event]:
        """The reply's events, each split into reasoning and answer (all answer when the
        session does not split); the attached images go first in the message."""
        self._turns_before = len(self.session.turns)
        content: str | list[dict] = text
        if self.attachments:
            content = self._parts()
            content.append({"type": "text", "text": text})
        self._sent_attachments, self.attachments = self.attachments, []
        return self.session.send(content, should_stop=should_stop, **self.sampling.as_dict())

    def rollback(self) -> None:
        """Undo the last send when it failed before producing anything, so the text can be
        sent again (ChatSession already dropped its cache state for an unfinished stream)."""
        del self.session.turns[self._turns_before :]
        self.attachments = self._sent_attachments + self.attachments  # sent again with it

    def preview(self, pending: str | None = None) -> str:
        """The prompt the next message gives: `pending` with the attached images first."""
        if self.attachments and not self.raw:
            parts = self._parts()
            return self.session.prompt_preview([*parts, {"type": "text", "text": pending or ""}])
        return self.session.prompt_preview(pending)

    def count_tokens(self, text: str) -> int:
        return len(self.model.tokenizer.encode(text, special=not self.raw))

    def reset(self) -> None:
        self.session.reset()

    def restore(self, record: dict) -> None:
        """A fresh conversation holding a saved record's turns (the cache is rebuilt lazily)."""
        self.session.reset()
        self.session.set_system(record.get("system"))
        self.session.turns.extend(
            Turn(t["role"], t.get("content", ""), bool(t.get("stopped")), _reasoning(t))
            for t in record["turns"]
            if t.get("role") in ("user", "assistant")
        )

    def record(self, rec_id: str) -> dict:
        mode = "raw" if self.raw else "chat"
        return {
            "id": rec_id,
            "model": self.info.get("model"),
            "mode": mode,
            "template": self.template_source,
            "system": self.system,
            "sampling": self.sampling.as_dict(),
            "turns": [_turn_record(t) for t in self.session.turns],
        }


def _turn_record(turn: Turn) -> dict:
    """A turn as saved: its text; a message's images by name and size only, its clips by
    name and duration (a reopened conversation has their description, not the media)."""
    content = turn.content
    if isinstance(content, list):
        content = "\n".join(_part_line(p) for p in content)
    rec = {"role": turn.role, "content": content, "stopped": turn.stopped}
    if turn.reasoning is not None:
        rec["reasoning"] = turn.reasoning
    return rec


@dataclass(frozen=True)
class Clip:
    """An attached audio clip: its prepared features and its duration in seconds."""

    prepared: PromptImage
    seconds: float


def _part_line(part: dict) -> str:
    if part.get("type") == "image":
        return attachment_line(part["image"])
    if part.get("type") == "audio":
        return attachment_line(Clip(part["audio"], part["seconds"]))
    return part.get("text", "")


def attachment_line(attached: PromptImage | Clip) -> str:
    """How an attachment shows in the conversation: an image's name and size, a clip's
    name and duration."""
    if isinstance(attached, Clip):
        return f"[audio: {attached.prepared.name}, {attached.seconds:.1f} s]"
    w, h = attached.size
    return f"[image: {attached.name}, {w} x {h}]"


def _reasoning(turn: dict) -> str | None:
    value = turn.get("reasoning")
    return value if isinstance(value, str) else None
