"""`--speculative mtp` with DeepSeek V3's next-n layer (models/nextn.py): DeepSeek V3
(`deepseek_v3`, the layer over multi-head latent attention) and GLM-4.5 (`glm4_moe`).

The tiny checkpoints: random `deepseek_v3` and `glm4_moe` models written by transformers
(num_nextn_predict_layers 1; transformers ignores `model.layers.{L}.*` at load and writes none),
the next-n layer added to their safetensors by the test as the released checkpoints hold it:
`model.layers.{L}.*` a decoder layer saved by transformers itself (a model of L + 1 layers whose
last layer is random), then `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, `shared_head.head`
and a copy of the embedding as `embed_tokens`. The drafts are made to agree with the target
often (the acceptance below is the weights' doing, not a property of the method): the target's
embedding is scaled up (× LOUD) against its layers' outputs, so its next token depends mostly
on its last token, and the layer's eh_proj is near LOUD·[I | 0], its head and final
norm near the target's, so it reads the embedding of x_{t+1} much as the target does.

What is proved here:
- reference: the drafter's logits for the first draft and a chained one against the published
  formula (eh_proj(concat(enorm(embed(x_{t+1})), hnorm(g_t))), the decoder layer,
  shared_head.norm, shared_head.head; g_t the target's state after its final norm, a chained
  state the layer's output after shared_head.norm, as vLLM, SGLang and llama.cpp run it) built
  from transformers' own modules for the same config: its decoder layer (MLA expanding keys
  and values, where ours absorbs them; GQA with partial RoPE; the grouped experts) in a
  one-layer model of the family, its RMSNorm class, with the layer's weights loaded into them;
- greedy identity: drafting 1 and 3 tokens a step, the plain greedy tokens over 64 tokens
  (the target decides), the acceptance reported (self-consistency);
- DeepSeek's drafter caches latents: its cache holds (1, 1, S, kv_lora_rank) latents and
  (1, 1, S, rope) keys;
- GLM GGUF: llama.cpp's own converter (its Glm4MoeModel keeps the layer as blk.L with
  blk.L.nextn.*) gives the folder's drafter (same logits) and the plain greedy tokens;
- refusal: DeepSeek V3 converted by llama.cpp (its deepseek2 drops the layer) is refused naming
  the model and the field.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlxlis
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Speculation, SpeculativeError
from mlxlis.generation.steps import StepKind, forward

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import build_tiny, greedy_tokens, randomize, trajectory
from llama_cpp_convert import convert_all
from test_deepseek_v3 import BASE as DSV3
from test_glm4_moe import GLM_SPECIAL
from test_glm4_moe import SPECS as GLM4

LOUD = 50.0  # the embedding's scale against the layers' outputs (see the docstring)
BOUND = 1e-4  # logits, float32 against transformers
SPECS = {
    "deepseek_v3": dict(DSV3, num_nextn_predict_layers=1),
    "glm4_moe": dict(GLM4["glm4_moe"], num_nextn_predict_layers=1),
}
TOKENIZER = {"deepseek_v3": {}, "glm4_moe": {"extra_special": GLM_SPECIAL}}
PROMPT = 40
NEW = 64


def loud_and_biased(model, seed: int) -> None:
    """The embedding × LOUD (where the module has one); a random correction bias on each
    router."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.mul_(LOUD)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def add_nextn(folder: Path, ref, seed: int = 7) -> dict[str, torch.Tensor]:
    """The next-n layer's tensors added to the folder's safetensors (module docstring);
    returns the layer's extra tensors by their checkpoint names."""
    from safetensors.numpy import load_file, save_file

    c = copy.deepcopy(ref.config)
    n, h = c.num_hidden_layers, c.hidden_size
    c.num_hidden_layers = n + 1
    big = ref.__class__(c).eval()  # the target's layers, then the next-n layer's block
    missing, unexpected = big.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(f"model.layers.{n}.") for k in missing)
    randomize(big.model.layers[n], seed)
    loud_and_biased(big.model.layers[n], seed)
    aside = folder.parent / f"{folder.name}-big"
    big.save_pretrained(aside)
    saved = load_file(aside / "model.safetensors")
    rng = np.random.default_rng(seed)
    eye = LOUD * np.concatenate([np.eye(h), np.zeros((h, h))], axis=1)
    at = f"model.layers.{n}."
    extra = {
        "eh_proj.weight": eye + 0.02 * rng.standard_normal((h, 2 * h)),
        "enorm.weight": 1 + 0.1 * rng.standard_normal(h),
        "hnorm.weight": 1 + 0.1 * rng.standard_normal(h),
        # near the target's (so that drafts agree), not equal (so that each is told apart)
        "shared_head.norm.weight": ref.model.norm.weight.detach().numpy()
        * (1 + 0.05 * rng.standard_normal(h)),
        "shared_head.head.weight": ref.lm_head.weight.detach().numpy()
        + 0.01 * rng.standard_normal(ref.lm_head.weight.shape),
        "embed_tokens.weight": ref.model.embed_tokens.weight.detach().numpy(),
    }
    extra = {at + k: np.asarray(v, np.float32) for k, v in extra.items()}
    st = folder / "model.safetensors"
    layer = {k: v for k, v in saved.items() if k.startswith(at)}
    save_file({**load_file(st), **layer, **extra}, str(st), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    return big, {k[len(at) :]: torch.from_numpy(v) for k, v in extra.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, float32 model, the reference drafter)."""
    built = {}

    def get(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            ref = build_tiny(
                folder,
                SPECS[name],
                tokenizer_kw=TOKENIZER[name],
                adjust=lambda m: loud_and_biased(m, 5),
            )
            big, extra = add_nextn(folder, ref)
            built[name] = (folder, mlxlis.load(folder, "float32"), ReferenceNextN(ref, big, extra))
        return built[name]

    return get


# ---------------------------------------------------------------- the reference (transformers)


class ReferenceNextN:
    """The published formula over transformers' modules: enorm / hnorm its RMSNorm class, the
    decoder layer and shared_head.norm in a one-layer model of the family (run on
    inputs_embeds: its rotary embedding and causal mask), shared_head.head its lm_head."""

    def __init__(self, ref, big, extra: dict[str, torch.Tensor]):
        c = copy.deepcopy(ref.config)
        c.num_hidden_layers, c.first_k_dense_replace = 1, 0
        self.ref, self.extra = ref, extra
        self.one = ref.__class__(c).eval()
        self.one.model.layers[0] = big.model.layers[ref.config.num_hidden_layers]
        rms = type(ref.model.norm)
        self.enorm, self.hnorm = (rms(c.hidden_size, eps=c.rms_norm_eps) for _ in range(2))
        with torch.no_grad():
            self.enorm.weight.copy_(extra["enorm.weight"])
            self.hnorm.weight.copy_(extra["hnorm.weight"])
            self.one.model.norm.weight.copy_(extra["shared_head.norm.weight"])
            self.one.lm_head.weight.copy_(extra["shared_head.head.weight"])

    def pair(self, token: int, hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(concat(enorm(embedding), hnorm(hidden))): (hidden,)"""
        e = self.enorm(self.ref.model.embed_tokens(torch.tensor([token]))[0])
        return torch.cat([e, self.hnorm(hidden)]) @ self.extra["eh_proj.weight"].T

    def run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, state after shared_head.norm) of the last of the pairs `inputs`."""
        embeds = torch.stack(inputs)[None]
        out = self.one.model(inputs_embeds=embeds, use_cache=False).last_hidden_state[0]
        return self.one.lm_head(out[-1]), out[-1]

    @torch.no_grad()
    def drafts(self, ids: list[int], chained: list[int]) -> list[np.ndarray]:
        """Logits of the draft after `ids` (the target's states after its final norm of
        ids[:-1], paired with ids[1:]), then after each of `chained` (paired with the layer's
        own state)."""
        g = self.ref.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        inputs = [self.pair(ids[j + 1], g[j]) for j in range(len(ids) - 1)]
        logits, state = self.run(inputs)
        out = [logits.numpy()]
        for t in chained:
            inputs.append(self.pair(t, state))
            logits, state = self.run(inputs)
            out.append(logits.numpy())
        return out


def our_drafts(model, ids: list[int], chained: list[int]):
    """The drafter's logits as generation/mtp.py forms them (its head on the target's states
    from a prompt step): after `ids`, then after each of `chained`; and the drafter."""
    drafter = Speculation("mtp").drafter(SamplingParams(), model)
    _, states = forward(
        model.net, [model.make_cache()], mx.array(ids, mx.int32), StepKind.PROMPT, hidden=True
    )
    head = drafter.head
    g = head.target_states(states)
    out = head.step(ids[1:], g[:-1], drafter.cache)[-1:]  # (1, hidden)
    logits = [np.array(head.logits(out))[0]]
    for t in chained:
        out = head.step([t], out, drafter.cache)
        logits.append(np.array(head.logits(out))[0])
    return logits, drafter


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_drafter_logits_match_the_formula_on_transformers_modules(tiny, name):
    """First and second (chained) drafts: the drafter's logits against the reference's within
    1e-4 (measured 6.0e-7 and 3.6e-7 for DeepSeek V3, 7.2e-7 and 4.8e-7 for GLM-4.5);
    DeepSeek's drafter cache holds latents, not keys and values."""
    folder, model, reference = tiny(name)
    ids = trajectory(PROMPT, vocab=model.config.vocab_size)
    ours, drafter = our_drafts(model, ids, [17])
    theirs = reference.drafts(ids, [17])
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        delta = np.abs(a - b).max()
        print(f"{name} draft {i + 1}: max |Δ logits| = {delta:.1e}")
        assert delta < BOUND, f"draft {i + 1}: max |Δ| = {delta}"
    assert np.abs(theirs[0]).max() > 1.0
    if name == "deepseek_v3":
        dims, (cache,) = model.config.family_config.mla, drafter.cache
        latent, k_pe = cache.state
        assert cache.offset == PROMPT  # the prompt's 39 pairs and the chained draft's
        # (B, 1 latent "head", capacity >= S, ·): latents and rope keys only
        assert latent.shape[:2] == k_pe.shape[:2] == (1, 1) and latent.shape[2] >= PROMPT
        assert (latent.shape[-1], k_pe.shape[-1]) == (dims.kv_lora_rank, dims.qk_rope_head_dim)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_greedy_mtp_speculation_gives_the_plain_greedy_tokens(tiny, name):
    """1 and 3 drafts a step: the plain greedy tokens over 64 tokens, drafts accepted and
    rejected (acceptance reported)."""
    _, model, _ = tiny(name)
    prompt = trajectory(PROMPT, seed=4, vocab=model.config.vocab_size)
    plain, _ = greedy_tokens(model, prompt, NEW)
    assert len(plain) == NEW
    for k in (1, 3):
        got, seq = greedy_tokens(model, prompt, NEW, Speculation("mtp", tokens=k))
        u = seq.usage
        print(f"{name} k={k}: {u.accepted_tokens}/{u.draft_tokens} drafts accepted")
        assert got == plain, k
        assert 0 < u.accepted_tokens < u.draft_tokens, k


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory):
    """name -> the float32 model of the folder converted by llama.cpp's converter (f32)."""
    out = tmp_path_factory.mktemp("nextn_gguf")
    paths = {name: out / f"{name}.gguf" for name in SPECS}
    convert_all([(tiny(name)[0], path, "f32") for name, path in paths.items()])
    return {name: mlxlis.load(path, "float32") for name, path in paths.items()}


def test_glm_gguf_from_llama_cpp_converter_drafts_as_the_folder(tiny, ggufs):
    """GLM-4.5 through llama.cpp's convert_hf_to_gguf.py (glm4moe: the layer as blk.3, its
    blk.3.nextn.* tensors, the embedding copy and the head included): the drafter's logits
    equal the folder's (first and chained draft, within 1e-5) and 3 drafts a step give the
    plain greedy tokens."""
    _, folder_model, _ = tiny("glm4_moe")
    gguf = ggufs["glm4_moe"]
    assert gguf.config.num_hidden_layers == 3 and gguf.format == "gguf"
    nextn = {n.split(".")[3] for n in gguf.skipped if n.startswith("blk.3.nextn.")}
    assert nextn == {
        "eh_proj",
        "enorm",
        "hnorm",
        "shared_head_norm",
        "shared_head_head",
        "embed_tokens",
    }
    ids = trajectory(PROMPT, seed=2, vocab=gguf.config.vocab_size)
    ours, _ = our_drafts(gguf, ids, [17])
    theirs, _ = our_drafts(folder_model, ids, [17])
    for a, b in zip(ours, theirs, strict=True):
        assert np.abs(a - b).max() < 1e-5
    prompt = trajectory(PROMPT, seed=4, vocab=gguf.config.vocab_size)
    plain, _ = greedy_tokens(gguf, prompt, NEW)
    got, seq = greedy_tokens(gguf, prompt, NEW, Speculation("mtp", tokens=3))
    assert got == plain and seq.usage.accepted_tokens > 0


def test_deepseek_gguf_without_the_layer_is_refused(ggufs):
    """llama.cpp's deepseek2 conversion drops the next-n layer: `--speculative mtp` is refused
    on the `speculative` field, naming the model and why."""
    model = ggufs["deepseek_v3"]
    assert not any(n.startswith("blk.3.") for n in model.skipped)
    with pytest.raises(SpeculativeError, match="no multi-token-prediction block") as e:
        Speculation("mtp").drafter(SamplingParams(), model)
    assert e.value.field == "speculative" and model.name in str(e.value)
    assert "deepseek2 drops the layer" in str(e.value)
