"""The layer split of a pipelined run (mlxlis.distributed.split) and `inspect --split`, in one
process: no launcher, no weights read.

Proves: the default split minimises the largest rank's bytes (checked against every possible
split, on random layer sizes and on SmolLM2's real ones); each tensor is read by exactly the
ranks that use it (the embedding also by the last rank when the head is tied); bad splits and
sizes are refused with errors naming the flag or variable; `inspect --split` reports parts that
cover the layers in order, each rank's bytes those of its tensors.
"""

from __future__ import annotations

import itertools
import json
import random

from mlxlis.commands.cli import main
from mlxlis.distributed.split import (
    Part,
    balanced_split,
    check_fit,
    check_split,
    plan_parts,
)
from mlxlis.errors import ConfigError, DoesNotFitError, LayersSplitError
from mlxlis.settings import parse_bytes, parse_split

import pytest
from conftest import need_pulled


def brute_force(per_layer, ranks, first, last) -> int:
    """The smallest possible largest rank load, over every contiguous split."""
    n, best = len(per_layer), None
    for cuts in itertools.combinations(range(1, n), ranks - 1):
        bounds = (0, *cuts, n)
        loads = [sum(per_layer[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = max(loads) if best is None else min(best, max(loads))
    return best


def load_of(split, per_layer, first, last) -> int:
    loads, start = [], 0
    for k in split:
        loads.append(sum(per_layer[start : start + k]))
        start += k
    loads[0] += first
    loads[-1] += last
    return max(loads)


def test_balanced_split_is_optimal_on_random_sizes():
    """200 random models (2-9 layers, 1-4 ranks, extra bytes at the ends): the split has one
    layer or more per rank, covers every layer and reaches the brute-force optimum."""
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 9)
        ranks = rng.randint(1, min(4, n))
        per_layer = [rng.randint(1, 100) for _ in range(n)]
        first, last = rng.randint(0, 150), rng.randint(0, 150)
        split = balanced_split(per_layer, ranks, first, last)
        assert len(split) == ranks and min(split) >= 1 and sum(split) == n
        assert load_of(split, per_layer, first, last) == brute_force(per_layer, ranks, first, last)


def test_parts_route_each_tensor_to_the_ranks_that_use_it():
    sizes = {f"model.layers.{i}.mlp.up_proj.weight": 10 for i in range(4)}
    sizes |= {"model.embed_tokens.weight": 7, "model.norm.weight": 1}
    for tied in (True, False):
        parts = plan_parts(sizes | ({} if tied else {"lm_head.weight": 7}), 4, 2, tied, [3, 1])
        assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 4)]
        first, last = parts
        assert first.holds("model.layers.2.self_attn.q_proj.weight")
        assert not first.holds("model.layers.3.self_attn.q_proj.weight")
        assert last.holds("model.layers.3.self_attn.q_proj.bias")
        assert first.holds("model.embed_tokens.weight")
        assert last.holds("model.embed_tokens.scales") is tied
        assert last.holds("model.norm.weight") and not first.holds("model.norm.weight")
        assert last.holds("lm_head.weight") and not first.holds("lm_head.weight")
        assert (first.nbytes, last.nbytes) == (37, 10 + 1 + 7)


@pytest.mark.parametrize(
    ("split", "layers", "ranks", "says"),
    [
        ([10, 10, 10], 30, 2, "10,10,10 has 3 entries but 2 ranks run"),
        ([15, 15], 30, 1, "has 2 entries but this process runs alone"),
        ([14, 14], 30, 2, "14,14 adds up to 28 layers; the model has 30"),
        ([30, 0], 30, 2, "every rank needs a positive whole number of layers"),
    ],
)
def test_check_split_names_what_is_wrong(split, layers, ranks, says):
    with pytest.raises(LayersSplitError, match=says) as e:
        check_split(split, layers, ranks)
    assert e.value.field == "--layers-split"


@pytest.mark.parametrize("text", ["", "a", "1,", "1;2", "2.0,3", "0", "1,-2", " , "])
def test_parse_split_refuses_anything_but_positive_integers(text):
    with pytest.raises(LayersSplitError):
        parse_split(text)


def test_parse_split_and_sizes():
    assert parse_split(" 14, 14 ") == [14, 14]
    assert parse_bytes("24G", "X") == 24 << 30 and parse_bytes("512m", "X") == 512 << 20
    assert parse_bytes("1.5GiB", "X") == 3 << 29 and parse_bytes("1000", "X") == 1000
    with pytest.raises(ConfigError, match="MLXLIS_MAX_MEMORY"):
        parse_bytes("lots", "MLXLIS_MAX_MEMORY")


def test_check_fit_names_every_rank_over_its_memory():
    check_fit([5, 5], [5, 6], "m.gguf")  # fits exactly
    with pytest.raises(DoesNotFitError, match="rank 1 needs 1.00 GiB and has 0.50") as e:
        check_fit([1 << 29, 1 << 30, 1 << 30], [1 << 30, 1 << 29, 1 << 29], "m.gguf")
    assert "rank 2 needs" in str(e.value) and "rank 0 needs" not in str(e.value)


def test_part_describes_itself():
    assert Part(0, 2, 0, 15, True).describe() == "rank 0 of 2: layers 0-14, embedding"
    assert Part(1, 2, 15, 30, True).describe() == "rank 1 of 2: layers 15-29, embedding, head"


def test_inspect_split_reports_the_balanced_parts(capsys):
    """`inspect smollm2-135m --split 3 --json`: three parts covering layers 0-29 in order, the
    largest as small as any split allows (brute force over SmolLM2's real tensor sizes)."""
    need_pulled("smollm2-135m")
    from mlxlis.distributed.placement import _header
    from mlxlis.distributed.split import layer_bytes

    assert main(["inspect", "smollm2-135m", "--split", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ranks"] == 3 and r["layers"] == 30
    spans = [p["layers"] for p in r["parts"]]
    assert spans[0][0] == 0 and spans[-1][1] == 29
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(spans))
    cfg, sizes, _ = _header("smollm2-135m")
    per_layer, embed, head = layer_bytes(sizes, 30)
    tied = embed if cfg.tie_word_embeddings else 0
    assert max(p["bytes"] for p in r["parts"]) == brute_force(per_layer, 3, embed, head + tied)
    assert r["weight_bytes"] == sum(sizes.values())
    assert main(["inspect", "smollm2-135m", "--split", "2", "--layers-split", "3,3"]) == 2
    assert "3,3 adds up to 6 layers; the model has 30" in capsys.readouterr().err
