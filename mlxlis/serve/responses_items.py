"""The output items of a /v1/responses reply (reasoning, message, function_call), built
from the reply's deltas, with the stream events that announce them. A call of a namespace's
function (offered as `namespace.name`, responses_tools.py) is a function_call item with its
`name` and `namespace` apart, as the API returns it."""

from __future__ import annotations

import json
from typing import Any

from mlxlis.serve.openai_format import new_id
from mlxlis.serve.reply import Delta
from mlxlis.serve.responses_schemas import Item


class Output:
    """The output items of one response, built from the reply's deltas: a delta of another
    kind ends the open item; `feed` gives the stream's events (without sequence numbers)."""

    def __init__(
        self, spaces: dict[str, tuple[str, str]] | None = None, streaming: bool = False
    ) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.spaces = spaces or {}  # a namespaced name offered -> (namespace, name)
        # streamed: a call's item opens as it begins (its arguments follow as they come); else
        # each call is an item once whole, and a call the reply was cut in is none
        self.streaming = streaming
        self.logprobs: list[dict[str, Any]] = []  # the reply's tokens not yet in a message

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.stop()
        self.items.append(item)
        self.open = item
        i = len(self.items) - 1
        out.append({"type": "response.output_item.added", "output_index": i, "item": _copy(item)})
        if item["type"] in ("message", "reasoning"):
            part = _part(item)
            out.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "part": {**part, "text": ""},
                }
            )
        return out

    def stop(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = len(self.items) - 1
        item["status"] = "completed"
        head = {"item_id": item["id"], "output_index": i}
        out = []
        if item["type"] in ("message", "reasoning"):
            part = _part(item)
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {**head, "content_index": 0, "text": part["text"]}
            if kind == "output_text":
                part["logprobs"] += self.logprobs
                self.logprobs = []
                done["logprobs"] = part["logprobs"]
            out.append({"type": f"response.{kind}.done", **done})
            out.append(
                {"type": "response.content_part.done", **head, "content_index": 0, "part": part}
            )
        else:
            out.append(
                {
                    "type": "response.function_call_arguments.done",
                    **head,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        out.append({"type": "response.output_item.done", "output_index": i, "item": _copy(item)})
        return out

    def feed(self, d: Delta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not d.reasoning:  # a message's tokens (logprobs asked for): with its next text
            self.logprobs += d.logprobs
        for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
            if not text:
                continue
            if self.open is None or self.open["type"] != kind:
                out += self._start(_new_item(kind))
            part = _part(self.open)
            part["text"] += text
            event = "output_text" if kind == "message" else "reasoning_text"
            delta = {
                "type": f"response.{event}.delta",
                "item_id": self.open["id"],
                "output_index": len(self.items) - 1,
                "content_index": 0,
                "delta": text,
            }
            if kind == "message":
                delta["logprobs"], self.logprobs = self.logprobs, []
                part["logprobs"] += delta["logprobs"]
            out.append(delta)
        pieces = d.call_pieces if self.streaming else [whole(c) for c in d.tool_calls]
        for piece in pieces:  # a call's first piece opens its item (tool_calls.py)
            fn = piece["function"]
            if "id" in piece:
                space, name = self.spaces.get(fn["name"], (None, fn["name"]))
                item = {
                    "type": "function_call",
                    "id": new_id("fc").replace("-", "_"),
                    "call_id": piece["id"],
                    "name": name,
                    "arguments": "",
                    "status": "in_progress",
                }
                if space is not None:
                    item["namespace"] = space
                out += self._start(item)
            if fn["arguments"]:
                assert self.open is not None  # pieces go on the call their first one opened
                self.open["arguments"] += fn["arguments"]
                out.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.open["id"],
                        "output_index": len(self.items) - 1,
                        "delta": fn["arguments"],
                    }
                )
        return out


def whole(call: dict[str, Any]) -> dict[str, Any]:
    """A whole call as one piece of the stream's shape."""
    return {"id": call["id"], "function": call["function"]}


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "message":
        return {
            "type": "message",
            "id": new_id("msg").replace("-", "_"),
            "status": "in_progress",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
    return {
        "type": "reasoning",
        "id": new_id("rs").replace("-", "_"),
        "status": "in_progress",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": ""}],
    }


def _part(item: dict[str, Any]) -> dict[str, Any]:
    return item["content"][0]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def as_items(output: list[dict[str, Any]]) -> list[Item]:
    """A response's output items as input items (what previous_response_id continues)."""
    out = []
    for it in output:
        if it["type"] == "message":
            out.append(Item(role="assistant", content=_part(it)["text"]))
        elif it["type"] == "function_call":
            out.append(
                Item(
                    type="function_call",
                    call_id=it["call_id"],
                    name=it["name"],
                    namespace=it.get("namespace"),
                    arguments=it["arguments"],
                )
            )
        else:
            out.append(Item(type="reasoning", content=_part(it)["text"]))
    return out
