"""Numeric fingerprint of the engine, for refactors that must not change a bit.

usage: python scripts/fingerprint.py save FILE.npz   (before the change)
       python scripts/fingerprint.py check FILE.npz  (after: every array bit-identical)
       (--tiny after FILE: the tiny checkpoints only)

For tiny random checkpoints of every family in the registry (mlxlis.models.REGISTRY: a
family with none stops the run, named, before anything is recorded; add it to tiny_specs),
built once with transformers into $MLXLIS_FINGERPRINT_MODELS, default /tmp/mlxlis-fingerprint,
so both runs read the same weights, in float32 and float16, and for the three catalog models in
float32, it records: the full-forward logits of a fixed trajectory, the logits of a cached
decode (prompt prefilled, then one token at a time), greedy tokens through `mlxlis.generate` (a
prompt longer than every sliding window), seeded sampled tokens with the repetition penalty,
and greedy tokens with their log-probabilities from the serving engine decoding 4 requests as
one batch. The MoE families run in float32 only on the CPU (MLX's gather_mm there is float32
only).

A Gemma 4 assistant (gemma4_assistant) has no caches or tokens of its own: it drafts from its
Gemma 4 target's caches and hidden state. It is fingerprinted as a drafter through the
speculative path (record_assistant), a random one and one that repeats its last token (drafts
kept as well as rejected), both for the E2B-like tiny Gemma 4 target.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("MLXLIS_DEVICE", "cpu")

import mlxlis  # noqa: E402  (chooses the BLAS before mlx.core loads)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

MODELS = Path(os.environ.get("MLXLIS_FINGERPRINT_MODELS", "/tmp/mlxlis-fingerprint"))
CATALOG = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


def tiny_specs() -> dict[str, tuple[dict, object]]:
    """name -> (spec, build(folder, spec)): the tiny checkpoints, each family's richest spec
    from its test module, built as that module builds it."""
    from conftest import TINY, build_tiny
    from test_deepseek_v3 import SPECS as DSV3
    from test_deepseek_v3 import build as build_dsv3
    from test_deepseek_v4 import SPECS as DSV4
    from test_deepseek_v4 import build as build_dsv4
    from test_deepseek_v32 import SPECS as DSV32
    from test_deepseek_v32 import build as build_dsv32
    from test_gemma3n import SPECS as G3N
    from test_gemma3n import build as build_g3n
    from test_gemma4 import SPECS as G4
    from test_gemma4 import build as build_g4
    from test_gemma_parity import SPECS as GEMMA
    from test_glm4_moe import SPECS as GLM4
    from test_glm4_moe import build as build_glm4
    from test_gpt_oss import SPECS as OSS
    from test_gpt_oss import _sinks_of_unit_size
    from test_granite4 import SPECS as GRANITE4
    from test_granite4 import build as build_granite4
    from test_lfm2 import SPECS as LFM2
    from test_llama4 import SPECS as L4
    from test_minimax_m2 import SPECS as MM2
    from test_minimax_m2 import build as build_mm2
    from test_mistral3 import SPECS as MISTRAL
    from test_nemotron_h import SPECS as NEMOTRON_H
    from test_nemotron_h import build as build_nemotron_h
    from test_olmo3 import SPECS as OLMO3
    from test_phi3 import SPECS as PHI
    from test_qwen3 import SPECS as QWEN3
    from test_qwen3_5 import SPECS as Q35
    from test_qwen3_5 import build as build_q35
    from test_qwen3_5 import realistic
    from test_qwen3_next import SPECS as NEXT
    from test_qwen4_exp import SPECS as Q4
    from test_qwen4_exp import ple_weights
    from test_smollm3 import SPECS as SMOL
    from test_voxtral import SPECS as VOXTRAL
    from test_voxtral import build as build_voxtral

    def pad1(f, s):
        return build_tiny(f, s, pad_token_id=1)

    def adjusted(adjust):
        return lambda f, s: build_tiny(f, s, adjust=adjust)

    return {
        "llama": (TINY["llama"], build_tiny),
        "llama3_tied": (TINY["llama3_tied"], build_tiny),
        "qwen2": (TINY["qwen2"], build_tiny),
        "qwen3": (QWEN3["qwen3"], build_tiny),
        "qwen3_moe": (QWEN3["qwen3_moe"], build_tiny),
        **{
            g: ({"kind": g, "pad_token_id": 0, **GEMMA[g]}, build_tiny)
            for g in ("gemma", "gemma2", "gemma3")
        },
        "qwen3_5": (Q35["qwen3_5"], build_q35),
        "qwen3_5_moe": (Q35["qwen3_5_moe"], build_q35),
        "gemma4": (G4["all"], build_g4),
        "llama4": (L4["scout"], build_tiny),  # chunked attention, interleaved MoE, llama3 RoPE
        "llama4_maverick": (L4["maverick"], build_tiny),  # NoPE layers, listed MoE layers
        "mistral3": (MISTRAL["ministral3"], build_tiny),  # YaRN, sliding window
        "smollm3": (SMOL["window"], pad1),  # sliding window, NoPE layers
        "phi3": (PHI["mini"], pad1),  # LongRoPE (past its original length), partial rotary
        "gpt_oss": (OSS["oss"], adjusted(_sinks_of_unit_size)),  # sinks, YaRN, window
        "qwen3_next": (NEXT["next"], adjusted(realistic)),
        "qwen4_exp": (Q4["exp"], adjusted(ple_weights)),
        "qwen4_exp_sig": (Q4["sig"], adjusted(ple_weights)),  # sigmoid output gate
        "gemma3n": (G3N["e2b"], build_g3n),  # AltUp, LAuReL, KV sharing, sparse gate
        "gemma3n_alt": (G3N["alt"], build_g3n),  # another AltUp input, classic RoPE θ keys
        "gemma4_assistant": (G4["e2b"], build_assistants),
        "olmo3": (OLMO3["olmo3"], pad1),  # post-norm, whole q/k norms, window, YaRN on full
        "lfm2": (LFM2["lfm2_bias"], build_tiny),  # short convolutions with a bias, untied
        "glm4_moe": (GLM4["glm4_moe"], build_glm4),  # grouped sigmoid routing, partial RoPE
        "minimax_m2": (MM2["minimax_m2"], build_mm2),  # whole q/k norms, biased sigmoid routing
        "deepseek_v3": (DSV3["q_lora"], build_dsv3),  # latent attention, YaRN mscale, groups
        "deepseek_v32": (DSV32["v32"], build_dsv32),  # + the indexer's top-k keys
        "deepseek_v4": (DSV4["v4"], build_dsv4),  # CSA / HCA / window, hyper-connections, hash
        "granite4": (GRANITE4["granite4"], build_granite4),  # Mamba-2, NoPE, experts, scales
        "nemotron_h": (NEMOTRON_H["nemotron_h"], build_nemotron_h),  # Mamba-2, relu² experts
        "voxtral": (VOXTRAL["text"], build_voxtral),  # the Llama decoder a Whisper tower feeds
    }


def build_assistants(folder: Path, spec: dict) -> None:
    """Gemma 4 assistants drafting for the Gemma 4 target `spec` (folder/target): one that
    repeats its last token, so drafts are both kept and rejected (folder/copier), and a random
    one (folder, written last: its config.json marks the whole built)."""
    from test_gemma4 import build as build_g4
    from test_speculative_gemma4 import build_assistant

    ref = build_g4(folder / "target", spec)
    vocab = ref.config.vocab_size
    build_assistant(folder / "copier", folder / "target", vocab, copier=ref)
    build_assistant(folder, folder / "target", vocab)


def check_coverage(folders: dict[str, Path]) -> None:
    """Fails unless every decoder family in the registry has a tiny checkpoint (an encoder's
    vectors are proved against sentence-transformers: tests/test_embed_*.py)."""
    from mlxlis.models import REGISTRY, config_from_hf

    covered = {
        config_from_hf(json.loads((f / "config.json").read_text())).family for f in folders.values()
    }
    decoders = {name for name, f in REGISTRY.items() if f.kind == "decoder"}
    missing = sorted(decoders - covered)
    if missing:
        raise SystemExit(
            f"fingerprint: no tiny checkpoint of the registered families {', '.join(missing)}"
            " (add them to tiny_specs in scripts/fingerprint.py)"
        )


def tiny_folder(name: str, spec: dict, build) -> Path:
    folder = MODELS / name
    if not (folder / "config.json").is_file():
        build(folder, spec)
    return folder


def trajectory(n: int, seed: int, vocab: int) -> list[int]:
    from conftest import trajectory as t

    return t(n, seed=seed, vocab=vocab)


def cached_decode(model, ids: list[int], split: int) -> np.ndarray:
    """Logits of ids[split:], fed one at a time after ids[:split] was prefilled."""
    cache = model.make_cache()
    out = [model.net(mx.array([ids[:split]]), cache=cache)[0, -1:]]
    for t in ids[split:-1]:
        out.append(model.net(mx.array([[t]]), cache=cache)[0, -1:])
    return np.array(mx.concatenate(out).astype(mx.float32))


def greedy(model, ids: list[int], n: int, **kw) -> list[int]:
    return [
        e.token
        for e in mlxlis.generate(model, ids, max_tokens=n, stop_ids=set(), **kw)
        if e.token is not None
    ]


def batched(model, prompts: list[list[int]], n: int) -> tuple[list[int], list[float]]:
    from mlxlis.generation.core import Request
    from mlxlis.generation.engine import Engine
    from mlxlis.generation.sampling import SamplingParams

    engine = Engine(model, max_active=8, prefix_cache_bytes=0)
    try:
        streams = [
            engine.submit(Request(p, SamplingParams(max_tokens=n), top_logprobs=0)) for p in prompts
        ]
        toks, logps = [], []
        for s in streams:
            for e in s:
                if e.token is not None:
                    toks.append(e.token)
                    logps.append(e.logprob)
    finally:
        engine.shutdown()
    return toks, logps


def record(out: dict, key: str, model, vocab: int, long_n: int) -> None:
    ids = trajectory(long_n, 1, vocab)
    out[f"{key}/logits"] = np.array(model.logits(ids))
    out[f"{key}/cached"] = cached_decode(model, ids, long_n // 2)
    out[f"{key}/greedy"] = np.array(greedy(model, ids, 24))
    out[f"{key}/sampled"] = np.array(
        greedy(
            model,
            ids[:20],
            24,
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=3,
            repetition_penalty=1.1,
        )
    )
    prompts = [trajectory(n, s, vocab) for s, n in enumerate((5, 17, 33, 9))]
    toks, logps = batched(model, prompts, 12)
    out[f"{key}/batched_tokens"] = np.array(toks)
    out[f"{key}/batched_logprobs"] = np.array(logps, dtype=np.float64)


def record_assistant(out: dict, key: str, target, assistant) -> None:
    """A Gemma 4 assistant reads its target's caches and hidden state, so it runs only as a
    drafter: greedy and seeded sampled tokens speculating 3 at a time, with how many drafts
    were proposed and kept, and one 4-token sampled proposal with its probabilities."""
    from mlxlis.generation.assistant import AssistantDrafter
    from mlxlis.generation.sampling import SamplingParams
    from mlxlis.generation.speculative import Speculation
    from mlxlis.generation.steps import StepKind, forward

    ids = trajectory(20, 4, target.config.vocab_size)  # past the sliding window (8)
    spec = Speculation("draft", assistant, tokens=3)
    for mode, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, top_p=0.9, seed=3))):
        events = list(
            mlxlis.generate(target, ids, max_tokens=40, stop_ids=set(), speculation=spec, **kw)
        )
        out[f"{key}/{mode}"] = np.array([e.token for e in events if e.token is not None])
        usage = events[-1].usage
        out[f"{key}/{mode}_drafts"] = np.array([usage.draft_tokens, usage.accepted_tokens])
    caches = target.make_cache()
    logits, hidden = forward(
        target.net, [caches], mx.array(ids, mx.int32), StepKind.PROMPT, hidden=True
    )
    first = int(mx.argmax(logits, axis=-1).item())
    params = SamplingParams(temperature=1.0, seed=5)
    drafter = AssistantDrafter(assistant, target, params, caches)
    drafter.feed_hidden(ids, hidden)
    proposal = drafter.propose([*ids, first], 4)
    out[f"{key}/proposal"] = np.array(proposal.tokens)
    out[f"{key}/proposal_q"] = np.array(proposal.q.astype(mx.float32))


def fingerprint(tiny_only: bool = False) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    folders = {n: tiny_folder(n, spec, build) for n, (spec, build) in tiny_specs().items()}
    check_coverage(folders)
    for name, folder in folders.items():
        for dtype in ("float32", "float16"):
            model = mlxlis.load(folder, dtype)
            try:
                if model.config.family == "gemma4_assistant":
                    target = mlxlis.load(folder / "target", dtype)
                    record_assistant(out, f"{name}/{dtype}/random", target, model)
                    copier = mlxlis.load(folder / "copier", dtype)
                    record_assistant(out, f"{name}/{dtype}/copier", target, copier)
                else:
                    record(out, f"{name}/{dtype}", model, model.config.vocab_size, 48)
            except RuntimeError as e:  # MLX's CPU gather_mm is float32 only (the MoE families)
                print(f"{name} {dtype}: skipped ({e})", flush=True)
                continue
            print(f"{name} {dtype}", flush=True)
    if not tiny_only:
        for name in CATALOG:
            model = mlxlis.load(name, "float32")
            record(out, f"{name}/float32", model, 2000, 40)
            print(name, flush=True)
    return out


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("save", "check"):
        print(__doc__)
        return 2
    mode, path = sys.argv[1], Path(sys.argv[2])
    got = fingerprint("--tiny" in sys.argv[3:])
    if mode == "save":
        np.savez(path, **got)
        print(f"saved {len(got)} arrays to {path}")
        return 0
    want = dict(np.load(path))
    bad = 0
    for key in sorted(set(want) | set(got)):
        if key not in got or key not in want:
            print(f"MISSING {key}")
            bad += 1
            continue
        a, b = want[key], got[key]
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            diff = (
                float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                if a.shape == b.shape
                else float("nan")
            )
            print(f"DIFFERS {key}: shape {a.shape} vs {b.shape}, max |Δ| {diff:.3g}")
            bad += 1
    print(f"{len(want) - bad} of {len(want)} arrays bit-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
