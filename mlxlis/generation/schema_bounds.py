"""Bounds a constraint keeps before the grammar engine sees it: a JSON schema walked here
(iteratively, its `$ref`s resolved), a regular expression measured; each refusal a
ConstraintError naming the field, the place in it and the bound.

llguidance recurses on the native stack as it follows a schema's nesting and its `$ref`s, so
an unbounded chain of them crashes the whole process (SIGSEGV). Measured with llguidance 1.9.1
in a thread with 8 MiB of stack (Linux's default; the server prepares requests on one), the
first crash came at about 920 objects nested through `$ref`, 1030 `anyOf`s, 1090 array
`items`, 1360 `allOf`s, 2500 bare `$ref`s in a chain; written out literally a schema stops
sooner, at the 128 levels of JSON its parser takes (about 64 levels of `properties`).

| bound          | value   | bounds                          | why this value                   |
|----------------|---------|---------------------------------|----------------------------------|
| MAX_DEPTH      | 64      | schema levels on a path (a $ref | what the engine takes written    |
|                |         | is one; a cycle is no path)     | out; 14x under the first crash   |
| MAX_NODES      | 10_000  | JSON values in the schema       | compiles in <= 0.8 s (measured)  |
| MAX_ROW        | 1_500   | items of one parser row a value | the engine fails the reply's     |
|                |         | may fill: 1 an alternative      | token past 2000 (measured: 501   |
|                |         | (anyOf, oneOf; allOf multiplies)| optional properties; 2 anyOfs of |
|                |         | 4 an optional property          | 1500 objects), mid-reply         |
| MAX_REGEX      | 10_000  | a regex's size with its counts  | a token's mask grows with it:    |
|                |         | unrolled (x{m,n}: n copies of   | 6.4 ms at 10 000 on a 152k       |
|                |         | x), summed over its patterns    | vocabulary (regex_bounds.py)     |

A schema no finite value satisfies (every value must hold itself through a `$ref` cycle:
`{"$ref": "#"}`, two `$defs` naming each other, a required property of its own type) is
refused too: the engine would allow only the stop token (an empty "successful" reply) or
nest until max_tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from mlxlis.errors import MlxlisError
from mlxlis.generation.regex_bounds import MAX_REGEX, TOO_LARGE, regex_size

MAX_DEPTH = 64
MAX_NODES = 10_000
MAX_ROW = 1_500

Path = tuple[str | int, ...]

# keywords whose value is a subschema, a list of them or a map of them (drafts 7 to 2020-12)
ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
)
MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies")
DEFS = ("$defs", "definitions")


class ConstraintError(MlxlisError):
    """A constraint that cannot be enforced (invalid, out of bounds, or a feature the engine
    lacks)."""


def dotted(field: str, path: Path) -> str:
    return field + "".join(f".{p}" for p in path)


def subschemas(node: Any, defs: bool = False) -> Iterator[tuple[Path, Any]]:
    """(path under `node`, subschema) for each subschema a schema node holds; with `defs`, its
    `$defs` too (which count only where a `$ref` reaches them)."""
    if not isinstance(node, dict):
        return
    for k in ONE:
        if isinstance(v := node.get(k), dict | bool):
            yield (k,), v
    for k in MANY:
        if isinstance(v := node.get(k), list):
            yield from (((k, i), s) for i, s in enumerate(v) if isinstance(s, dict | bool))
    for k in MAPS + (DEFS if defs else ()):
        if isinstance(v := node.get(k), dict):
            yield from (((k, n), s) for n, s in v.items() if isinstance(s, dict | bool))


class _Refs:
    """Where each `$ref` of a document points: its resources (`$id`), anchors and JSON
    pointers, resolved as llguidance resolves them; what points outside is refused (the
    engine fetches nothing)."""

    def __init__(self, root: dict, field: str):
        self.field = field
        self.paths: dict[int, Path] = {}  # a schema node -> where it is in the document
        self.base: dict[int, str] = {}  # a schema node -> its resource's URI
        self.resources: dict[str, tuple[Any, Path]] = {"": (root, ())}
        self.anchors: dict[tuple[str, str], tuple[Any, Path]] = {}
        stack: list[tuple[Any, Path, str]] = [(root, (), "")]
        while stack:
            node, path, base = stack.pop()
            if id(node) in self.paths:
                continue
            self.paths[id(node)] = path
            if isinstance(node, dict):
                own = node.get("$id")
                if isinstance(own, str) and own.startswith("#"):  # draft 7's anchor form
                    self.anchors[(base, own[1:])] = (node, path)
                elif isinstance(own, str):
                    base = urldefrag(urljoin(base, own))[0]
                    self.resources[base] = (node, path)
                for key in ("$anchor", "$dynamicAnchor"):
                    if isinstance(name := node.get(key), str):
                        self.anchors[(base, name)] = (node, path)
            self.base[id(node)] = base
            stack.extend((s, path + p, base) for p, s in subschemas(node, defs=True))

    def target(self, node: dict) -> tuple[Any, Path] | None:
        """The schema node `node`'s `$ref` names (None without one)."""
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return None
        here, base = self.paths[id(node)], self.base[id(node)]
        if ref.startswith("#"):
            uri, fragment = base, ref[1:]
        else:
            uri, fragment = urldefrag(urljoin(base, ref))
        if uri not in self.resources:
            raise ConstraintError(
                f"$ref {ref!r}: only references within the schema are followed",
                field=dotted(self.field, (*here, "$ref")),
            )
        doc, at = self.resources[uri]
        if fragment and not fragment.startswith("/"):
            if (uri, fragment) not in self.anchors:
                raise ConstraintError(
                    f"$ref {ref!r}: no anchor {fragment!r}", field=dotted(self.field, here)
                )
            return self.anchors[(uri, fragment)]
        parts = [unquote(p).replace("~1", "/").replace("~0", "~") for p in fragment.split("/")]
        for part in parts[1:]:
            if isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
                doc, at = doc[int(part)], (*at, int(part))
            elif isinstance(doc, dict) and part in doc:
                doc, at = doc[part], (*at, part)
            else:  # named by the whole pointer, as the engine's own message does
                missing = (*self.resources[uri][1], *parts[1:])
                raise ConstraintError(
                    f"$ref {ref!r} does not exist in the schema",
                    field=dotted(self.field, missing),
                )
        if not isinstance(doc, dict | bool):
            raise ConstraintError(f"$ref {ref!r} is not a schema", field=dotted(self.field, at))
        self.paths.setdefault(id(doc), at)
        self.base.setdefault(id(doc), uri)
        return doc, at


def check_schema(schema: Any, field: str) -> None:
    """ConstraintError naming `field` (and the place in it) for a schema out of the bounds
    above, with a `$ref` that leads nowhere, or that no finite value satisfies."""
    if not isinstance(schema, dict):
        return
    _count(schema, field)
    refs = _Refs(schema, field)
    height: dict[int, int] = {}  # a node -> the levels below it, itself included (when done)
    done: list[Any] = []  # the nodes in the order they are finished (children first)
    budget = [MAX_REGEX]
    on_path = {id(schema)}
    _own_bounds(schema, (), field, budget)
    stack: list[tuple[Any, Path, Iterator[tuple[Any, Path]], int]] = [
        (schema, (), _children(schema, (), refs), 0)
    ]
    while stack:
        node, path, children, below = stack[-1]
        step = next(children, None)
        if step is None:
            stack.pop()
            on_path.discard(id(node))
            height[id(node)] = below + 1
            done.append(node)
            if stack:
                parent = stack[-1]
                stack[-1] = (*parent[:3], max(parent[3], below + 1))
            continue
        child, at = step
        if id(child) in on_path:  # a cycle: recursion, not depth (finiteness is checked below)
            continue
        if id(child) in height:
            seen = height[id(child)]
            if len(stack) + seen > MAX_DEPTH:
                raise _too_deep(field, at)
            stack[-1] = (node, path, children, max(below, seen))
            continue
        if len(stack) + 1 > MAX_DEPTH:
            raise _too_deep(field, at)
        _own_bounds(child, at, field, budget)
        on_path.add(id(child))
        stack.append((child, at, _children(child, at, refs), 0))
    _finite(schema, done, refs, field)
    _rows(done, refs, field)


def _too_deep(field: str, at: Path) -> ConstraintError:
    return ConstraintError(
        f"the schema nests more than {MAX_DEPTH} levels deep here (a $ref counts as one)",
        field=dotted(field, at),
    )


def _children(node: Any, path: Path, refs: _Refs) -> Iterator[tuple[Any, Path]]:
    """A node's subschemas, then what its `$ref` names (its `$defs` only through refs)."""
    for p, s in subschemas(node):
        yield s, path + p
    if isinstance(node, dict) and (hit := refs.target(node)) is not None:
        yield hit


def _count(schema: Any, field: str) -> None:
    n, stack = 0, [schema]
    while stack:
        v = stack.pop()
        n += 1
        if n > MAX_NODES:
            raise ConstraintError(
                f"the schema holds more than {MAX_NODES} JSON values", field=field
            )
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _own_bounds(node: Any, path: Path, field: str, budget: list[int]) -> None:
    """One node's own bound: its patterns' sizes (from `budget`)."""
    if not isinstance(node, dict):
        return
    patterns = [((*path, "pattern"), node.get("pattern"))]
    if isinstance(more := node.get("patternProperties"), dict):
        patterns += [((*path, "patternProperties", k), k) for k in more]
    for at, rx in patterns:
        if isinstance(rx, str):
            budget[0] -= regex_size(rx, budget[0])
            if budget[0] < 0:
                raise ConstraintError(TOO_LARGE, field=dotted(field, at))


def _finite(root: dict, done: list[Any], refs: _Refs, field: str) -> None:
    """Refuse a root that no finite value satisfies: a least fixpoint of "some finite value
    holds this node", children first, over what the walk reached. It errs towards "finite"
    (what it cannot judge, such as two subschemas of allOf that contradict, passes) so that
    it refuses only what is certain."""
    finite: set[int] = set()
    users: dict[int, list[Any]] = {}  # a node -> the nodes whose verdict depends on it
    for node in done:
        for child, _ in _children(node, (), refs):
            users.setdefault(id(child), []).append(node)

    def holds(s: Any) -> bool:
        return s is True or id(s) in finite

    work = list(done)
    while work:
        node = work.pop()
        if id(node) not in finite and _satisfiable(node, refs, holds):
            finite.add(id(node))
            work += users.get(id(node), ())
    # a $ref no finite value passes refuses even where it is optional: a reply that enters
    # it nests until max_tokens, or fails mid-reply ("Too many items", the fuzz test found)
    if loop := [n for n in done if isinstance(n, dict) and "$ref" in n and id(n) not in finite]:
        raise ConstraintError(
            "no finite value satisfies this $ref: a value here would have to contain itself",
            field=dotted(field, refs.paths[id(loop[0])]),
        )
    if id(root) not in finite:
        raise ConstraintError("no finite value satisfies the schema", field=field)


SAME_VALUE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def _rows(done: list[Any], refs: _Refs, field: str) -> None:
    """Refuse a cycle of schemas that all apply to one value (d0 -> anyOf -> d0: it nests no
    value, so it adds nothing, and `jsonschema` itself recurses on it without end), and a
    value whose alternatives fill more than MAX_ROW items of one parser row: llguidance fails
    there mid-reply ("Current row has 2003 items; max is 2000"), where anything can lead."""
    row: dict[int, tuple[int, int]] = {}  # a node -> (alternatives, optional properties)
    on_path: set[int] = set()
    for start in done:
        if id(start) in row:
            continue
        on_path.add(id(start))
        stack = [(start, _same_value(start, refs))]
        while stack:
            node, later = stack[-1]
            if (child := next(later, None)) is None:
                stack.pop()
                on_path.discard(id(node))
                row[id(node)] = width = _row(node, refs, row)
                if width[0] + 4 * width[1] > MAX_ROW:
                    raise ConstraintError(
                        f"{width[0]} alternatives and {width[1]} optional properties for one "
                        f"value: over {MAX_ROW} items of one parser row (4 a property)",
                        field=dotted(field, refs.paths[id(node)]),
                    )
            elif id(child) in on_path:
                raise ConstraintError(
                    "this leads back to the schema of the same value without nesting one",
                    field=dotted(field, refs.paths[id(node)]),
                )
            elif id(child) not in row:
                on_path.add(id(child))
                stack.append((child, _same_value(child, refs)))


def _row(node: Any, refs: _Refs, row: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(alternatives, optional properties) of one value under `node`, its parts' known: the
    members of anyOf / oneOf add up, allOf's and a $ref's multiply (an intersection)."""
    if not isinstance(node, dict):
        return 1, 0
    required = node.get("required") if isinstance(node.get("required"), list) else []
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    alts, opts = 1, len([k for k in props if k not in required])
    for k in ("anyOf", "oneOf"):
        if parts := [row[id(s)] for _, s in subschemas({k: node.get(k)})]:
            alts, opts = alts * sum(a for a, _ in parts), opts + sum(o for _, o in parts)
    product = [row[id(s)] for _, s in subschemas({"allOf": node.get("allOf")})]
    if (hit := refs.target(node)) is not None:
        product.append(row[id(hit[0])])
    for a, o in product:
        alts, opts = alts * a, opts + o
    return alts, opts


def _same_value(node: Any, refs: _Refs) -> Iterator[Any]:
    """The schemas that apply to the very value `node` applies to: its $ref's, its
    combinators' members."""
    yield from (s for p, s in subschemas(node) if p[0] in SAME_VALUE)
    if isinstance(node, dict) and (hit := refs.target(node)) is not None:
        yield hit[0]


def _satisfiable(node: Any, refs: _Refs, holds: Any) -> bool:
    if not isinstance(node, dict):
        return node is not False
    if (hit := refs.target(node)) is not None and not holds(hit[0]):
        return False
    if any(not holds(s) for _, s in subschemas({"allOf": node.get("allOf")})):
        return False
    for k in ("anyOf", "oneOf"):
        alts = [s for _, s in subschemas({k: node.get(k)})]
        if alts and not any(holds(s) for s in alts):
            return False
    if "const" in node or "enum" in node:
        return True
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return True  # any type: a scalar satisfies it
    return any(_kind_satisfiable(node, k, holds) for k in kinds)


def _kind_satisfiable(node: dict, kind: Any, holds: Any) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(holds(props[r]) for r in required if isinstance(r, str) and r in props)
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        items = node.get("items")
        prefix = node.get("prefixItems", items if isinstance(items, list) else [])
        prefix = prefix if isinstance(prefix, list) else []
        if not all(holds(s) for s in prefix[:least] if isinstance(s, dict | bool)):
            return False
        rest = items if isinstance(items, dict | bool) else node.get("additionalItems", True)
        return least <= len(prefix) or not isinstance(rest, dict | bool) or holds(rest)
    return True


def check_regex(rx: str, field: str) -> None:
    """ConstraintError naming `field` for a regex past MAX_REGEX."""
    if regex_size(rx, MAX_REGEX) > MAX_REGEX:
        raise ConstraintError(TOO_LARGE, field=field)
