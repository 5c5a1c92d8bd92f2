"""The jinja2 sandbox chat templates render in.

Chat templates are untrusted input (they ship inside model files). Rendering happens in jinja2's
ImmutableSandboxedEnvironment with the helpers real templates use (the ones transformers'
`apply_chat_template` provides), plus limits the stock sandbox lacks:

* attribute walking (`''.__class__`, `cycler.__init__.__globals__`, ...) raises at once instead of
  rendering an empty string;
* a budget of operations (loop iterations, calls, filters) stops runaway loops and recursion;
* a budget of characters emitted (everywhere, captured blocks and macros included) and size checks
  on the operations that multiply data (`*`, `**`, `+`, `~`, `join`, `center`, `%`, format widths,
  ...) stop a template from building huge strings or lists.

Every refusal is a `jinja2.exceptions.SecurityError`; the caller turns it into a TemplateError.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

MAX_CHARS = 4 * 1024 * 1024  # chars a render may emit; the largest string/list it may build
MAX_OPS = 1_000_000  # loop iterations + calls + filters in one render
MAX_INT_BITS = 1 << 16  # the largest integer a template may compute
MAX_JSON_INDENT = 1024
TEMPLATE_FILENAME = "<chat_template>"

_EMIT = "mlxlis_emit"  # internal filters the compiler inserts (see _Instrument)
_LOOP = "mlxlis_loop"
_SIZE = "mlxlis_size"
_BLOCKED_METHODS = frozenset({"translate", "maketrans", "expandtabs"})
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
_DIGIT_RUN = re.compile(r"\d{7,}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


class TemplateRaised(jinja2.exceptions.TemplateError):
    """The template called raise_exception(message)."""


class _Budget:
    __slots__ = ("ops", "chars")

    def __init__(self) -> None:
        self.ops = 0
        self.chars = 0


_BUDGET: ContextVar[_Budget | None] = ContextVar("mlxlis_template_budget", default=None)


def _tick(n: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is None:  # compile-time constant folding: nothing to count
        return
    budget.ops += n
    if budget.ops > MAX_OPS:
        raise SecurityError(f"template exceeded {MAX_OPS} operations (runaway loop or recursion)")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise SecurityError(f"{what} would hold {n} items, over the limit of {MAX_CHARS}")


def _check_result(value: Any, what: str) -> Any:
    _check_size(_size(value), what)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise SecurityError(f"{what} produced an integer over {MAX_INT_BITS} bits")
    return value


def _flatten(args: Any) -> Iterator[Any]:
    if isinstance(args, dict):
        args = list(args.values())
    if isinstance(args, (list, tuple)):
        for a in args:
            yield from _flatten(a) if isinstance(a, (list, tuple, dict)) else (a,)
    else:
        yield args


def _check_format(fmt: str, args: Any) -> None:
    """Refuse format strings whose widths/precisions would allocate more than MAX_CHARS."""
    if _DIGIT_RUN.search(fmt):
        raise SecurityError("format string with a width or precision of 7+ digits")
    if "*" in fmt or _NESTED_FIELD.search(fmt):  # widths taken from the arguments
        big = [a for a in _flatten(args) if isinstance(a, int) and abs(a) > MAX_CHARS]
        if big:
            raise SecurityError(f"format width {big[0]} is over the limit of {MAX_CHARS}")


def _check_join(sep: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        total = sum(_size(x) if isinstance(x, str) else 8 for x in items)
        _check_size(total + _size(sep) * len(items), "join")


def _check_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = len(s) + 1 if not old else s.count(old)
        _check_size(len(s) + hits * len(new), "replace")


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Pre-checks for the str methods whose output can dwarf their input."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _BLOCKED_METHODS:
        raise SecurityError(f"str.{name} is not allowed in chat templates")
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _check_size(args[0], f"str.{name}")
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])
    elif name == "join" and args:
        _check_join(owner, args[0])
    elif name in ("format", "format_map"):
        _check_format(owner, [list(args), kwargs])


def _check_binop(op: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        if ints:
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise SecurityError(f"integer product over {MAX_INT_BITS} bits")
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and _size(seq):
            _check_size(len(seq) * max(n, 0), "repetition")
    elif op == "**" and ints and right > 0 and abs(left) > 1:
        if abs(left).bit_length() * right > MAX_INT_BITS:
            raise SecurityError(f"power over {MAX_INT_BITS} bits")
    elif op == "+" and _size(left) and _size(right):
        _check_size(len(left) + len(right), "concatenation")
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


# ---------------------------------------------------------------- helpers templates call


def raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: no HTML escaping, non-ASCII kept, optional indent/separators."""
    if _size(indent) > MAX_JSON_INDENT or (isinstance(indent, int) and indent > MAX_JSON_INDENT):
        raise SecurityError(f"tojson indent over {MAX_JSON_INDENT}")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_ns_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _TemplateNamespace(Namespace):
    """jinja2's namespace(), refusing underscore names (no route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_ns_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_ns_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


# ---------------------------------------------------------------- instrumentation


@jinja2.pass_context  # pass_context keeps the compiler from folding these at compile time
def _emit_filter(_ctx: Any, value: Any) -> Any:
    budget = _BUDGET.get()
    if budget is not None:
        budget.chars += len(str(value))
        if budget.chars > MAX_CHARS:
            raise SecurityError(f"template output exceeded {MAX_CHARS} characters")
    return value


@jinja2.pass_context
def _loop_filter(_ctx: Any, iterable: Any) -> Iterator[Any]:
    for item in iterable:
        _tick()
        yield item


@jinja2.pass_context
def _size_filter(_ctx: Any, value: Any) -> Any:
    return _check_result(value, "string concatenation (~)")


def _internal(node: nodes.Expr | None, name: str, lineno: int) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=lineno)


class _Instrument(NodeTransformer):
    """Routes every output, loop and `~` through the budget filters."""

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [_internal(child, _EMIT, child.lineno) for child in node.nodes]
        return node

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _internal(node.iter, _LOOP, node.lineno)
        return node

    def visit_Name(self, node: nodes.Name) -> nodes.Name:
        if node.name == "self" and node.ctx == "load":  # the TemplateReference: no use in chats
            raise SecurityError(f"`self` (line {node.lineno}) is not available in chat templates")
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return _internal(node, _SIZE, node.lineno)


_HIDDEN_ARGS = (jinja2.runtime.Context, jinja2.Environment, nodes.EvalContext)


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    pre = _FILTER_CHECKS.get(name)

    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marker
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        if pre is not None:
            pre([a for a in args if not isinstance(a, _HIDDEN_ARGS)], kwargs)
        return _check_result(func(*args, **kwargs), f"filter {name}")

    return guarded


def _arg(args: list, i: int, kwargs: dict, key: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(key)


def _check_width(key: str) -> Callable[[list, dict], None]:
    def check(args: list, kwargs: dict) -> None:
        width, value = _arg(args, 1, kwargs, key), _arg(args, 0, kwargs, "")
        if isinstance(width, int):
            _check_size(width, f"{key} {width}")
        elif isinstance(width, str) and isinstance(value, str):
            _check_size(len(width) * (value.count("\n") + 1), f"{key} string")

    return check


def _check_sum(args: list, kwargs: dict) -> None:
    items = _arg(args, 0, kwargs, "")
    if isinstance(items, (list, tuple)):
        _check_size(sum(_size(x) for x in items), "sum")


_FILTER_CHECKS: dict[str, Callable[[list, dict], None]] = {
    "center": _check_width("width"),
    "indent": _check_width("width"),
    "batch": _check_width("linecount"),
    "slice": _check_width("slices"),
    "join": lambda a, k: _check_join(_arg(a, 1, k, "d"), _arg(a, 0, k, "")),
    "format": lambda a, k: _check_format(str(_arg(a, 0, k, "")), [a[1:], k]),
    "replace": lambda a, k: _check_replace(
        _arg(a, 0, k, ""), _arg(a, 1, k, "old"), _arg(a, 2, k, "new")
    ),
    "sum": _check_sum,
}


class ChatSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with the chat-template helpers and the limits above."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
        )
        self.filters["tojson"] = tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters.update({_EMIT: _emit_filter, _LOOP: _loop_filter, _SIZE: _size_filter})
        self.globals.pop("lipsum", None)  # generates text without bound; no chat template uses it
        self.globals.update(
            raise_exception=raise_exception,
            strftime_now=strftime_now,
            dict=_TemplateDict(),
            namespace=_TemplateNamespace,
        )

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        kind = type(obj).__name__
        raise SecurityError(f"access to attribute {attribute!r} of {kind!r} is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return self.binop_table[operator](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        _check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_result(result, f"call to {getattr(__obj, '__name__', 'function')}")


_ENV = ChatSandbox()


@functools.lru_cache(maxsize=64)
def compile_template(text: str) -> jinja2.Template:
    """Parse, instrument and compile a template once. Raises jinja2.TemplateSyntaxError."""
    tree = _Instrument().visit(_ENV.parse(text, filename=TEMPLATE_FILENAME))
    code = _ENV.compile(tree, filename=TEMPLATE_FILENAME)
    return _ENV.template_class.from_code(_ENV, code, _ENV.make_globals(None))


def render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render under a fresh budget. Raises whatever jinja2 raises (SecurityError on a limit)."""
    token = _BUDGET.set(_Budget())
    stream = template.generate(**context)
    try:
        return "".join(stream)
    finally:
        stream.close()
        _BUDGET.reset(token)


def error_line(exc: BaseException) -> int | None:
    """The template line an error happened on (jinja rewrites tracebacks to template lines)."""
    line = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == TEMPLATE_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
