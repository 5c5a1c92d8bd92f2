"""The lexemes of forced argument values, as regular expressions for llguidance's Lark
terminals (with its `&` and `~`): numbers and quoted strings exactly as Python's repr and
json.dumps write them (values.py says why, and which).

Numbers are Python's repr, which is also json.dumps': integers without a sign on zero; floats
with at most 15 significant digits (a decimal of 15 digits is its own shortest repr: it reads
back and is written again unchanged), `1.0`, no exponent where repr writes none (1e-4 <= |x| <
1e16), `1e-05` / `1.5e+16` beyond, up to 1e±299. A bound (minimum, exclusiveMaximum…) is held
by comparing digits, on numbers written without exponent. Strings are escaped as each writes
them (JSON: \\" \\\\ \\n \\u001f…; repr: \\' \\n \\x1f…, quoted "…" where the text holds '
and no "), and leave out the text that ends the value (an XML row's closing tag), in repr the
characters it escapes as \\u or \\U (Unicode's invisible ones), and under a `pattern` any
escape at all (the pattern then reads the text itself).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Protocol

INT = r"0|-?[1-9][0-9]*"
_EXP = r"e(\+(1[6-9]|[2-9][0-9]|[12][0-9]{2})|-(0[5-9]|[1-9][0-9]|[12][0-9]{2}))"
FLOAT = " | ".join(
    (
        r"/0\.0/",
        r"/-?[1-9][0-9]*\.[0-9]*[1-9]/ & /-?[0-9.]{3,16}/",  # 15 digits at most
        r"/-?[1-9]([0-9]{0,13}[1-9])?0*\.0/ & /-?[0-9]{1,16}\.0/",  # below 1e16
        r"/-?0\.0{0,3}[1-9]([0-9]{0,13}[1-9])?/",  # from 1e-4
        rf"/-?[1-9](\.[0-9]{{0,13}}[1-9])?{_EXP}/",
    )
)


class Unsupported(Exception):
    """A schema the exact walk does not hold."""


class Rules(Protocol):
    """What the walk needs of the grammar it writes into (lark.Lark)."""

    def rule(self, body: str, options: str = "") -> str: ...
    def lit(self, text: str) -> str: ...
    def terminal(self, body: str) -> str: ...
    def reserve(self) -> str: ...
    def define(self, name: str, body: str) -> None: ...
    def sequence(self, items: list[tuple[str, bool]], sep: str) -> str: ...


def _digits(value: Decimal) -> tuple[str, str]:
    """(integer digits, fraction digits without trailing zeros) of a value >= 0."""
    whole, _, frac = format(value, "f").partition(".")
    return whole.lstrip("0") or "0", frac.rstrip("0")


def _gt(s: str) -> list[str]:
    """Integers above `s`: longer, or as long with a greater digit first where they part."""
    alts = [f"[1-9][0-9]{{{len(s)},}}"]
    alts += [
        f"{s[:i]}[{int(c) + 1}-9][0-9]{{{len(s) - i - 1}}}" for i, c in enumerate(s) if c < "9"
    ]
    return alts


def _lt(s: str) -> list[str]:
    """Digit strings below `s` (zeros in front dropped later, by the canonical form)."""
    alts = [f"[0-9]{{1,{len(s) - 1}}}"] if len(s) > 1 else []
    alts += [
        f"{s[:i]}[0-{int(c) - 1}][0-9]{{{len(s) - i - 1}}}" for i, c in enumerate(s) if c > "0"
    ]
    return alts


def _at_least(a: Decimal) -> str:
    """Unsigned decimals >= a (>= 0)."""
    whole, frac = _digits(a)
    if len(whole) > 40:
        raise Unsupported("a bound of over 40 digits")
    tail = r"(\.[0-9]+)?"
    if frac:
        ge = [f"{frac[:i]}[{int(c) + 1}-9][0-9]*" for i, c in enumerate(frac) if c < "9"]
        tail = r"\.(" + "|".join([*ge, frac + "[0-9]*"]) + ")"
    return f"(({'|'.join(_gt(whole))})" + r"(\.[0-9]+)?" + f"|{whole}{tail})"


def _at_most(b: Decimal) -> str:
    """Unsigned decimals <= b (>= 0)."""
    whole, frac = _digits(b)
    if len(whole) > 40:
        raise Unsupported("a bound of over 40 digits")
    le = [f"{frac[:i]}[0-{int(c) - 1}][0-9]*" for i, c in enumerate(frac) if c > "0"]
    le += [f"{frac[:k]}0*" for k in range(len(frac) + 1)]
    alts = [f"({'|'.join(_lt(whole))})" + r"(\.[0-9]+)?"] if _lt(whole) else []
    return "(" + "|".join([*alts, whole + r"(\.(" + "|".join(le) + "))?"]) + ")"


def _decimal(x: Any) -> Decimal:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise Unsupported("a bound that is no number")
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


def _texts(x: Decimal) -> list[str]:
    """The texts of a value in the canonical forms (3 and 3.0 alike)."""
    out = [repr(float(x))]
    if x == x.to_integral_value():
        out.append(str(int(x)))
    return out


def number(rules: Rules, kind: str, schema: dict) -> str:
    """A terminal for the integers or numbers `schema` allows, as repr writes them."""
    if "multipleOf" in schema:
        raise Unsupported("multipleOf")
    canon = f"/{INT}/" if kind == "integer" else f"/{INT}/ | {FLOAT}"
    parts, exclude = [rules.terminal(canon)], []
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if ex_low is True or ex_high is True:  # draft 4: the bound itself left out
        exclude += [_decimal(b) for b, e in ((low, ex_low), (high, ex_high)) if e is True]
    for b in (ex_low, ex_high):
        if b is not None and not isinstance(b, bool):
            exclude.append(_decimal(b))
    lows = [_decimal(b) for b in (low, ex_low) if b is not None and not isinstance(b, bool)]
    highs = [_decimal(b) for b in (high, ex_high) if b is not None and not isinstance(b, bool)]
    if lows:
        lo = max(lows)
        parts.append(f"/{_at_least(lo)}/" if lo >= 0 else f"/[0-9](?s:.*)|-{_at_most(-lo)}/")
    if highs:
        hi = min(highs)
        parts.append(f"/-(?s:.*)|{_at_most(hi)}/" if hi >= 0 else f"/-{_at_least(-hi)}/")
    forms = [re.escape(t) for x in exclude for t in _texts(x)]
    if forms:
        parts.append(f"~/{'|'.join(forms)}/")
    return parts[0] if len(parts) == 1 else rules.terminal(" & ".join(parts))


# ---------------------------------------------------------------- strings (regex bodies)

_RAW = r"[^\x00-\x7f\p{C}\p{Z}]"  # what repr and tojson both print as it is, past ASCII
_PY = r"[ !#-&(-\[\]-~]|" + _RAW  # printable ASCII but quotes and backslash
_PY_ESC = r"\\\\|\\[ntr]|\\x(0[0-8bcef]|1[0-9a-f]|7f|[89][0-9a-f]|a0|ad)"
_JS = r"[^\"\\\x00-\x1f]"
_META = set("\\.+*?()|[]{}^$#&-~/\"'")
_JS_ESC = r"\\[\"\\bfnrt]|\\u00(0[0-7bef]|1[0-9a-f])"


def join(*parts: str) -> str:
    """Grammar items in a row, the empty ones left out."""
    return " ".join(p for p in parts if p)


def rx(text: str) -> str:
    """`text` as a literal inside /…/."""
    return "".join("\\" + c if c in _META else {"\n": "\\n", "\t": "\\t"}.get(c, c) for c in text)


def pattern_rx(pattern: Any) -> str | None:
    """A JSON Schema `pattern` as the whole text it allows, or None when it has none."""
    if not isinstance(pattern, str):
        return None
    body = pattern.replace("/", "\\/")
    if body.startswith("^") and body.endswith("$") and not body.endswith("\\$"):
        return body[1:-1]
    if "^" in body or "$" in body:
        raise Unsupported("a pattern anchored inside")
    return f"(?s:.*)({body})(?s:.*)"


def string(rules: Rules, style: str, schema: dict, end: str) -> str:
    """A terminal for a string `schema` allows, quoted and escaped as `style` writes it."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    n = f"{{{low},{'' if high is None else high}}}"
    pattern = pattern_rx(schema.get("pattern"))
    extra = f" & ~/(?s:.*){rx(end)}(?s:.*)/" if end else ""
    extra += f" & /{pattern}/" if pattern is not None else ""
    if style == "json":
        unit = _JS if pattern is not None else f"{_JS}|{_JS_ESC}"
        return rules.terminal(f'"\\"" {rules.terminal(f"/({unit}){n}/" + extra)} "\\""')
    # repr: '…', its ' escaped where it holds both quotes; "…" where it holds ' and no "
    if pattern is None:
        units = f"{_PY}|{_PY_ESC}"
        single = f"/({units}|\"|\\\\'){n}/ & ~(/({units}|\\\\')*/ & /(?s:.*)\\\\'(?s:.*)/)"
    else:
        units = _PY
        single = f'/({units}|"){n}/'
    double = f"/({units}|'){n}/ & /(?s:.*)'(?s:.*)/"
    single, double = rules.terminal(single + extra), rules.terminal(double + extra)
    return rules.terminal(f'"\'" {single} "\'" | "\\"" {double} "\\""')
