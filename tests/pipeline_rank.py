"""One rank of a pipelined run, started by the tests with `mlx.launch` (tests/test_pipeline.py).

    mlx.launch --backend ring -n N python tests/pipeline_rank.py JOBS.json OUT_DIR

For each job ({"model", "prompt", "steps", "split"}) every rank loads its share with
`mlxlis.load` (float32), prefills the prompt and takes `steps` greedy steps through the same
pieces `generate` uses (prefill, the PipelineNet, the shared token). The last rank writes the
logits of each step to OUT_DIR/JOB-logits.npy; every rank writes OUT_DIR/JOB-rank-R.json with
its part, the tokens and its memory: resident set before the load, and its peak (VmHWM, reset
before each job) after the job. A job of "kind": "chat" runs `chat_turns` on rank 0 while the
other ranks `follow` it, and writes rank 0's turns to OUT_DIR/JOB-rank-0.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlxlis  # noqa: F401  (chooses the BLAS before mlx.core loads)
from mlxlis.device import proc_bytes
from mlxlis.generate import prefill

import mlx.core as mx
import numpy as np


def reset_peak() -> None:
    # "5" resets VmHWM to the current resident set (Linux ≥ 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run(job: dict, out: Path) -> None:
    start = time.perf_counter()
    reset_peak()
    before = proc_bytes("/proc/self/status", "VmRSS")
    model = mlxlis.load(job["model"], "float32", layers_split=job.get("split"))
    net = model.net
    ids = model.tokenizer.encode(job["prompt"])
    cache = model.make_cache()
    out_arr = prefill(net, ids, cache)  # the chunks generate uses
    tokens, logits = [], []
    for i in range(job["steps"] + 1):
        y = None
        if net.is_last:
            logits.append(np.array(out_arr[0]))
            y = mx.argmax(out_arr, axis=-1)
        token = net.share(y, after=out_arr).tolist()[0]
        tokens.append(token)
        if i < job["steps"]:
            step_in = mx.array([[token]], dtype=mx.int32)
            out_arr = net(step_in, cache=cache, last_only=True)[:, -1, :].astype(mx.float32)
    name = job["name"]
    if net.is_last:
        np.save(out / f"{name}-logits.npy", np.stack(logits))
    part = net.part
    report = {
        "rank": part.rank, "size": part.size, "start": part.start, "stop": part.stop,
        "part_bytes": part.nbytes, "ids": ids, "tokens": tokens,
        "rss_before": before, "peak_rss": proc_bytes("/proc/self/status", "VmHWM"),
        "weight_bytes": sum(v.nbytes for _, v in _arrays(net)),
        "seconds": time.perf_counter() - start,
        "layers": sorted({int(k.split(".")[2]) for k, _ in _arrays(net)
                          if k.startswith("model.layers.")}),
    }  # fmt: skip
    (out / f"{name}-rank-{part.rank}.json").write_text(json.dumps(report))
    del model, net, cache, out_arr
    mx.clear_cache()


def chat_turns(model, turns: list) -> list:
    """A ChatSession through `turns` ([text, stop after k tokens, leave the stream after k
    tokens]): each assistant turn's (text, stopped, prompt tokens reused, context used)."""
    from mlxlis import ChatSession, SamplingParams

    session = ChatSession(model, sampling=SamplingParams(max_tokens=8))
    out = []
    for text, stop_after, leave_after in turns:
        seen = [0]
        events = session.send(text, should_stop=lambda k=stop_after, seen=seen:
                              k is not None and seen[0] >= k)  # fmt: skip
        for ev in events:
            seen[0] += ev.token is not None
            if leave_after is not None and seen[0] >= leave_after:
                events.close()
                break
        t = session.turns[-1]
        out.append([t.content, t.stopped, session.last_reused_tokens, session.context_used])
    return out


def run_chat(job: dict, out: Path) -> None:
    """Rank 0 chats (the app's part), the other ranks follow it (mlxlis chat under a launcher)."""
    from mlxlis.distributed.follow import finish, follow

    model = mlxlis.load(job["model"], "float32")
    ranks = model.net.ranks
    if ranks.rank != 0:
        follow(model)
        return
    try:
        turns = chat_turns(model, job["turns"])
    finally:
        finish(ranks)
    (out / f"{job['name']}-rank-0.json").write_text(json.dumps(turns))


def _arrays(net):
    from mlx.utils import tree_flatten

    seen = {}
    for k, v in tree_flatten(net.parameters()):
        seen[id(v)] = (k, v)
    return list(seen.values())


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    for job in jobs:
        (run_chat if job.get("kind") == "chat" else run)(job, out)


if __name__ == "__main__":
    main()
