"""The size of a regular expression as the grammar engine's lexer builds it: each counted
repetition unrolled (`x{m,n}` is n copies of x), an alternation the sum of its branches.

The size sets the cost of every token's mask: on Qwen2.5's 152k vocabulary a{1000} took
0.5 ms a token, a{10000} 6.4 ms, (a{100}){100} 8 ms, a{100000} 75 ms and (a{316}){316}
86 ms (a forward of a small model takes about 10 ms). Past ~400 000 the lexer gives up at
the first token ("too many expressions constructed": a{500000}, ((ab){100}c){2000}, and
(a{1000}){1000}, which passed validation). MAX_REGEX keeps a mask to milliseconds, summed
over a schema's patterns. What the size misses, ambiguous runs of counts ((a{300,600}){2}
failed at 1200, (a{1,2}){5000} at 10 000), fails within 0.06 s at the first token, where the
lexer is built with all its regexes (a schema's patterns too): there constraints.probe
refuses it.
"""

from __future__ import annotations

import re

MAX_REGEX = 10_000
TOO_LARGE = f"the regex is over {MAX_REGEX} characters with its counted repetitions written out"

_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")


def regex_size(rx: str, limit: int) -> int:
    """The size of `rx` with each counted repetition unrolled (`x{m,n}` is n copies of x,
    an alternation the sum of its branches), or a number past `limit` once it is past."""
    groups = [[0, 0]]  # per open group: [its finished branches, its current branch]
    last, i = 0, 0  # the size of the atom just read (what a count repeats)
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            i += 2
            if rx[i - 1 : i] in ("p", "P", "x", "u") and rx[i : i + 1] == "{":  # \p{Greek}
                i = (rx.find("}", i) + 1) or len(rx)
            last = 1
        elif c == "[":
            i, last = _class_end(rx, i), 1
        elif c == "(":
            groups.append([0, 0])
            i += 1
            if rx[i : i + 1] == "?":  # (?:…), (?P<name>…), (?i): skip to the group's body
                while i < len(rx) and rx[i] not in ":)>":
                    i += 1
                i += rx[i : i + 1] in (":", ">")
            last = 0
            continue
        elif c == ")" and len(groups) > 1:
            done, current = groups.pop()
            last, i = done + current, i + 1
        elif c == "|":
            groups[-1][0] += groups[-1][1]
            groups[-1][1], last, i = 0, 0, i + 1
            continue
        elif c == "{" and (m := _COUNTED.match(rx, i)) and (m[1] or m[3]):
            if len(m[1]) > 9 or len(m[3]) > 9:
                return limit + 1
            times = max(int(m[1] or 0), int(m[3] or 0), 1)
            groups[-1][1] += last * (times - 1)
            last, i = last * times, m.end()
            if groups[-1][1] > limit:
                return limit + 1
            continue
        elif c in "*+?":
            i += 1
            continue
        else:
            last, i = 1, i + 1
        groups[-1][1] += last
    return sum(a + b for a, b in groups)


def _class_end(rx: str, i: int) -> int:
    """The index past the character class that opens at `rx[i]` (nested classes included)."""
    j, depth = i + 1, 1
    j += rx[j : j + 1] == "^"
    j += rx[j : j + 1] == "]"  # a leading ] is a member
    while j < len(rx):
        if rx[j] == "\\":
            j += 2
            continue
        if rx[j] == "[":
            depth += 1
        elif rx[j] == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(rx)
