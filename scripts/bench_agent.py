"""`make bench` (agent): time to first token per turn of an agent's session, cold vs reused.

A scripted 10-turn tool-using session (a system prompt of ~2 000 tokens of tool definitions,
then per turn a reply with its reasoning and a tool call and the tool's result, ~250 tokens)
grows past 4 000 tokens. Its template drops past reasoning and trims past replies, as
reasoning templates do, so each prompt parts from the cached one where the previous prompt
ended before its generation prompt. Each turn runs twice: cold (the generation core on fresh
caches) and reused (the serving engine, whose prefix cache holds the previous turn's prompt
and reply; the reply is forced token by token, so the cache holds what a server's would). TTFT
is the core's own (from admission, the prefix cache's rewind included, to the first token);
the CPU seconds the process spent until then are shown too (steadier than wall time when
other work shares the cores).

Models: smollm2-135m (full attention), gemma3-270m (sliding window 512 on 5 of 6 layers), and a
random Qwen3.5 hybrid at a realistic width (hidden 1024, 8 layers, 3 Gated DeltaNet : 1 full
attention, float32, smollm2's tokenizer). Prints a markdown table per model; writes
bench-results/agent.json.

usage: python scripts/bench_agent.py [--models smollm2-135m,gemma3-270m,qwen3.5-random]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxlis  # noqa: E402  (the BLAS before mlx.core)
from mlxlis.cache.prefix import PrefixCache  # noqa: E402
from mlxlis.generation.core import Core, Request  # noqa: E402
from mlxlis.generation.engine import Engine  # noqa: E402
from mlxlis.generation.generate import run  # noqa: E402
from mlxlis.generation.processors import LogitsProcessor  # noqa: E402
from mlxlis.generation.request import turn_start  # noqa: E402
from mlxlis.generation.sampling import SamplingParams  # noqa: E402
from mlxlis.generation.steps import LocalSteps  # noqa: E402
from mlxlis.models.model import Model  # noqa: E402
from mlxlis.prompt.template import ChatTemplate  # noqa: E402

import mlx.core as mx  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m", "qwen3.5-random")
TEMPLATE = r"""
{%- for m in messages %}
{%- if m.role == 'system' %}
{{- '<|im_start|>system\n' + m.content }}
{%- if tools %}
{{- '\n\n# Tools' }}
{%- for t in tools %}
{{- '\n' + (t | tojson) }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (m.content | trim) }}
{%- for c in m.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + c.function.name + '", "arguments": ' }}
{{- (c.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %}"""
GEMMA = (
    TEMPLATE.replace("<|im_start|>assistant", "<start_of_turn>model")
    .replace("<|im_start|>", "<start_of_turn>")
    .replace("<|im_end|>", "<end_of_turn>")
)
DOC = (
    "Use it when the task needs it; it returns plain text. Paths are relative to the "
    "repository root, and a missing file is an error the model should read and recover from. "
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ').capitalize()}. " + DOC * 3,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "A file or folder."},
                    "pattern": {"type": "string", "description": "A regular expression."},
                },
                "required": ["path"],
            },
        },
    }
    for name in (
        "read_file",
        "write_file",
        "edit_file",
        "list_folder",
        "search_text",
        "run_tests",
        "run_command",
        "git_diff",
        "git_log",
        "web_fetch",
        "todo_write",
        "ask_user",
    )
]


def turn(i: int) -> tuple[str, str, dict, str]:
    """(reasoning, answer, tool call, tool result) of turn i."""
    call = {
        "name": TOOLS[i % len(TOOLS)]["function"]["name"],
        "arguments": {"path": f"src/m{i}.py"},
    }
    reasoning = f"The failing test points at src/m{i}.py; I should look at it before editing."
    answer = f"  Let me check src/m{i}.py.  "
    lines = [
        f"def helper_{i}_{j}(values, scale={j}):\n    return [v * scale for v in values]"
        for j in range(8)
    ]
    return reasoning, answer, call, "\n".join(lines)


class Forced(LogitsProcessor):
    """Forces the scripted reply token by token (random weights or not, the cache then holds
    what a server's would)."""

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __call__(self, logits: mx.array, history) -> mx.array:
        hot = (mx.arange(logits.shape[-1]) == self.ids[len(history) - self.start])[None]
        return mx.where(hot, mx.array(0.0, logits.dtype), mx.array(-mx.inf, logits.dtype))


def random_hybrid(base: Model) -> Model:
    """A random Qwen3.5 hybrid at a realistic width on `base`'s tokenizer and template."""
    from mlxlis.models import build_model, config_from_hf

    from mlx.utils import tree_flatten, tree_unflatten

    raw = {
        "model_type": "qwen3_5_text",
        "vocab_size": base.config.vocab_size,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    }
    raw["layer_types"] = raw["layer_types"] * 2
    cfg = config_from_hf(raw, "<random qwen3.5>")
    net = build_model(cfg)
    mx.random.seed(0)
    params = {
        k: mx.random.normal(v.shape) * 0.02 if v.ndim > 1 else mx.ones(v.shape) * 0.5
        for k, v in tree_flatten(net.parameters())
    }
    for k in params:
        if k.endswith("A_log"):  # decays A = exp(A_log) in [0.5, 4], as real checkpoints have
            params[k] = mx.log(mx.random.uniform(0.5, 4.0, params[k].shape))
    net.update(tree_unflatten(list(params.items())))
    mx.eval(net.parameters())
    return Model(
        cfg,
        net,
        base.tokenizer,
        dtype=mx.float32,
        path=base.path,
        fmt="random",
        template=base.template,
    )


def load(name: str) -> tuple[Model, str]:
    """The model and its end-of-turn marker, with the agent template."""
    if name == "qwen3.5-random":
        return random_hybrid(load("smollm2-135m")[0]), "<|im_end|>"
    model = mlxlis.load(name, "float32")
    gemma = name.startswith("gemma")
    model.template = ChatTemplate(source="bench_agent", text=GEMMA if gemma else TEMPLATE)
    return model, "<end_of_turn>" if gemma else "<|im_end|>"


def first_token(events) -> tuple[float, object]:
    """CPU seconds of this process (every thread) until the first event, and the last event."""
    t0, cpu, final = time.process_time(), None, None
    for ev in events:
        cpu = time.process_time() - t0 if cpu is None else cpu
        final = ev
    assert final.finish_reason in ("stop", "length"), final.error
    return cpu, final


def ttft(engine: Engine, req: Request) -> tuple[float, float, int]:
    """(TTFT, its CPU seconds, tokens reused) of `req` on the session's engine."""
    cpu, final = first_token(engine.submit(req))
    return final.usage.time_to_first_token, cpu, final.usage.cached_tokens


def cold_ttft(model: Model, ids: list[int]) -> tuple[float, float]:
    """The same core steps on fresh caches (here: the engine's loop holds the MLX thread)."""
    core = Core(model, LocalSteps(model, PrefixCache(0)))
    cpu, final = first_token(run(core, core.start(Request(ids, SamplingParams(max_tokens=1)))))
    return final.usage.time_to_first_token, cpu


def warm_up(model: Model, ids: list[int]) -> None:
    """The kernels compiled on both threads (MLX compiles per thread; the first 512-token
    chunk of the hybrid took 49 s before): the core's here, the engine's on the MLX thread,
    through an engine that keeps nothing."""
    cold_ttft(model, ids)
    engine = Engine(model, prefix_cache_bytes=0)
    try:
        ttft(engine, Request(ids, SamplingParams(max_tokens=4, temperature=0.0)))
    finally:
        engine.shutdown()


def session(name: str, turns: int) -> list[dict]:
    model, end = load(name)
    tok = model.tokenizer
    stop = tok.encode(end, special=True, add_bos=False)  # Gemma adds a BOS
    messages = [
        {"role": "system", "content": "You are a coding agent working in a git repository."},
        {"role": "user", "content": "The test suite fails in src/: find the bug and fix it."},
    ]
    warm = tok.encode(model.render_chat(messages, tools=TOOLS), special=True)
    warm_up(model, warm)
    engine = Engine(model)
    rows = []
    try:
        for i in range(turns):
            reasoning, answer, call, result = turn(i)
            ids = tok.encode(model.render_chat(messages, tools=TOOLS), special=True)
            text = (
                f"{reasoning}\n</think>\n\n{answer}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
            )
            reply = tok.encode(text, special=True, add_bos=False) + stop
            cold, cold_cpu = cold_ttft(model, ids)
            params = SamplingParams(max_tokens=len(reply) + 1, temperature=0.0)
            req = Request(
                ids,
                params,
                frozenset(stop),
                processors=(Forced(len(ids), reply),),
                snapshot_at=turn_start(model, messages, ids, tools=TOOLS),
            )
            warm, warm_cpu, reused = ttft(engine, req)
            rows.append(
                dict(
                    turn=i + 1,
                    prompt=len(ids),
                    reused=reused,
                    cold=cold,
                    warm=warm,
                    cold_cpu=cold_cpu,
                    warm_cpu=warm_cpu,
                )
            )
            print(json.dumps({"model": name, **rows[-1]}), file=sys.stderr, flush=True)
            function = {"name": call["name"], "arguments": call["arguments"]}
            messages += [
                {
                    "role": "assistant",
                    "content": answer,
                    "reasoning_content": reasoning,
                    "tool_calls": [{"id": f"c{i}", "type": "function", "function": function}],
                },
                {"role": "tool", "tool_call_id": f"c{i}", "content": result},
            ]
    finally:
        engine.shutdown()
    return rows


def table(name: str, rows: list[dict]) -> str:
    out = [
        f"**{name}**\n",
        "| turn | prompt tokens | reused | cold TTFT | reused TTFT | ratio | CPU s cold / reused "
        "| CPU ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['turn']} | {r['prompt']} | {r['reused']} | {r['cold']:.2f} s | "
            f"{r['warm']:.2f} s | {r['warm'] / r['cold']:.2f} | {r['cold_cpu']:.1f} / "
            f"{r['warm_cpu']:.1f} | {r['warm_cpu'] / r['cold_cpu']:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--turns", type=int, default=10)
    a = p.parse_args()
    results = {name: session(name, a.turns) for name in a.models.split(",")}
    for name, rows in results.items():
        print(table(name, rows) + "\n")
    out = ROOT / "bench-results" / "agent.json"
    out.parent.mkdir(exist_ok=True)
    kept = json.loads(out.read_text()) if out.is_file() else {}  # the other models' last run
    out.write_text(json.dumps({**kept, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
