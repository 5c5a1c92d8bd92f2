"""A tensor rank reads only its slices from the file (mlxlis/loading/slices.py, Layout.cut).

Proves, in one process (each rank's load run in turn under a placement that only places), that
every parameter a rank loads is exactly the slice of the lone process's loaded parameter that
the Layout names (rows of q/k/v, gate/up, the embedding and the head; columns of o_proj and
down_proj; norms whole), bit for bit: for the real SmolLM2 GGUF over 3 ranks (Q4_1 blocks
cut by rows and by whole blocks along K, Q/K rows un-permuted per head with the rank's head
count), for a float32 safetensors folder and mlx-lm's 4-bit conversion (packed words, scales
and biases cut at whole groups) over 2. The lone loads are the reference: their parity with
transformers and llama.cpp is proved in test_llama_parity.py and test_gguf_models.py. A cut
that would fall inside a quantization block is refused naming the tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import mlxlis
from mlxlis.distributed.tensor import Layout, plan_layout
from mlxlis.errors import UnsupportedError
from mlxlis.loading.gguf import GGUFTensor
from mlxlis.loading.slices import Cut, cut_gguf
from mlxlis.models.from_folder import load_folder
from mlxlis.models.from_gguf import load_gguf

import mlx.core as mx
import pytest
from conftest import TINY, build_tiny, need_pulled
from mlx.utils import tree_flatten
from test_qwen3 import SPECS
from test_qwen3_gguf import files  # noqa: F401  (the fixture: llama.cpp-layout Qwen3-MoE files)


@dataclass
class PlaceOnly:
    """Rank `rank` of `size`'s Layout, its network left unjoined (no ranks in one process)."""

    rank: int
    size: int

    def place(self, cfg, sizes, what) -> Layout:
        return plan_layout(cfg, self.rank, self.size, what)

    def wrap(self, net, part, dtype):
        return net


@functools.cache
def whole(path: str) -> dict[str, mx.array]:
    return dict(tree_flatten(mlxlis.load(path, "float32").net.parameters()))


def check_ranks(path: Path, size: int) -> None:
    reference = whole(str(path))
    for rank in range(size):
        placement = PlaceOnly(rank, size)
        if path.suffix == ".gguf":
            model = load_gguf(path, mx.float32, placement=placement)
        else:
            model = load_folder(path, mx.float32, chat_template=None, placement=placement)
        layout = model.part
        got = dict(tree_flatten(model.net.parameters()))
        assert set(got) == set(reference)
        cut_any = False
        for name, a in got.items():
            want, cut = reference[name], layout.cut(name)
            if cut is not None:
                cut_any = True
                axis = cut.axis % want.ndim
                per = cut.whole // want.shape[axis]  # weights per stored entry (word, group)
                index = [slice(None)] * want.ndim
                index[axis] = slice(cut.part.start // per, cut.part.stop // per)
                want = want[tuple(index)]
            assert a.shape == want.shape, name
            assert a.dtype == want.dtype, name
            assert mx.array_equal(a, want).item(), f"rank {rank}: {name}"
        assert cut_any


@pytest.mark.real
def test_gguf_rank_reads_its_blocks():
    """SmolLM2 Q4_1 over 3 ranks (its 9 heads, 3 KV heads, 1536 MLP rows, 49152 vocabulary
    rows): each rank's parameters are the lone load's slices, exactly."""
    check_ranks(need_pulled("smollm2-135m"), 3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from mlx_lm import convert as mlx_lm_convert

    tmp = tmp_path_factory.mktemp("slices")
    build_tiny(tmp / "llama", TINY["llama"])
    build_tiny(tmp / "qwen3-moe", SPECS["qwen3_moe"])  # one tensor per expert, stacked at load
    build_tiny(tmp / "llama128", {**TINY["llama"], "intermediate_size": 128})
    q4 = tmp / "llama-q4"
    mlx_lm_convert(
        str(tmp / "llama128"), str(q4), quantize=True, q_group_size=32, q_bits=4, dtype="float32"
    )
    return tmp


@pytest.mark.parametrize("name", ["llama", "llama-q4", "qwen3-moe"])
def test_safetensors_rank_reads_its_rows_and_columns(folders, name):
    """A float32 folder, its 4-bit conversion (groups of 32) and a Qwen3-MoE folder (8
    experts, each its own tensors, stacked at load) over 2 ranks: each rank's parameters
    (packed words, scales, biases; every expert's rows of gate/up and columns of down) are
    the lone load's slices, exactly."""
    check_ranks(folders / name, 2)


def test_gguf_experts_are_cut_per_expert(files):  # noqa: F811
    """llama.cpp's 3-D expert tensors (E, rows, K) of a Q8_0 Qwen3-MoE file over 2 ranks: each
    rank's experts are the lone load's rows / whole blocks, exactly. Its K-quant twin, whose
    down experts hold 256 weights per block, cannot give each rank 128 columns: refused
    naming the tensor before a weight is read."""
    check_ranks(files("qwen3moe-q8_0")[0], 2)
    with pytest.raises(UnsupportedError, match=r"ffn_down_exps\.weight"):
        load_gguf(files("qwen3moe-k")[0], mx.float32, placement=PlaceOnly(0, 2))


def test_a_cut_inside_a_block_is_refused_by_name():
    """Columns 16-47 of a Q4_1 row (blocks of 32) and of an MLX 4-bit layer's scales (groups
    of 32): an UnsupportedError naming the tensor, not a misread slice."""
    t = GGUFTensor("blk.0.ffn_down.weight", 3, "Q4_1", (4, 64), 0, 4 * 2 * 20)
    with pytest.raises(UnsupportedError, match="blk.0.ffn_down.weight"):
        cut_gguf(t, Cut(-1, range(16, 48), 64), "model.gguf")
    with pytest.raises(UnsupportedError, match="down_proj.scales"):
        Cut(-1, range(16, 48), 64).stored(2, "mlp.down_proj.scales", "folder")
    assert Cut(-1, range(32, 64), 64).stored(2, "x", "y") == range(1, 2)
    assert Cut(-1, range(32, 64), 64).stored(8, "x", "y") == range(4, 8)  # 4-bit words


@pytest.mark.real
def test_real_k_quant_file_that_cannot_split_is_refused_before_reading():
    """Qwen2.5-Coder-0.5B Q4_K_M over 2 ranks: its ffn_down rows of 4864 weights in K-quant
    blocks of 256 cannot give each rank 2432 columns; refused naming the file and the tensor
    before a weight converts (the cuts are all planned first)."""
    path = need_pulled("qwen2.5-coder-0.5b")
    with pytest.raises(UnsupportedError, match=r"ffn_down\.weight: weights 0-2431 of 4864") as e:
        load_gguf(path, mx.float32, placement=PlaceOnly(0, 2))
    assert str(path) in str(e.value)
