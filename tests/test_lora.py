"""LoRA adapters (mlxlis/loading/adapters.py, mlxlis/models/lora.py) against `peft`, the
reference: tiny random Llama, Qwen3, Gemma 3 and Qwen3.5 bases get PEFT adapters made by
`peft` itself (random A and B, several ranks and alphas, rsLoRA, attention and MLP targets),
saved by its `save_pretrained`; `mlxlis.load(base, adapters=[folder])` gives PEFT's logits
(unmerged, and merged by PEFT's `merge_and_unload`) in float32, within 1e-5 where the base
itself matches transformers that closely, else within the base's own discrepancy. Bad
adapters are refused with one error naming the file and the module or field, and nothing of
an adapter that fails is applied.
"""

from __future__ import annotations

import copy
import json
import math

import mlxlis
from mlxlis.errors import AdapterError
from mlxlis.loading.adapters import read_adapter
from mlxlis.models.lora import LoRALinear, apply

import mlx.core as mx
import numpy as np
import peft
import pytest
import torch
from conftest import TINY, build_tiny, tiny_models, trajectory
from test_gemma_parity import SPECS as GEMMA
from test_qwen3 import SPECS as QWEN3
from test_qwen3_5 import SPECS as QWEN3_5
from test_qwen3_5 import realistic

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
BASES = {
    "llama": TINY["llama"],
    "qwen2": TINY["qwen2"],
    "qwen3": QWEN3["qwen3"],
    "gemma3": {"kind": "gemma3", "pad_token_id": 0, **GEMMA["gemma3"]},
    "qwen3_5": QWEN3_5["qwen3_5"],
}
# (base, rank, alpha, rsLoRA, targets): each adapter's shape
ADAPTERS = [
    ("llama", 4, 8, False, ATTENTION + MLP),
    ("llama", 8, 4, True, ["q_proj", "v_proj"]),
    ("qwen3", 2, 16, False, ATTENTION),
    ("gemma3", 6, 12, True, MLP + ["o_proj"]),
    ("qwen3_5", 4, 8, False, MLP),
]


def build(folder, spec):
    return build_tiny(folder, spec, adjust=realistic if spec["kind"] == "qwen3_5" else None)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return tiny_models(tmp_path_factory, BASES, build)


def make_adapter(ref, folder, rank: int, alpha: float, rslora: bool, targets: list[str]):
    """A PEFT adapter on a copy of `ref`, random A and B (init_lora_weights=False: PEFT's
    own random init, B not zero), saved by PEFT; the PEFT model returned."""
    torch.manual_seed(rank * 31 + int(alpha))
    cfg = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=targets,
        init_lora_weights=False,
        lora_dropout=0.1,  # a training matter: off in eval(), ignored by mlxlis
    )
    model = peft.get_peft_model(copy.deepcopy(ref), cfg).eval()
    model.save_pretrained(folder)
    return model


def logits_of(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("case", range(len(ADAPTERS)), ids=[f"{a[0]}-r{a[1]}" for a in ADAPTERS])
def test_logits_match_peft_unmerged_and_merged(bases, tmp_path, case):
    """Reference parity: the base with the adapter applied unmerged gives PEFT's logits over
    40 tokens (bound below), and PEFT's merged model's; without the adapter the logits differ
    (the adapter is not trivially zero); every target is wrapped with PEFT's scale."""
    name, rank, alpha, rslora, targets = ADAPTERS[case]
    folder, ref = bases(name)
    pm = make_adapter(ref, tmp_path / "adapter", rank, alpha, rslora, targets)
    model = mlxlis.load(folder, "float32", adapters=[tmp_path / "adapter"])
    ids = trajectory(40, seed=case, vocab=model.config.vocab_size)
    ours = np.array(model.logits(ids))
    theirs = logits_of(pm, ids)
    base = logits_of(ref, ids)
    plain = np.array(mlxlis.load(folder, "float32").logits(ids))
    merged = logits_of(pm.merge_and_unload(), ids)
    # 1e-5 where the base matches transformers to ~2e-6 (Llama, Qwen3); where the base's own
    # discrepancy is larger (Gemma 3 1.1e-5, Qwen3.5 4.6e-5 here: bounded by their parity
    # tests), twice it: the adapter adds no error of its own beyond the base's
    bound = max(1e-5, 2 * float(np.abs(plain - base).max()))
    assert np.abs(ours - theirs).max() < bound
    # PEFT's merged model differs from its unmerged one by its merge's rounding
    assert np.abs(ours - merged).max() < bound + float(np.abs(theirs - merged).max())
    assert np.abs(plain - theirs).max() > 1e-3
    wrapped = [m for _, m in model.net.named_modules() if isinstance(m, LoRALinear)]
    per_layer = model.config.num_hidden_layers * len(targets)
    assert len(wrapped) <= per_layer and wrapped  # hybrid layers lack some attention targets
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    assert {m.scale for m in wrapped} == {scale}
    assert "adapters" in model.describe()


def test_an_adapter_changes_the_cache_key(bases, tmp_path):
    """A cache saved under the base is not the adapted model's, nor one adapter's another's
    (Model.cache_key: the disk prefix cache's key)."""
    folder, ref = bases("llama")
    make_adapter(ref, tmp_path / "a", 4, 8, False, ATTENTION)
    make_adapter(ref, tmp_path / "b", 2, 8, False, ATTENTION)
    keys = {
        mlxlis.load(folder, "float32").cache_key(),
        mlxlis.load(folder, "float32", adapters=[tmp_path / "a"]).cache_key(),
        mlxlis.load(folder, "float32", adapters=[tmp_path / "b"]).cache_key(),
    }
    assert len(keys) == 3


def edit_config(folder, **change) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


def test_bad_adapters_are_refused_by_name_and_nothing_applies(bases, tmp_path):
    """An adapter of another base (other hidden size), a module the model lacks, a truncated
    file, rank 0, alpha NaN, DoRA: one AdapterError each, naming the file and the module or
    field."""
    folder, ref = bases("llama")
    other_folder, other = bases("qwen3")
    good = tmp_path / "good"
    make_adapter(ref, good, 4, 8, False, ATTENTION)

    def refused(adapter, field: str | None, says: str) -> None:
        with pytest.raises(AdapterError) as e:
            mlxlis.load(folder, "float32", adapters=[adapter])
        assert e.value.path is not None and str(adapter) in e.value.path
        assert e.value.field == field and says in e.value.message, e.value

    make_adapter(other, tmp_path / "other", 4, 8, False, ["q_proj"])
    refused(tmp_path / "other", "model.layers.0.self_attn.q_proj", "do not fit")
    # all checked before any applies: a good module beside a bad one leaves the network as is
    net = mlxlis.load(folder, "float32").net
    adapter = read_adapter(good)
    first = sorted(adapter.layers)[0]
    mixed = {first: adapter.layers[first], "model.layers.0.nope": adapter.layers[first]}
    with pytest.raises(AdapterError):
        apply(net, mixed, mx.float32, str(good))
    assert not [m for _, m in net.named_modules() if isinstance(m, LoRALinear)]
    moved = tmp_path / "moved"
    make_adapter(ref, moved, 4, 8, False, ["q_proj"])
    weights = moved / "adapter_model.safetensors"
    from safetensors.numpy import load_file, save_file

    tensors = {k.replace("self_attn", "cross_attn"): v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    refused(moved, "model.layers.0.cross_attn.q_proj", "no such module")
    cut = tmp_path / "cut"
    make_adapter(ref, cut, 4, 8, False, ["q_proj"])
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError) as e:
        mlxlis.load(folder, "float32", adapters=[cut])
    assert "adapter_model.safetensors" in e.value.path
    zero = tmp_path / "zero"
    make_adapter(ref, zero, 4, 8, False, ["q_proj"])
    tensors = load_file(zero / "adapter_model.safetensors")
    save_file(
        {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in tensors.items()},
        zero / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError) as e:
        mlxlis.load(folder, "float32", adapters=[zero])
    assert "rank 0" in e.value.message
    for change, field in (
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"use_dora": True}, "use_dora"),
    ):
        bad = tmp_path / field
        make_adapter(ref, bad, 4, 8, False, ["q_proj"])
        edit_config(bad, **change)
        with pytest.raises(AdapterError) as e:
            mlxlis.load(folder, "float32", adapters=[bad])
        assert e.value.field == field and "adapter_config.json" in e.value.path


def test_the_one_shot_command_applies_an_adapter(bases, tmp_path):
    """`mlxlis --adapter FOLDER` runs the adapted model (its greedy text differs from the
    base's; -v names the adapter) — the adapted model's logits are proved above; a bad
    adapter exits 2 with one line naming its file and field."""
    import subprocess
    import sys

    folder, ref = bases("llama")
    make_adapter(ref, tmp_path / "a", 4, 8, False, ATTENTION + MLP)
    base = [sys.executable, "-m", "mlxlis", "-m", str(folder), "--no-chat", "--max-tokens", "8"]

    def run(*extra: str) -> subprocess.CompletedProcess:
        cmd = [*base, "--dtype", "float32", *extra, "Hello"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    adapted, plain = run("--adapter", str(tmp_path / "a"), "-v"), run()
    assert adapted.returncode == plain.returncode == 0, adapted.stderr
    assert adapted.stdout != plain.stdout and "adapters: a (LoRA rank 4" in adapted.stderr
    edit_config(tmp_path / "a", lora_alpha=-1)
    bad = run("--adapter", str(tmp_path / "a"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "adapter_config.json: lora_alpha: must be above 0" in bad.stderr, bad.stderr


# (base, rank, scale, keys, layers): mlx-lm adapters, made by mlx-lm's own tuner
MLX_LM = [
    ("qwen2", 4, 10.0, ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"], 1),
    ("qwen3", 8, 2.5, None, 2),  # mlx-lm's default keys for the family
]


@pytest.mark.parametrize("case", range(len(MLX_LM)), ids=[f"{m[0]}-r{m[1]}" for m in MLX_LM])
def test_mlx_lm_adapters_give_mlx_lms_logits(bases, tmp_path, case):
    """Reference parity with mlx-lm: an adapter made by mlx-lm's `linear_to_lora_layers` (B set
    random, as after training) and saved as its trainer saves it, read back by mlx-lm's own
    `load_adapters` on a fresh copy of the base: our logits with the same folder equal its
    within 1e-5 (float32), on bases mlx-lm reads as we do (checked first: its Llama reader
    misses transformers 5's rope_parameters, so the tiny Llama is not one)."""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters

    name, rank, scale, keys, layers = MLX_LM[case]
    folder = bases(name)[0]
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys}
    trained, _ = mlx_lm_load(str(folder))
    trained.freeze()
    linear_to_lora_layers(trained, layers, params)
    mx.random.seed(case)
    trained.update(
        tree_map(lambda p: mx.random.normal(p.shape) * 0.2, trained.trainable_parameters())
    )
    out = tmp_path / "adapter"
    out.mkdir()
    mx.save_safetensors(
        str(out / "adapters.safetensors"), dict(tree_flatten(trained.trainable_parameters()))
    )
    config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    reference, _ = mlx_lm_load(str(folder))
    reference.set_dtype(mx.float32)
    plain = np.array(mlxlis.load(folder, "float32").logits(ids := trajectory(40, seed=case)))
    assert np.abs(plain - np.array(reference(mx.array([ids]))[0])).max() < 1e-5  # one base
    load_adapters(reference, str(out))
    model = mlxlis.load(folder, "float32", adapters=[out])
    theirs = np.array(reference(mx.array([ids]))[0].astype(mx.float32))
    ours = np.array(model.logits(ids))
    assert np.abs(ours - theirs).max() < 1e-5
    assert np.abs(plain - theirs).max() > 1e-3
    assert {m.scale for _, m in model.net.named_modules() if isinstance(m, LoRALinear)} == {scale}


def test_rows_on_different_adapters_share_one_forward(bases, tmp_path):
    """Several adapters selectable on one base (lora.select), each row of one batched forward
    on its own (lora.rows: two adapters of different ranks and targets, and none): each row's
    logits equal that row alone on the base with its adapter applied (the PEFT-proved path
    above) within 1e-5, and the row with none equals the base's."""
    from mlxlis.models import family
    from mlxlis.models.lora import rows, select

    folder, ref = bases("llama")
    make_adapter(ref, tmp_path / "a", 4, 8, False, ATTENTION + MLP)
    make_adapter(ref, tmp_path / "b", 8, 4, True, ["q_proj", "v_proj"])
    model = mlxlis.load(folder, "float32")
    names = family(model.config.family).hf.name
    for ad in ("a", "b"):
        select(model.net, read_adapter(tmp_path / ad), names, mx.float32)
    vocab = model.config.vocab_size
    batch = [trajectory(24, seed=s, vocab=vocab) for s in (1, 2, 3, 4)]
    with rows([1, -1, 0, 0]):
        out = np.array(model.net(mx.array(batch)).astype(mx.float32))
    alone = {
        ad: mlxlis.load(folder, "float32", adapters=[tmp_path / ad] if ad else [])
        for ad in ("a", "b", "")
    }
    for i, ad in enumerate(["b", "", "a", "a"]):
        want = np.array(alone[ad].logits(batch[i]))
        assert np.abs(out[i] - want).max() < 1e-5, (i, ad)
    with rows(None):  # no selection: the base
        base = np.array(model.net(mx.array(batch[:1])).astype(mx.float32))
    assert np.abs(base[0] - np.array(alone[""].logits(batch[0]))).max() < 1e-5
