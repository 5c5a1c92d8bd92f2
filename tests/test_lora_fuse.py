"""Merging LoRA adapters into the weights (lora.fuse, `load(fuse=True)`, `--fuse`, `mlxlis
convert --adapter`) and scaling them (`--adapter-scale`), against independent references:
PEFT's own `merge_and_unload` for a dense base; for an MLX-quantized base (written by mlx-lm's
`convert`), PEFT's merged delta added to the file's dequantized weight and quantized by
`mx.quantize` with the file's bits and group size; for the scale, PEFT reading the same
adapter with its alpha halved.
"""

from __future__ import annotations

import json
import shutil

import mlxlis
from mlxlis.commands.cli import main
from mlxlis.errors import AdapterError
from mlxlis.models.lora import LoRALinear

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import peft
import pytest
from conftest import TINY, tiny_models, trajectory
from test_lora import ATTENTION, MLP, build, edit_config, logits_of, make_adapter

TARGETS = ATTENTION + MLP


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama base and a PEFT adapter on every attention and MLP module."""
    folder, ref = tiny_models(tmp_path_factory, {"llama": TINY["llama"]}, build)("llama")
    adapter = tmp_path_factory.mktemp("adapter") / "a"
    pm = make_adapter(ref, adapter, 4, 8, False, TARGETS)
    return folder, ref, adapter, pm


def adapted(net: nn.Module) -> list[nn.Module]:
    return [m for _, m in net.named_modules() if isinstance(m, LoRALinear)]


def test_fused_dense_gives_peft_merged_logits(llama):
    """A dense base fused: PEFT's `merge_and_unload` logits within 1e-5 (float32: test_lora's
    bound), no LoRALinear left, every target merged and said so; describe and the cache key
    still say the adapter is in the weights (and differ from the unmerged model's key)."""
    folder, _, adapter, pm = llama
    model = mlxlis.load(folder, "float32", adapters=[adapter], fuse=True)
    ids = trajectory(40, seed=3, vocab=model.config.vocab_size)
    merged = logits_of(copy_merged(pm), ids)
    assert np.abs(np.array(model.logits(ids)) - merged).max() < 1e-5
    assert not adapted(model.net)
    layers = model.config.num_hidden_layers * len(TARGETS)
    assert model.fused == f"merged into dense float32 weights ({layers} modules)"
    assert "in the weights: merged into dense" in model.describe()["adapters"]
    unmerged = mlxlis.load(folder, "float32", adapters=[adapter])
    assert model.cache_key() != unmerged.cache_key()
    assert np.abs(np.array(unmerged.logits(ids)) - merged).max() < 1e-5


def test_several_adapters_fuse_to_their_unmerged_sum(llama, tmp_path):
    """Two adapters on the same modules, fused: the logits of the two applied unmerged (the
    PEFT-proved path, in order) within 1e-5; each module merged once."""
    folder, ref, adapter, _ = llama
    make_adapter(ref, tmp_path / "b", 2, 6, True, ["q_proj", "down_proj"])
    both = [adapter, tmp_path / "b"]
    fused = mlxlis.load(folder, "float32", adapters=both, fuse=True)
    unmerged = mlxlis.load(folder, "float32", adapters=both)
    ids = trajectory(24, seed=9, vocab=400)
    assert np.abs(np.array(fused.logits(ids)) - np.array(unmerged.logits(ids))).max() < 1e-5
    layers = fused.config.num_hidden_layers * len(TARGETS)
    assert fused.fused == f"merged into dense float32 weights ({layers} modules)"


def copy_merged(pm):
    """PEFT's merged model, from a copy (the fixture's PEFT model stays unmerged)."""
    import copy

    return copy.deepcopy(pm).merge_and_unload()


def test_fused_quantized_requantizes_like_peft_merged_weights(llama, tmp_path):
    """An MLX-quantized base (mlx-lm's convert, 4-bit g32; it leaves down_proj, 144 inputs,
    dense) fused: each quantized module is requantized with 4 bits, group 32, to what
    `mx.quantize` makes of (the file's dequantized weight + PEFT's merged delta): codes may
    differ by one step where the two float32 deltas straddle a rounding boundary (at most 1
    in 1000; none here); each dense one is PEFT's merged weight within 1e-6."""
    from mlx_lm import convert

    folder, ref, adapter, pm = llama
    src = tmp_path / "classic"  # mlx-lm reads only classic keys: spell out rope_theta
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "q"
    convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    model = mlxlis.load(out, "float32", adapters=[adapter], fuse=True)
    n = model.config.num_hidden_layers
    assert model.fused == (
        f"merged and requantized to 4-bit g32 ({n * 6} modules); "
        f"merged into dense float32 weights ({n} modules)"
    )
    assert not adapted(model.net)
    stored = mx.load(str(out / "model.safetensors"))
    merged = dict(copy_merged(pm).named_parameters())
    original = dict(ref.named_parameters())
    checked = flipped = total = 0
    for name, m in model.net.named_modules():
        if not name.endswith(tuple(TARGETS)):
            continue
        key = f"{name}.weight"
        if isinstance(m, nn.Linear):
            assert np.abs(np.array(m.weight) - merged[key].detach().numpy()).max() < 1e-6
            checked += 1
            continue
        delta = (merged[key] - original[key]).detach().numpy()  # PEFT's s·B·A
        base = mx.dequantize(stored[key], stored[f"{name}.scales"], stored[f"{name}.biases"], 32, 4)
        want_w, want_s, want_b = mx.quantize(base + mx.array(delta), 32, 4)
        assert isinstance(m, nn.QuantizedLinear) and (m.bits, m.group_size) == (4, 32)
        ours = mx.dequantize(m.weight, m.scales, m.biases, 32, 4)
        theirs = mx.dequantize(want_w, want_s, want_b, 32, 4)
        step = float(mx.abs(want_s).max())
        diff = np.abs(np.array(ours - theirs))
        assert diff.max() <= 1.01 * step + 1e-6, name
        flipped += int((diff > 1e-6).sum())
        total += diff.size
        checked += 1
    assert checked == n * len(TARGETS) and flipped <= total / 1000


def test_adapter_scale_is_peft_with_alpha_scaled(llama, tmp_path):
    """--adapter-scale 0.5 gives the logits PEFT gives for the same adapter with its alpha
    halved (within 1e-5), unmerged and fused; its cache key differs from scale 1's; 0, a
    negative, NaN and infinity are refused naming the flag, by the API and the command line."""
    folder, ref, adapter, _ = llama
    half = tmp_path / "half"
    shutil.copytree(adapter, half)
    edit_config(half, lora_alpha=4)
    import copy

    theirs_model = peft.PeftModel.from_pretrained(copy.deepcopy(ref), half).eval()
    ids = trajectory(32, seed=5, vocab=400)
    theirs = logits_of(theirs_model, ids)
    scaled = mlxlis.load(folder, "float32", adapters=[adapter], adapter_scale=0.5)
    assert np.abs(np.array(scaled.logits(ids)) - theirs).max() < 1e-5
    fused = mlxlis.load(folder, "float32", adapters=[adapter], adapter_scale=0.5, fuse=True)
    assert np.abs(np.array(fused.logits(ids)) - theirs).max() < 1e-5
    assert {m.scale for m in adapted(scaled.net)} == {1.0}  # alpha 8 / r 4, times 0.5
    plain = mlxlis.load(folder, "float32", adapters=[adapter])
    assert scaled.cache_key() != plain.cache_key() and "×0.5" in scaled.describe()["adapters"]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(AdapterError) as e:
            mlxlis.load(folder, "float32", adapters=[adapter], adapter_scale=bad)
        assert e.value.field == "--adapter-scale"


def test_cli_fuse_and_bad_scale(llama, capsys):
    """`mlxlis --adapter A --fuse` says what it merged; `--adapter-scale 0` exits 2 naming the
    flag."""
    folder, _, adapter, _ = llama
    base = ["-m", str(folder), "--no-chat", "--max-tokens", "4", "--dtype", "float32"]
    assert main([*base, "--adapter", str(adapter), "--fuse", "Hello"]) == 0
    err = capsys.readouterr().err
    assert "mlxlis: --fuse: a merged into dense float32 weights (21 modules)" in err, err
    with pytest.raises(SystemExit) as e:
        main([*base, "--adapter", str(adapter), "--adapter-scale", "0", "Hello"])
    assert e.value.code == 2
    assert "--adapter-scale: must be a finite number above 0" in capsys.readouterr().err


def test_convert_with_an_adapter_writes_the_fused_model(llama, tmp_path, capsys):
    """`mlxlis convert SRC -o OUT --adapter A` says what it merged, and OUT loads (no adapter)
    to the fused model's logits exactly, PEFT's merged logits within 1e-5; its manifest names
    the adapter."""
    folder, _, adapter, pm = llama
    out = tmp_path / "out"
    cmd = ["convert", str(folder), "-o", str(out), "--dtype", "float32", "--adapter"]
    assert main([*cmd, str(adapter)]) == 0
    assert "mlxlis: merged a: merged into dense float32 weights" in capsys.readouterr().err
    written = mlxlis.load(out, "float32")
    fused = mlxlis.load(folder, "float32", adapters=[adapter], fuse=True)
    ids = trajectory(24, seed=7, vocab=400)
    assert bool(mx.array_equal(written.logits(ids), fused.logits(ids)))
    merged = logits_of(copy_merged(pm), ids)
    assert np.abs(np.array(written.logits(ids)) - merged).max() < 1e-5
    manifest = json.loads((out / "mlxlis-manifest.json").read_text())
    assert manifest["adapters"][0]["path"] == str(adapter) and manifest["adapters_merged"]


@pytest.mark.parametrize("bits,group", [(4, 32), (6, 16)])
def test_gguf_super_block_weights_fuse_dense(bits, group):
    """A module held in a form only the CPU kernels read (GGUF K-quants as stored: integer
    scales, float16 (d, dmin) per 256 weights; Q6_K's signed scales in groups of 16, no
    biases): its dequantized weight gives the kernels' own product (within 1e-5 relative),
    and fused it becomes a dense Linear whose product is base + s·B·A (numpy, float64)."""
    from mlxlis.loading.adapters import LoRA
    from mlxlis.models.lora import dense_weight, fuse
    from mlxlis.models.quantized import QuantizedLinear

    rng = np.random.default_rng(bits)
    n, k, r = 24, 512, 4
    codes = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    as_bits = np.unpackbits(codes[..., None], axis=2, bitorder="little")[..., :bits]
    packed = np.packbits(as_bits.reshape(n, -1), axis=1, bitorder="little").view("<u4")
    signed = group == 16
    sc = rng.integers(-128 if signed else 0, 128 if signed else 64, (n, k // group))
    kd = rng.uniform(1e-4, 2e-3, (n, k // 256, 2)).astype(np.float16)
    layer = QuantizedLinear(k, n, bias=False, group_size=32, bits=bits)
    layer.weight = mx.array(packed)
    layer.scales = mx.array(sc.astype(np.int8 if signed else np.uint8))
    if signed:
        del layer["biases"]
    else:
        layer.biases = mx.array(rng.integers(0, 64, (n, k // group)).astype(np.uint8))
    layer.super_scales = mx.array(kd)
    layer.group_size = group
    x = mx.array(rng.standard_normal((3, k)).astype(np.float32))
    kernel = np.array(layer(x))
    dense = np.array(x) @ np.array(dense_weight(layer)).T
    assert np.abs(dense - kernel).max() <= 1e-5 * np.abs(kernel).max()
    a = rng.standard_normal((r, k)).astype(np.float32) * 0.1
    b = rng.standard_normal((n, r)).astype(np.float32) * 0.1
    net = nn.Sequential(LoRALinear(layer, LoRA(mx.array(a), mx.array(b), 0.5), mx.float32))
    assert fuse(net, mx.float32) == "merged into dense float32 weights (1 module)"
    assert type(net.layers[0]) is nn.Linear
    want = kernel.astype(np.float64) + 0.5 * (np.array(x, np.float64) @ a.T) @ b.T
    got = np.array(net(x))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
