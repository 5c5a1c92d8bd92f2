"""Bounded reading of small untrusted files (config JSON, manifests, safetensors headers,
tokenizer and template files): beside the errors and limits, below every layer that reads.

Size is checked before a byte is parsed (a 1 GB config.json is refused by its size), nesting
after parsing (deep nesting raises a named error, never RecursionError), and every failure is
an MlxlisError of the caller's choice naming the file and the field. Limits: `limits.py`.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxlis import limits
from mlxlis.errors import ConfigError, MlxlisError

ErrorType = Callable[..., MlxlisError]


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_bytes(
    path: str | Path, limit: int, error: ErrorType = ConfigError, what: str = "file"
) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (checked before reading)."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise error(f"not a regular file ({what})", path=path)
        if st.st_size > limit:
            raise error(f"{what} is {st.st_size} bytes, over the limit of {limit} bytes", path=path)
        with open(path, "rb") as f:
            # read(n) allocates n bytes up front: ask for what stat saw (plus one to notice
            # growth), and only for a file that grew since, for the rest up to the limit
            raw = f.read(st.st_size + 1)
            if len(raw) > st.st_size:
                raw += f.read(limit + 1 - len(raw))
    except FileNotFoundError:
        raise error("file not found", path=path) from None
    except OSError as e:
        raise error(f"cannot read ({e.strerror or e})", path=path) from None
    if len(raw) > limit:  # grew since stat
        raise error(f"{what} is over the limit of {limit} bytes", path=path)
    return raw


def depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether lists/dicts nest deeper than `limit` (a bare scalar is depth 0). Iterative."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return False


def count_nodes(obj: Any, limit: int) -> int:
    """Number of values in a JSON-like tree, counting stops just past `limit`. Iterative."""
    n, stack = 0, [obj]
    while stack and n <= limit:
        node = stack.pop()
        n += 1
        if isinstance(node, dict):
            n += len(node)  # the keys
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return n


def loads_json(
    data: bytes | str,
    *,
    path: str | Path | None,
    error: ErrorType = ConfigError,
    field: str | None = None,
    max_depth: int = limits.JSON_MAX_DEPTH,
    unique_keys: bool = False,
    strict_numbers: bool = False,
) -> Any:
    """json.loads whose every failure is `error(...)`: bad UTF-8, bad JSON, huge integers,
    nesting past `max_depth`, and (optionally) duplicate keys and NaN/Infinity."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as e:
        raise error(f"invalid JSON (not UTF-8 at byte {e.start})", path=path, field=field) from None
    try:
        obj = json.loads(
            text,
            object_pairs_hook=_unique_pairs if unique_keys else None,
            parse_constant=_no_constant if strict_numbers else None,
        )
    except RecursionError:
        raise error(
            f"invalid JSON (nested deeper than {max_depth} levels)", path=path, field=field
        ) from None
    except _DuplicateKey as e:
        raise error(f"invalid JSON (duplicate key {e.key!r})", path=path, field=field) from None
    except ValueError as e:  # JSONDecodeError, integers over 4300 digits, NaN when refused
        raise error(f"invalid JSON ({e})", path=path, field=field) from None
    if depth_exceeds(obj, max_depth):
        raise error(f"invalid JSON (nested deeper than {max_depth} levels)", path=path, field=field)
    return obj


def read_json_file(
    path: str | Path,
    limit: int = limits.CONFIG_JSON_MAX_BYTES,
    error: ErrorType = ConfigError,
    *,
    what: str = "JSON file",
    max_depth: int = limits.JSON_MAX_DEPTH,
) -> Any:
    """A JSON file read with its size bounded before parsing and its nesting after."""
    raw = read_bytes(path, limit, error, what)
    return loads_json(raw, path=path, error=error, max_depth=max_depth)


def check_folder_json(folder: Path) -> None:
    """Bound the JSON files of a model folder that other modules parse (tokenizer files):
    size first, then a bounded parse, so a hostile file fails here with a named error."""
    from mlxlis.errors import TokenizerError

    for name, limit in (
        ("tokenizer_config.json", limits.TOKENIZER_CONFIG_MAX_BYTES),
        ("special_tokens_map.json", limits.CONFIG_JSON_MAX_BYTES),
    ):
        p = folder / name
        if p.exists():
            read_json_file(p, limit, TokenizerError, what=name)
    p = folder / "tokenizer.json"
    if p.exists():
        try:
            st = os.stat(p)
        except OSError as e:
            raise TokenizerError(f"cannot read ({e.strerror or e})", path=p) from None
        if not stat.S_ISREG(st.st_mode):
            raise TokenizerError("not a regular file", path=p)
        if st.st_size > limits.TOKENIZER_JSON_MAX_BYTES:
            raise TokenizerError(
                f"{st.st_size} bytes, over the limit of {limits.TOKENIZER_JSON_MAX_BYTES}",
                path=p,
            )
