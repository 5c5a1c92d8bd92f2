"""`make bench` (LoRA part): what an adapter costs a decoding step, unmerged, fused, and eight
different adapters in one batch, with mlx-lm's own figure on the same files.

The catalog's smollm2-135m is written once as an MLX folder (`mlxlis convert`, float32: its
Q4_1 blocks kept as MLX 4-bit g32; `--dense`: every weight float32) under
bench-results/lora/, with random rank-8 adapters on q/k/v/o/gate/up/down of every layer,
made here with numpy in PEFT's layout
(adapter_config.json + adapter_model.safetensors) and, from the same weights, in mlx-lm's
(adapters.safetensors: lora_a (in, r), lora_b (r, out)). Decode tok/s after a 64-token
prefill, best of 4 rounds of 8 steps:
- the base alone; one adapter unmerged (goal: within 15 % of the base); fused (`fuse=True`);
- 8 rows on 8 different adapters (`lora.select` + `lora.rows`, `net.decode_batch`) against 8
  rows with none (goal: within 25 % of the plain batch);
- mlx-lm (`mlx_lm.load(adapter_path=...)`, `stream_generate`'s generation tok/s), base and
  adapted, in its own process (mlxlis not imported there).
Prints a Markdown table and the ratios; writes bench-results/lora.json (lora-dense.json).

usage: python scripts/bench_lora.py [--model smollm2-135m] [--rounds 4] [--dense] [--no-mlx-lm]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "The history of computing is long and varied, with many turns and returns. " * 12
TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
RANK, ALPHA, PREFILL, STEPS = 8, 16.0, 64, 8


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each target, from config.json."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def write_adapters(base: Path, out: Path, seed: int) -> tuple[Path, Path]:
    """A random rank-8 adapter as a PEFT folder and as an mlx-lm folder (the same weights)."""
    import numpy as np
    from safetensors.numpy import save_file

    cfg = json.loads((base / "config.json").read_text())
    dims = shapes(cfg)
    rng = np.random.default_rng(seed)
    peft: dict[str, np.ndarray] = {}
    mlx_lm: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        for part, names in TARGETS.items():
            for name in names:
                n_in, n_out = dims[name]
                a = (rng.standard_normal((RANK, n_in)) / np.sqrt(n_in)).astype(np.float32)
                b = (rng.standard_normal((n_out, RANK)) * 0.01).astype(np.float32)
                module = f"model.layers.{i}.{part}.{name}"
                peft[f"base_model.model.{module}.lora_A.weight"] = a  # (r, in)
                peft[f"base_model.model.{module}.lora_B.weight"] = b  # (out, r)
                mlx_lm[f"{module}.lora_a"] = np.ascontiguousarray(a.T)  # (in, r)
                mlx_lm[f"{module}.lora_b"] = np.ascontiguousarray(b.T)  # (r, out)
    modules = [n for names in TARGETS.values() for n in names]
    peft_dir, mlx_dir = out / f"peft-{seed}", out / f"mlx-lm-{seed}"
    peft_dir.mkdir(parents=True, exist_ok=True)
    mlx_dir.mkdir(parents=True, exist_ok=True)
    save_file(peft, str(peft_dir / "adapter_model.safetensors"))
    peft_cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": modules}
    (peft_dir / "adapter_config.json").write_text(json.dumps(peft_cfg))
    save_file(mlx_lm, str(mlx_dir / "adapters.safetensors"))
    keys = [f"{part}.{n}" for part, names in TARGETS.items() for n in names]
    params = {"rank": RANK, "scale": ALPHA / RANK, "dropout": 0.0, "keys": keys}
    mlx_cfg = {
        "fine_tune_type": "lora",
        "num_layers": cfg["num_hidden_layers"],
        "lora_parameters": params,
    }
    (mlx_dir / "adapter_config.json").write_text(json.dumps(mlx_cfg))
    return peft_dir, mlx_dir


def best(step, rounds: int) -> float:
    """Seconds a step: best of `rounds` rounds of STEPS steps, after 2 warm-up steps."""
    for _ in range(2):
        step()
    out = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        out = min(out, (time.perf_counter() - t) / STEPS)
    return out


def measure(folder: Path, peft: list[Path], rounds: int) -> dict[str, float]:
    """Seconds a decoding step of each mlxlis setting (in this process)."""
    import mlxlis  # the BLAS before mlx.core
    from mlxlis.generation.steps import prefill
    from mlxlis.models import family
    from mlxlis.models.lora import rows, select

    import mlx.core as mx

    def lone(model) -> float:
        ids = model.tokenizer.encode(TEXT)[:PREFILL]
        cache = model.make_cache()
        mx.eval(prefill(model.net, ids, cache))
        x = mx.array([[ids[5]]])
        return best(lambda: mx.eval(model.net(x, cache=cache, last_only=True)), rounds)

    def batch(model, ids_of_rows: list[int] | None) -> float:
        ids = model.tokenizer.encode(TEXT)[: PREFILL + 8]
        caches = []
        for i in range(8):  # prompts of different lengths: rows padded as in serving
            cache = model.make_cache()
            mx.eval(prefill(model.net, ids[: PREFILL + i], cache))
            caches.append(cache)
        tokens = mx.array(ids[:8])

        def step() -> None:
            with rows(ids_of_rows):
                mx.eval(model.net.decode_batch(tokens, caches))

        return best(step, rounds)

    out = {}
    base = mlxlis.load(folder, "float32")
    out["base"] = lone(base)
    out["unmerged"] = lone(mlxlis.load(folder, "float32", adapters=[peft[0]]))
    fused = mlxlis.load(folder, "float32", adapters=[peft[0]], fuse=True)
    print(f"fused: {fused.fused}", file=sys.stderr)
    out["fused"] = lone(fused)
    out["batch_plain"] = batch(base, None)
    switch = mlxlis.load(folder, "float32")
    names = family(switch.config.family).hf.name
    for p in peft:
        select(switch.net, mlxlis.loading.adapters.read_adapter(p), names, switch.dtype)
    out["batch_8_adapters"] = batch(switch, list(range(8)))
    return out


def measure_mlx_lm(folder: Path, adapter: Path | None, rounds: int) -> float:
    """mlx-lm's generation tok/s (its own stat), best of `rounds` generations."""
    from mlx_lm import load, stream_generate

    model, tok = load(str(folder), adapter_path=str(adapter) if adapter else None)
    prompt = tok.encode(TEXT)[:PREFILL]
    rates = []
    for _ in range(rounds + 1):  # the first warms up
        stats = list(stream_generate(model, tok, prompt, max_tokens=STEPS * 4))
        rates.append(stats[-1].generation_tps)
    return max(rates[1:])


def prepare(name: str, dense: bool) -> tuple[Path, list[Path], list[Path]]:
    """The model as an MLX folder (`dense`: every weight float32) and 8 adapters (PEFT's,
    mlx-lm's), made once."""
    from mlxlis.commands.convert import convert

    work = ROOT / "bench-results" / "lora"
    folder = work / f"{name}-mlx{'-dense' if dense else ''}"
    if not (folder / "config.json").is_file():
        convert(name, folder, dtype="float32", dequantize=dense, force=True)
    pairs = [write_adapters(folder, work / "adapters", seed) for seed in range(8)]
    return folder, [p for p, _ in pairs], [m for _, m in pairs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-mlx-lm", action="store_true", help="mlxlis's figures only")
    ap.add_argument("--dense", action="store_true", help="the weights written dense float32")
    ap.add_argument("--mlx-lm", nargs=2, help=argparse.SUPPRESS)  # worker: FOLDER ADAPTER|-
    args = ap.parse_args()
    if args.mlx_lm:
        folder, adapter = args.mlx_lm
        rate = measure_mlx_lm(Path(folder), None if adapter == "-" else Path(adapter), args.rounds)
        print(json.dumps(rate))
        return 0
    from mlxlis.loading import catalog

    if not catalog.is_pulled(args.model):
        print(f"{args.model}: not pulled (make models)", file=sys.stderr)
        return 0
    folder, peft, mlx_lm = prepare(args.model, args.dense)
    ours = measure(folder, peft, args.rounds)
    theirs = {}
    for label, adapter in () if args.no_mlx_lm else (("base", "-"), ("adapter", str(mlx_lm[0]))):
        cmd = [sys.executable, __file__, "--mlx-lm", str(folder), adapter]
        res = subprocess.run([*cmd, "--rounds", str(args.rounds)], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"mlx-lm ({label}) failed: {res.stderr.strip()[-400:]}", file=sys.stderr)
            continue
        theirs[label] = float(res.stdout.strip().splitlines()[-1])
    rate = {k: (8 if k.startswith("batch") else 1) / t for k, t in ours.items()}
    weights = "dense" if args.dense else "4-bit g32"
    what = f"float32, {weights} weights, rank {RANK} on 7 modules a layer"
    print(f"| {args.model} ({what}) | tok/s |")
    print("|---|---|")
    for k, v in rate.items():
        print(f"| mlxlis {k.replace('_', ' ')} | {v:.1f} |")
    for k, v in theirs.items():
        print(f"| mlx-lm {k} | {v:.1f} |")
    unmerged = rate["unmerged"] / rate["base"]
    switched = rate["batch_8_adapters"] / rate["batch_plain"]
    print(
        f"unmerged / base: {unmerged:.2f} (goal ≥ 0.85: {'met' if unmerged >= 0.85 else 'missed'});"
        f" fused / base: {rate['fused'] / rate['base']:.2f};"
        f" 8 adapters / plain batch: {switched:.2f}"
        f" (goal ≥ 0.75: {'met' if switched >= 0.75 else 'missed'})"
    )
    if len(theirs) == 2:
        print(f"mlx-lm adapter / base: {theirs['adapter'] / theirs['base']:.2f}")
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    result = {"model": args.model, "weights": weights, "tok_s": rate, "mlx_lm_tok_s": theirs}
    (out / f"lora{'-dense' if args.dense else ''}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
