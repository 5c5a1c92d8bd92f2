"""One rank of a pipelined run, started by the tests with `mlx.launch` (tests/test_pipeline.py).

    mlx.launch --backend ring -n N python tests/pipeline_rank.py JOBS.json OUT_DIR

For each job ({"model", "prompt", "steps", "split"}) every rank loads its share with
`mlxlis.load` (float32); rank 0 runs `mlxlis.generate` (the generation core, its steps led
from rank 0 and announced to the others) for `steps` + 1 greedy tokens while the other ranks
`follow`. Rank 0 writes the logits of each step (the last rank's, as rank 0 samples them) to
OUT_DIR/JOB-logits.npy; every rank writes OUT_DIR/JOB-rank-R.json with its part, the tokens
(rank 0) and its memory: resident set before the load, and its peak (VmHWM, reset before each
job) after the job. A job of "kind": "chat" runs `chat_turns` on rank 0 while the other ranks
`follow` it, and writes rank 0's turns to OUT_DIR/JOB-rank-0.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlxlis  # noqa: F401  (chooses the BLAS before mlx.core loads)
from mlxlis.distributed.leader import LeaderSteps, finish, follow, ranks_of
from mlxlis.generation.steps import pipeline_steps
from mlxlis.runtime.device import proc_bytes

import mlx.core as mx
import numpy as np


def reset_peak() -> None:
    # "5" resets VmHWM to the current resident set (Linux ≥ 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Recording(LeaderSteps):
    """Rank 0's steps, keeping each step's logits (what the last rank sent back)."""

    seen: list[np.ndarray] = []

    def run(self, rids, caches, tokens, kind, inserts=None, *, hidden=False, lanes=None):
        out = super().run(rids, caches, tokens, kind, inserts, hidden=hidden, lanes=lanes)
        if out is not None:
            Recording.seen.append(np.array(out[0]))
        return out


def run(job: dict, out: Path) -> None:
    start = time.perf_counter()
    reset_peak()
    before = proc_bytes("/proc/self/status", "VmRSS")
    model = mlxlis.load(job["model"], "float32", layers_split=job.get("split"))
    net = model.net
    ids = model.tokenizer.encode(job["prompt"])
    tokens: list[int] = []
    if model.rank == 0:
        pipeline_steps(Recording)
        Recording.seen = []
        try:
            tokens = [
                e.token
                for e in mlxlis.generate(model, ids, max_tokens=job["steps"] + 1, stop_ids=set())
                if e.token is not None
            ]
        finally:
            pipeline_steps(LeaderSteps)
            finish(ranks_of(model))
        np.save(out / f"{job['name']}-logits.npy", np.stack(Recording.seen))
    else:
        follow(model)
    part = net.part
    report = {
        "rank": part.rank,
        "size": part.size,
        "start": part.start,
        "stop": part.stop,
        "part_bytes": part.nbytes,
        "ids": ids,
        "tokens": tokens,
        "rss_before": before,
        "peak_rss": proc_bytes("/proc/self/status", "VmHWM"),
        "weight_bytes": sum(v.nbytes for _, v in _arrays(net)),
        "seconds": time.perf_counter() - start,
        "layers": sorted(
            {int(k.split(".")[2]) for k, _ in _arrays(net) if k.startswith("model.layers.")}
        ),
    }
    (out / f"{job['name']}-rank-{part.rank}.json").write_text(json.dumps(report))
    del model, net
    mx.clear_cache()


def chat_turns(model, turns: list) -> list:
    """A ChatSession through `turns` ([text, stop after k tokens, leave the stream after k
    tokens]): each assistant turn's (text, stopped, prompt tokens reused, context used)."""
    from mlxlis import ChatSession, SamplingParams

    session = ChatSession(model, sampling=SamplingParams(max_tokens=8))
    out = []
    for text, stop_after, leave_after in turns:
        seen = [0]
        events = session.send(
            text, should_stop=lambda k=stop_after, seen=seen: k is not None and seen[0] >= k
        )
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
    model = mlxlis.load(job["model"], "float32")
    if model.rank != 0:
        follow(model)
        return
    try:
        turns = chat_turns(model, job["turns"])
    finally:
        finish(ranks_of(model))
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
