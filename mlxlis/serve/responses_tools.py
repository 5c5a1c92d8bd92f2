"""The Responses API's tools as the chat request's: function tools, and the function tools of
a namespace (`{"type": "namespace", "name", "description", "tools": [...]}`, as Codex sends
its multi-agent tools), offered to the model as `namespace.name` (harmony's way of naming a
namespace's function: `functions.get_weather`). A call of such a name comes back as the API
returns it, `name` and `namespace` apart (responses_items.py); a name offered twice (a
function `a.b` and namespace `a`'s `b`) could not be mapped back: a 400 naming the second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxlis.serve.openai_format import APIError

SEP = "."  # between a namespace's name and its function's, in the names offered


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclass
class Tools:
    """A request's tools as the chat request has them."""

    chat: list[dict[str, Any]]  # the function tools offered
    spaces: dict[str, tuple[str, str]]  # a namespaced name offered -> (namespace, name)
    renames: dict[str, str]  # their places, ours -> the request's (what refusals name)


def _function(t: Any, at: str) -> dict[str, Any]:
    """A function tool's chat form (`at`: its place in the request, for refusals)."""
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise bad(f"only function tools can run here, not {kind!r}", f"{at}.type")
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise bad("a function tool needs a name", f"{at}.name")
    return {key: t[key] for key in ("name", "description", "parameters", "strict") if key in t}


def tools_of(tools: list[dict[str, Any]]) -> Tools:
    """The chat request's function tools: a namespace's functions offered to the model as
    `namespace.name` (harmony's way of naming a namespace's function), each name mapping back
    to one tool, else a 400 naming the one that makes it ambiguous."""
    out = Tools([], {}, {})
    owner: dict[str, tuple[str | None, str]] = {}  # a name offered -> (namespace, name)
    for k, t in enumerate(tools):
        found: list[tuple[str | None, dict[str, Any], str]] = []
        if isinstance(t, dict) and t.get("type") == "namespace":
            space, inner = t.get("name"), t.get("tools")
            if not isinstance(space, str) or not space:
                raise bad("a namespace needs a name", f"tools[{k}].name")
            if not isinstance(inner, list) or not inner:
                raise bad("a namespace needs its function tools", f"tools[{k}].tools")
            about = t.get("description")
            for j, f in enumerate(inner):
                fn = _function(f, f"tools[{k}].tools[{j}]")
                if isinstance(about, str) and about:  # the namespace's, shown to the model
                    fn["description"] = f"{about}\n\n{fn.get('description', '')}".strip()
                found.append((space, fn, f"tools[{k}].tools[{j}]"))
        else:
            found.append((None, _function(t, f"tools[{k}]"), f"tools[{k}]"))
        for space, fn, at in found:
            name = fn["name"]
            offered = f"{space}{SEP}{name}" if space is not None else name
            if owner.setdefault(offered, (space, name)) != (space, name):
                raise bad(
                    f"{offered!r} names two tools (a namespace's functions are offered as "
                    f"namespace{SEP}name): rename one",
                    f"{at}.name",
                )
            if space is not None:
                out.spaces[offered] = (space, name)
            n = len(out.chat)
            out.renames[f"tools[{n}].function.parameters"] = f"{at}.parameters"
            out.renames[f"tools[{n}]"] = at
            out.chat.append({"type": "function", "function": {**fn, "name": offered}})
    return out


def tool_choice(choice: str | dict[str, Any], tools: Tools) -> str | dict[str, Any]:
    """The chat tool_choice; a function named bare that only a namespace has is that one."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise bad("a string or {type: function, name}", "tool_choice")
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise bad("a function choice needs the function's name", "tool_choice.name")
    offered = {t["function"]["name"] for t in tools.chat}
    if name not in offered:
        spaced = [o for o, (_, bare) in tools.spaces.items() if bare == name]
        name = spaced[0] if len(spaced) == 1 else name
    return {"type": "function", "function": {"name": name}}
