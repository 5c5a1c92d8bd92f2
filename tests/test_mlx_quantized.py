"""MLX-quantized safetensors checkpoints written by `mlx_lm.convert` load in mlxlis and give the
same logits as mlx-lm itself on the same files (reference parity for the quantized path),
including per-layer overrides from a mixed-bit recipe."""

from __future__ import annotations

import json
import shutil

import mlxlis

import mlx.core as mx
import numpy as np
import pytest
from conftest import trajectory


@pytest.mark.parametrize("recipe", [None, "mixed_3_6"])
def test_mlx_lm_quantized_checkpoint(tiny, tmp_path, recipe):
    from mlx_lm import convert
    from mlx_lm import load as mlx_lm_load

    folder, _ = tiny("llama")
    src = tmp_path / "classic"  # mlx-lm reads only classic keys: spell out rope_theta
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "q"
    convert(
        str(src),
        str(out),
        quantize=True,
        q_group_size=32,
        q_bits=4,
        dtype="float32",
        quant_predicate=recipe,
    )
    qcfg = json.loads((out / "config.json").read_text())["quantization"]
    if recipe:  # the recipe really wrote per-layer overrides
        assert any(isinstance(v, dict) for v in qcfg.values())
    theirs_model, _ = mlx_lm_load(str(out))
    ids = trajectory(64, vocab=400)
    theirs = np.array(theirs_model(mx.array([ids]))[0].astype(mx.float32))
    model = mlxlis.load(out, "float32")
    assert "quantized" in model.format and "bit" in model.quant_summary
    ours = np.array(model.logits(ids))
    assert np.abs(ours - theirs).max() < 2e-5  # measured 1.4e-6
