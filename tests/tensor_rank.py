"""One rank of a tensor-parallel run, started by the tests with `mlx.launch` (tests/test_tensor.py).

    mlx.launch --backend ring -n N python tests/tensor_rank.py JOBS.json OUT_DIR

A job {"name", "models": [one per rank]} loads a different file on each rank and writes
OUT_DIR/JOB-rank-R.json with the error the load raised. For each other job ({"name", "model",
"prompt", "steps"}) every rank loads the model with
`mlxlis.load(model, "float32", tensor=N)` (its slices of every layer); rank 0 runs
`mlxlis.generate` (the generation core, its steps led from rank 0) for `steps` + 1 greedy tokens
while the other ranks `follow` — speculating when the job says "speculative" (n-gram, or a
draft model held whole on rank 0), constrained when it gives a "format", a chat turn with an
image before the prompt when it gives an "image" (rank 0 runs the tower). Rank 0 writes each
step's logits (its own: every rank holds the whole logits) to OUT_DIR/JOB-logits.npy; every
rank writes OUT_DIR/JOB-rank-R.json with its layout, the tokens and the drafts proposed and
kept (rank 0), the weight bytes it holds and the KV-cache bytes of the prompt run again
through caches of its own (every rank alike).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import mlxlis  # noqa: F401  (chooses the BLAS before mlx.core loads)
from mlxlis.distributed import held_alone, world
from mlxlis.distributed.leader import LeaderSteps, finish, follow, ranks_of
from mlxlis.errors import MlxlisError
from mlxlis.generation.speculative import Speculation
from mlxlis.generation.steps import pipeline_steps

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


class Recording(LeaderSteps):
    """Rank 0's steps, keeping each step's logits."""

    seen: list[np.ndarray] = []

    def run(self, rids, caches, tokens, kind, inserts=None, *, hidden=False, lanes=None):
        out = super().run(rids, caches, tokens, kind, inserts, hidden=hidden, lanes=lanes)
        if out is not None:
            Recording.seen.append(np.array(out[0]))
        return out


def kv_bytes(caches) -> int:
    return sum(a.nbytes for c in caches for a in c.state)


def seen_prompt(model, job: dict):
    """A chat turn holding the job's "image" (a file) before its prompt, as the model's
    template and processor make it (the same call a lone process makes)."""
    content = [{"type": "image", "path": job["image"]}, {"type": "text", "text": job["prompt"]}]
    return model.encode_chat([{"role": "user", "content": content}])


def asked(job: dict) -> dict:
    """generate's keywords for a job: greedy with no stop ids, or with "speculative" ("ngram",
    or a draft model's folder: loaded whole on rank 0 only) drafting 4 tokens a verification,
    or with "format" (a response_format: the model's own stop ids end the reply)."""
    if "format" in job:
        return {"response_format": job["format"]}
    if "speculative" not in job:
        return {"stop_ids": set()}
    kind, draft = job["speculative"], None
    if kind != "ngram":
        with held_alone():
            draft = mlxlis.load(kind, "float32")
        kind = "draft"
    return {"stop_ids": set(), "speculation": Speculation(kind, draft, tokens=4)}


def run(job: dict, out: Path, size: int) -> None:
    gc.collect()  # an earlier job's model, freed before this load is measured
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # what an earlier job still holds
    if "models" in job:  # one file per rank: the load is expected to refuse them
        rank = world().rank
        try:
            mlxlis.load(job["models"][rank], "float32", tensor=size)
            error = ""
        except MlxlisError as e:
            error = f"{type(e).__name__}: {e}"
        (out / f"{job['name']}-rank-{rank}.json").write_text(json.dumps({"error": error}))
        return
    # "tensor": a group smaller than the ranks (2 × 2: tensor pairs inside pipeline stages)
    tensor, template = job.get("tensor", size), job.get("template")  # a GGUF without one
    model = mlxlis.load(job["model"], "float32", tensor=tensor, chat_template=template)
    load_peak = mx.get_peak_memory() - before  # MLX's memory at its highest during the load
    ids = model.tokenizer.encode(job["prompt"])
    tokens: list[int] = []
    usage = {}
    if model.rank == 0:
        pipeline_steps(Recording)
        Recording.seen = []
        try:
            prompt = seen_prompt(model, job) if "image" in job else ids
            events = list(mlxlis.generate(model, prompt, max_tokens=job["steps"] + 1, **asked(job)))
            tokens = [e.token for e in events if e.token is not None]
            u = events[-1].usage
            usage = {"draft_tokens": u.draft_tokens, "accepted_tokens": u.accepted_tokens}
        finally:
            pipeline_steps(LeaderSteps)
            finish(ranks_of(model))
        np.save(out / f"{job['name']}-logits.npy", np.stack(Recording.seen))
    else:
        follow(model)
    # every rank: the prompt through its own caches, outside the leader (a collective all the
    # ranks run alike): their KV bytes per token, this rank's heads only
    from mlxlis.generation.steps import prefill

    cache = model.make_cache()
    mx.eval(prefill(model.net, ids, cache))
    kv = {"kv_bytes": kv_bytes(cache)}
    layout = model.part
    held = {id(v): v.nbytes for _, v in tree_flatten(model.net.parameters())}
    report = {
        "rank": layout.rank,
        "size": layout.size,
        "layout": layout.describe(),
        "q_heads": [layout.q_heads.start, layout.q_heads.stop],
        "kv_heads": [layout.kv_heads.start, layout.kv_heads.stop],
        "layers": [layout.layers.start, layout.layers.stop],
        "ids": ids,
        "tokens": tokens,
        "weight_bytes": sum(held.values()),
        "load_peak": load_peak,
        "largest": max(held.values()),
        "vision": model.vision is not None,  # the tower loaded on this rank
        **usage,
        **kv,
    }
    (out / f"{job['name']}-rank-{layout.rank}.json").write_text(json.dumps(report))
    del model
    mx.clear_cache()


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    size = world().size
    for job in jobs:
        run(job, out, size)


if __name__ == "__main__":
    main()
