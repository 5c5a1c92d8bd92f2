"""The short table of a GPU run (scripts/gpu_check.py's JSON), as gpu_check.md has it.

usage: python scripts/gpu_table.py gpu_check.json
"""

from __future__ import annotations

import json
import sys

DTYPES = ("float16", "bfloat16")


def table(data: dict) -> str:
    env = data["env"].get("policy", {})
    lines = [
        f"device: {env.get('policy')} · {env.get('device_info', {}).get('device_name')} · "
        f"mlx {env.get('mlx')} · budget {env.get('memory_budget', 0) / 2**30:.1f} GiB",
        "",
        "| model | dtype | top-1 | max Δlogit | greedy = | tok/s b1 / b8 (prefill; decode) "
        "| mlx-lm b1 / b8 | of 3.35 TB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, e in data["catalog"].items():
        name, dtype = key.rsplit(" ", 1)
        if "parity" not in e:
            lines.append(f"| {name} | {dtype} | {e.get('error') or e.get('skipped')} |||||||")
            continue
        p, m, lm = e["parity"], e.get("mlxlis", {}), e.get("mlx_lm", {})

        def tps(s):
            runs = [s[b] for b in ("b1", "b8") if b in s]
            return " / ".join(f"{r['prefill_tps']:.0f}; {r['decode_tps']:.0f}" for r in runs)

        share = m.get("bandwidth_share", 0)
        lines.append(
            f"| {name} | {dtype} | {p['top1']:.3f} | {p['max_abs_diff']:.3g} "
            f"(of {p['ref_max_abs']:.3g}) | {e['greedy_equal_prefix'][0]}/"
            f"{e['greedy_equal_prefix'][1]} | {tps(m)} | {tps(lm) or e.get('error', '')} "
            f"| {share:.1%} |"
        )
    lines += ["", "| family | " + " | ".join(f"{d} top-1, max Δ" for d in DTYPES) + " |"]
    lines.append("|---|" + "---|" * len(DTYPES))
    for name, e in data["tiny"].items():
        cells = []
        for d in DTYPES:
            c = e.get(d) or {"error": e.get("error") or e.get("skipped")}
            ok = "top1" in c
            cells.append(f"{c['top1']:.3f}, {c['max_abs_diff']:.3g}" if ok else c["error"])
        lines.append(f"| {name} | " + " | ".join(str(c)[:80] for c in cells) + " |")
    for name, e in data["server"].items():
        lines.append(f"\nserver, 8 clients, {name}: {e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(json.load(f)))
