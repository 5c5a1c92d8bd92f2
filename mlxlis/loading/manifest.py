"""Binding manifests: which checkpoint tensor feeds which model parameter.

Parameter paths are the family modules' names, which equal the Hugging Face names
(`model.embed_tokens.weight`, `model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...).
A manifest maps some of them to tensor keys; a parameter the manifest does not name binds to
the tensor of the same name. Without a manifest every parameter binds by name.

Two forms, one meaning (both accepted as JSON or YAML):

* flat: ``{"model.embed_tokens.weight": "transformer.wte.weight", ...}``: expanded paths
  to keys in the model folder's safetensors (model.safetensors, the index's shards, or every
  ``*.safetensors``);
* rich (YAML)::

      sources:
        main: {type: safetensors, files: "weights-*.safetensors"}
      bindings:
        "model.embed_tokens.weight": {source: main, key: "transformer.wte.weight"}
        "model.layers.{i}.self_attn.q_proj.weight":
          source: main
          key: "transformer.h.{i}.attn.q.weight"

  `sources` (optional) names safetensors file sets; `files` is a glob or a list of globs,
  relative to the manifest's folder (the model folder for a manifest passed as a dict), never
  absolute or climbing with `..`, matching only `.safetensors` files; without `files` a source
  is the model folder's weights. With no `sources` there is one, `model`: the model folder.
  A binding is `{source, key}` (`source` defaults to the first source) or just the key.
  Parameters the manifest does not name bind by name in the first source.

`{i}` in a path stands for every layer index 0..num_hidden_layers-1 and is replaced by the
same index in the key. There is no other placeholder, no arithmetic, no condition, no
transformation: manifests are not programs. Unknown fields, tags, anchors, aliases,
duplicate keys and non-string keys are refused; so are manifests past the size,
nesting and count limits of `limits.py`.

Validation, all from the safetensors headers and the model's parameter table, before
any tensor is read: every parameter bound to a tensor that exists; no parameter bound twice;
no tensor bound to two parameters, except the embedding and the output head
(`model.embed_tokens.*` and `lm_head.*`) of an untied model, which may share one tensor (a
checkpoint that stores the shared matrix once); rank and every dimension equal to the
parameter's; float tensors (F32/F16/BF16) for float parameters and the exact integer dtype for
packed quantized weights, whose `weight`, `scales` (and `biases`) must be bound together;
and no tensor left over: strict (the default) makes leftovers an error, lenient reports them
with an `UnboundTensorsWarning` and in `BindingPlan.unbound`. Always ignored: unbound
`*.rotary_emb.inv_freq` tensors (recomputed), and in a tied model an unbound `lm_head.*`
copy. Every failure is a `BindingError` subclass naming the parameter, the key, what was
expected and what was found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from mlxlis import limits
from mlxlis.bounded import count_nodes, depth_exceeds, loads_json, read_bytes
from mlxlis.errors import (
    BindingError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedError,
)

# ---------------------------------------------------------------- errors


class ManifestError(BindingError):
    """The manifest itself is malformed: syntax, tags, anchors, unknown fields, limits."""


class UnknownParameterError(BindingError):
    """The manifest binds a parameter the model does not have."""


class BindingMissingError(BindingError, MissingTensorError):
    """A parameter's tensor is not in its source."""


class DuplicateBindingError(BindingError):
    """One parameter bound twice, or one tensor bound to two parameters."""


class BindingShapeError(BindingError, ShapeMismatchError):
    """Rank or a dimension differs from the parameter's."""


class BindingDtypeError(BindingError):
    """A tensor's dtype cannot feed the parameter (int for float, wrong packed type)."""


class QuantTripletError(BindingError):
    """A quantized weight without its scales / biases, or scales without their weight."""


class UnexpectedBindingError(BindingError, UnexpectedTensorError):
    """Strict mode: source tensors no parameter takes."""


class UnboundTensorsWarning(UserWarning):
    """Lenient mode: source tensors no parameter takes (listed in `.tensors`)."""

    def __init__(self, message: str, tensors: list[tuple[str, str]]):
        super().__init__(message)
        self.tensors = tensors


# ---------------------------------------------------------------- the manifest

DEFAULT_SOURCE = "model"
INDEX = "{i}"
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")
_RICH_KEYS = ("sources", "bindings")
_SOURCE_KEYS = ("type", "files")
_BINDING_KEYS = ("source", "key")
_TIED = ("model.embed_tokens.", "lm_head.")
_QUANT_PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    files: tuple[str, ...] | None  # globs; None: the model folder's weights


@dataclass(frozen=True)
class Manifest:
    """A parsed, schema-checked manifest (templates not yet expanded)."""

    entries: tuple[tuple[str, str, str], ...]  # (path template, source name, key template)
    sources: tuple[SourceSpec, ...]  # the first one is the default source
    origin: str | None  # the file errors name; None for the implicit identity manifest
    base: Path | None  # folder the globs are relative to; None: the model folder

    @property
    def default_source(self) -> str:
        return self.sources[0].name


IDENTITY = Manifest((), (SourceSpec(DEFAULT_SOURCE, None),), None, None)


def as_manifest(bindings: Any) -> Manifest:
    """None (bind by name), a manifest file path, or a manifest as a dict."""
    if bindings is None:
        return IDENTITY
    if isinstance(bindings, Manifest):
        return bindings
    if isinstance(bindings, (str, Path)):
        return read_manifest(bindings)
    if isinstance(bindings, dict):
        origin = "<bindings dict>"
        if depth_exceeds(bindings, limits.MANIFEST_MAX_DEPTH):
            raise ManifestError(
                f"nested deeper than {limits.MANIFEST_MAX_DEPTH} levels", path=origin
            )
        if count_nodes(bindings, limits.MANIFEST_MAX_NODES) > limits.MANIFEST_MAX_NODES:
            raise ManifestError(f"more than {limits.MANIFEST_MAX_NODES} values", path=origin)
        return manifest_from_data(bindings, origin=origin, base=None)
    raise ManifestError(
        f"bindings must be a file path or a dict, not {type(bindings).__name__}",
        path="<bindings>",
    )


def read_manifest(path: str | Path) -> Manifest:
    """Parse a manifest file: .json as JSON, .yaml/.yml as safe YAML, otherwise by content."""
    path = Path(path).expanduser()
    raw = read_bytes(path, limits.MANIFEST_MAX_BYTES, ManifestError, "binding manifest")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"not UTF-8 (byte {e.start})", path=path) from None
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix not in (".yaml", ".yml") and text.lstrip()[:1] == "{"):
        data = parse_json(text, str(path))
    else:
        data = parse_yaml(text, str(path))
    return manifest_from_data(data, origin=str(path), base=path.parent)


def parse_json(text: str, origin: str) -> Any:
    data = loads_json(
        text,
        path=origin,
        error=ManifestError,
        max_depth=limits.MANIFEST_MAX_DEPTH,
        unique_keys=True,
        strict_numbers=True,
    )
    if count_nodes(data, limits.MANIFEST_MAX_NODES) > limits.MANIFEST_MAX_NODES:
        raise ManifestError(f"more than {limits.MANIFEST_MAX_NODES} values", path=origin)
    return data


_UNSET = object()


def parse_yaml(text: str, origin: str) -> Any:
    """The safe YAML subset, built from parser events (no constructor ever runs):
    plain or quoted scalars, mappings with unique string keys, sequences; one document.
    Any tag (`!!python/...`, `!foo`, even `!!str`), anchor, alias or merge key is refused at
    the first event that carries it, so an anchor bomb costs nothing."""
    try:
        import yaml
        from yaml.resolver import Resolver
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise UnsupportedError("YAML manifests need PyYAML", path=origin) from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    resolver = Resolver()
    stack: list[list[Any]] = []  # [container, pending mapping key]
    root: Any = _UNSET
    documents = nodes = 0

    def fail(message: str, event: Any = None) -> ManifestError:
        mark = getattr(event, "start_mark", None)
        field = f"line {mark.line + 1}" if mark is not None else None
        return ManifestError(message, path=origin, field=field)

    def add(value: Any, event: Any, container: bool) -> None:
        nonlocal root
        if not stack:
            root = value
            return
        top = stack[-1]
        if isinstance(top[0], list):
            top[0].append(value)
        elif top[1] is _UNSET:
            if container:
                raise fail("mapping keys must be strings, not mappings or sequences", event)
            if not isinstance(value, str):
                raise fail(f"mapping keys must be strings, not {value!r}", event)
            if value in top[0]:
                raise fail(f"duplicate key {value!r}", event)
            top[1] = value
        else:
            top[0][top[1]] = value
            top[1] = _UNSET

    def scalar(event: Any) -> Any:
        value = event.value
        if len(value) > limits.MANIFEST_MAX_STRING:
            raise fail(
                f"a scalar of {len(value)} characters (limit {limits.MANIFEST_MAX_STRING})", event
            )
        if not event.implicit[0]:  # quoted: a string
            return value
        tag = resolver.resolve(yaml.ScalarNode, value, (True, False))
        if tag.endswith(":merge"):
            raise fail("merge keys (<<) are not allowed", event)
        if tag.endswith((":null", ":bool", ":int", ":float")):
            try:
                node = yaml.ScalarNode(tag, value)
                return yaml.constructor.SafeConstructor().construct_object(node)
            except (ValueError, OverflowError, yaml.YAMLError):
                return value
        return value  # str, and timestamps etc. kept as their text

    try:
        for event in yaml.parse(text, Loader=loader):
            nodes += 1
            if nodes > limits.MANIFEST_MAX_NODES:
                raise fail(f"more than {limits.MANIFEST_MAX_NODES} YAML nodes")
            if isinstance(event, yaml.AliasEvent):
                raise fail(f"aliases (*{event.anchor}) are not allowed in manifests", event)
            if getattr(event, "anchor", None) is not None:
                raise fail(f"anchors (&{event.anchor}) are not allowed in manifests", event)
            if isinstance(event, yaml.NodeEvent) and getattr(event, "tag", None) is not None:
                raise fail(
                    f"tag {event.tag!r} is not allowed (manifests hold only plain scalars, "
                    "mappings and sequences)",
                    event,
                )
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise fail("more than one YAML document", event)
            elif isinstance(event, yaml.ScalarEvent):
                add(scalar(event), event, False)
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                new: Any = {} if isinstance(event, yaml.MappingStartEvent) else []
                add(new, event, True)
                stack.append([new, _UNSET])
                if len(stack) > limits.MANIFEST_MAX_DEPTH:
                    raise fail(f"nested deeper than {limits.MANIFEST_MAX_DEPTH} levels", event)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                stack.pop()
    except yaml.YAMLError as e:
        raise ManifestError(f"invalid YAML ({_one_line(e)})", path=origin) from None
    except RecursionError:  # pragma: no cover - the event parser is iterative
        raise ManifestError("invalid YAML (nested too deeply)", path=origin) from None
    if root is _UNSET:
        raise ManifestError("empty manifest", path=origin)
    return root


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def manifest_from_data(data: Any, *, origin: str, base: Path | None) -> Manifest:
    """Check the schema of a parsed manifest (flat or rich form) and return it."""

    def fail(message: str, where: str | None = None) -> ManifestError:
        return ManifestError(message, path=origin, field=where)

    if not isinstance(data, dict):
        raise fail(
            f"a manifest is a mapping (JSON object / YAML mapping), not {type(data).__name__}"
        )
    for k in data:
        if not isinstance(k, str):
            raise fail(f"keys must be strings, not {k!r}")
    rich = any(k in data for k in _RICH_KEYS)
    if not rich:
        sources: tuple[SourceSpec, ...] = (SourceSpec(DEFAULT_SOURCE, None),)
        raw_bindings: dict = data
    else:
        unknown = sorted(set(data) - set(_RICH_KEYS))
        if unknown:
            raise fail(
                f"unknown field {unknown[0]!r} (a manifest has only {', '.join(_RICH_KEYS)})",
                unknown[0],
            )
        sources = _sources(data.get("sources"), fail)
        raw_bindings = data.get("bindings", {})
        if raw_bindings is None:
            raw_bindings = {}
        if not isinstance(raw_bindings, dict):
            raise fail(
                f"must be a mapping of parameter paths, not {_kind(raw_bindings)}", "bindings"
            )
    if len(raw_bindings) > limits.MANIFEST_MAX_BINDINGS:
        raise fail(f"{len(raw_bindings)} bindings (limit {limits.MANIFEST_MAX_BINDINGS})")
    names = [s.name for s in sources]
    entries = []
    for path, value in raw_bindings.items():
        _check_text(path, "parameter path", path, fail)
        if isinstance(value, str):
            source, key = names[0], value
        elif rich and isinstance(value, dict):
            bad = sorted(str(k) for k in value if k not in _BINDING_KEYS)
            if bad:
                raise fail(
                    f"unknown field {bad[0]!r} in a binding (a binding has only "
                    f"{', '.join(_BINDING_KEYS)}; manifests are not programs)",
                    path,
                )
            if "key" not in value:
                raise fail("binding lacks its `key`", path)
            key, source = value["key"], value.get("source", names[0])
            if not isinstance(source, str) or source not in names:
                raise fail(f"source {source!r} is not declared (sources: {', '.join(names)})", path)
        elif not rich and isinstance(value, dict):
            raise fail(
                "the flat form maps parameter paths to tensor-key strings; put "
                "{source, key} entries under `bindings:`",
                path,
            )
        else:
            raise fail(f"expected a tensor key string, found {_kind(value)}", path)
        _check_text(key, "tensor key", path, fail)
        if INDEX in key and INDEX not in path:
            raise fail(f"key {key!r} uses {INDEX} but the parameter path does not", path)
        entries.append((path, source, key))
    return Manifest(tuple(entries), sources, origin, base)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a sequence"
    return f"{type(value).__name__} {value!r}"[:80]


def _check_text(value: Any, what: str, where: str, fail: Any) -> None:
    if not isinstance(value, str) or not value:
        raise fail(f"{what} must be a non-empty string, found {_kind(value)}", where)
    if len(value) > limits.MANIFEST_MAX_STRING:
        raise fail(
            f"{what} of {len(value)} characters (limit {limits.MANIFEST_MAX_STRING})", where[:80]
        )
    if any(ord(c) < 32 for c in value):
        raise fail(f"{what} {value!r} holds a control character", where)
    rest = value.replace(INDEX, "")
    if "{" in rest or "}" in rest:
        raise fail(f"{what} {value!r}: the only placeholder is {INDEX} (no expressions)", where)


def _sources(raw: Any, fail: Any) -> tuple[SourceSpec, ...]:
    if raw is None:
        return (SourceSpec(DEFAULT_SOURCE, None),)
    if not isinstance(raw, dict) or not raw:
        raise fail(f"must be a non-empty mapping of source names, not {_kind(raw)}", "sources")
    if len(raw) > limits.MANIFEST_MAX_SOURCES:
        raise fail(f"{len(raw)} sources (limit {limits.MANIFEST_MAX_SOURCES})", "sources")
    out = []
    for name, spec in raw.items():
        where = f"sources.{name}"[:80]
        if not isinstance(name, str) or not _SOURCE_NAME.match(name) or len(name) > 128:
            raise fail(f"source name {name!r} must be letters, digits, '_', '.' or '-'", where)
        if not isinstance(spec, dict):
            raise fail(f"a source is a mapping with type and files, not {_kind(spec)}", where)
        bad = sorted(str(k) for k in spec if k not in _SOURCE_KEYS)
        if bad:
            raise fail(
                f"unknown field {bad[0]!r} (a source has only "
                f"{', '.join(_SOURCE_KEYS)}; manifests are not programs)",
                where,
            )
        if spec.get("type") != "safetensors":
            raise fail(f"type {spec.get('type')!r} is not supported (only safetensors)", where)
        files = spec.get("files")
        if files is None:
            out.append(SourceSpec(name, None))
            continue
        globs = [files] if isinstance(files, str) else files
        if not isinstance(globs, list) or not globs or len(globs) > limits.SAFETENSORS_MAX_FILES:
            raise fail(
                f"files must be a glob or a non-empty list of globs, not {_kind(files)}", where
            )
        for g in globs:
            _check_glob(g, where, fail)
        out.append(SourceSpec(name, tuple(globs)))
    return tuple(out)


def _check_glob(g: Any, where: str, fail: Any) -> None:
    if not isinstance(g, str) or not g or len(g) > limits.MANIFEST_MAX_STRING:
        raise fail(f"a files glob must be a non-empty string, found {_kind(g)}", where)
    if "\\" in g or "\0" in g or any(ord(c) < 32 for c in g):
        raise fail(f"files glob {g!r} holds a backslash or control character", where)
    p = PurePosixPath(g)
    if not p.parts:  # "." or "./": Path.glob raises IndexError on it
        raise fail(f"files glob {g!r} names no file", where)
    if p.is_absolute() or g.startswith("~") or ".." in p.parts:
        raise fail(
            f"files glob {g!r} must stay inside the manifest's folder (relative, no '..')", where
        )
