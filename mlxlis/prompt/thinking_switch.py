"""The values that turn a chat template's thinking on or off, found from the template itself.

Templates spell the switch differently: Qwen3's `enable_thinking`, Kimi K3's and DeepSeek
V3.1's `thinking`, MiniMax-M3's `thinking_mode` ("enabled" / "disabled"), Seed-OSS'
`thinking_budget` (0: off), Cohere's `reasoning` and the `reasoning_effort` of Tencent Hy3
("no_think": off), Cohere ("none") and Solar Open ("minimal"). `thinking_vars` sets each of
them that the template reads (`ChatTemplate.variables`) and that works there: a probe
conversation's generation prompt renders with both its on and off values, and the two prompts
differ (so a template whose default is on, or off, still gets both). The values are the
reasoning-style probe's (reasoning_styles.py).

`reasoning_effort` is a level in some templates and a switch in others, so an off value
counts only where the prompt changes by more than the value written into it: gpt-oss prints
any level ("Reasoning: none") and has no off, so its `reasoning_effort` is left alone. Its
off values are tried in the probe's order, the first whose prompt shows thinking off (ends
in an empty reasoning block, or no longer opens one) preferred.
"""

from __future__ import annotations

import functools
from typing import Any

from mlxlis.prompt.reasoning_styles import (
    PROBE_USER,
    TABLE,
    THINKING_OFF,
    THINKING_ON,
    closes_empty_block,
    opens_block,
    render,
)
from mlxlis.prompt.template import ChatTemplate

# the switches, in the probe's order; two are on at the template's default, so the probe
# leaves them out of THINKING_ON: Seed-OSS' unlimited budget (-1) and Cohere's `reasoning`
SWITCHES: tuple[str, ...] = tuple(THINKING_OFF[0])
ON: dict[str, Any] = {
    "thinking_budget": -1,
    "reasoning": True,
    **{k: v for k, v in THINKING_ON.items() if k in SWITCHES},
}


def _off_values(name: str) -> list[Any]:
    """The off values of `name`, in the probe's order, each once."""
    out: list[Any] = []
    for switches in THINKING_OFF:
        if switches[name] not in out:
            out.append(switches[name])
    return out


def _shows_off(on: str, off: str) -> bool:
    """`off` (the prompt with thinking off) ends in an empty reasoning block, or no longer
    opens the block `on` opens."""
    return any(
        closes_empty_block(off, s) or (opens_block(on, s) and not opens_block(off, s))
        for s in TABLE
    )


def _echoed(on: str, off: str, on_value: Any, off_value: Any) -> bool:
    """The off prompt is the on prompt with the value written in its place and nothing else
    changed: a level the template prints, not a switch."""
    return isinstance(off_value, str) and off.replace(off_value, str(on_value)) == on


def _switch(template: ChatTemplate, name: str) -> tuple[Any, Any] | None:
    """(on value, off value) of `name` where it works in `template` (see the module)."""
    on_value = ON[name]
    on = render(template, [PROBE_USER], True, {name: on_value})
    if on is None:
        return None
    found: list[tuple[Any, bool]] = []
    for value in _off_values(name):
        off = render(template, [PROBE_USER], True, {name: value})
        if off is None or off == on or _echoed(on, off, on_value, value):
            continue
        found.append((value, _shows_off(on, off)))
    if not found:
        return None
    return on_value, next((v for v, shows in found if shows), found[0][0])


@functools.lru_cache(maxsize=32)
def _switches(template: ChatTemplate) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the on values, the off values) of every switch `template` reads and that works there."""
    on: dict[str, Any] = {}
    off: dict[str, Any] = {}
    for name in SWITCHES:
        if name in template.variables and (values := _switch(template, name)) is not None:
            on[name], off[name] = values
    return on, off


def thinking_vars(template: ChatTemplate, on: bool) -> dict[str, Any]:
    """The template variables that turn `template`'s thinking on (`on`) or off: empty for a
    template with no thinking switch. Found once per template."""
    return dict(_switches(template)[0 if on else 1])


def has_thinking_switch(template: ChatTemplate) -> bool:
    """`template` reads a thinking switch that works (any of SWITCHES)."""
    return bool(_switches(template)[0])
