"""`--speculative mtp`: Qwen3.5's multi-token-prediction block as the drafter
(models/qwen3_5_mtp.py, generation/mtp.py).

The tiny checkpoint: a random Qwen3.5 (L L L F, untied) written by transformers, which ignores
`mtp.*`, so the block is added to its safetensors by hand with the shapes real checkpoints use
(`mtp.fc` (hidden, 2·hidden), `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.norm`, and `mtp.layers.0.*` shaped as a full-attention decoder layer), and
`mtp_num_hidden_layers: 1` in config.json; the same weights also in a GGUF under llama.cpp's
names (conversion/qwen.py, _QwenMtpMixin: block N = the layer count, `blk.N.nextn.eh_proj`,
`enorm`, `hnorm`, `shared_head_norm`, 1 added to every norm).

What is proved here:
- reference: the drafter's first and second (chained) drafting steps against a torch
  implementation written in this file from vLLM's qwen3_5_mtp.py (Qwen3_5MultiTokenPredictor:
  fc over concat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)), one full-attention
  layer, norm, the target's head; the target's hidden state after its final norm, the chained
  state after mtp.norm — SGLang's and llama.cpp's graphs agree), its decoder layer and final
  norm transformers' own Qwen3.5 layer. A reference written from the structure, not a library's
  MTP (transformers has none): weaker than the parity tests;
- the folder's and the GGUF's blocks propose the same tokens with the same probabilities;
- greedy identity: with the block drafting 1 and 3 tokens a step (and the Governor choosing,
  plain probe steps included), the plain greedy tokens over 100 tokens after a prompt past the
  DeltaNet's 64-token chunk, from the folder and from the GGUF (self-consistency);
- bookkeeping: with proposals kept and rejected at every position (the block drafting, its
  proposals replaced by the plain continuation with one token wrong), the block's KV cache
  ends holding what one pass over the whole sequence builds (its chained entries trimmed,
  each position paired with the target's state once);
- refusal: a model without the block is refused naming it and the field.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import mlxlis
from mlxlis.generation.sampling import SamplingParams
from mlxlis.generation.speculative import Drafter, Proposal, Speculation, SpeculativeError
from mlxlis.generation.steps import StepKind, forward

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import add_bpe_tokenizer, add_gguf_sizes, trajectory
from test_qwen3_5 import SPECS as QWEN35
from test_qwen3_5 import build
from test_qwen3_5_gguf import BLOCK, llama_cpp_tensors
from test_speculative import tokens_of

PROMPT = 80  # past the DeltaNet's chunk (64)
NEXTN = {
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head_norm",
}


def add_mtp(folder: Path, ref, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors added to the folder's safetensors (norms zero-centred near 0,
    matrices N(0, 0.08)), `mtp_num_hidden_layers: 1` to its config; the tensors."""
    from safetensors.numpy import load_file, save_file

    c = ref.config
    st = folder / "model.safetensors"
    tensors = load_file(st)
    rng = np.random.default_rng(seed)
    full = f"model.layers.{c.layer_types.index('full_attention')}."
    shapes = {
        f"mtp.layers.0.{k[len(full) :]}": a.shape for k, a in tensors.items() if k.startswith(full)
    }
    h = c.hidden_size
    shapes.update({"mtp.fc.weight": (h, 2 * h)})
    shapes.update({f"mtp.{n}.weight": (h,) for n in NEXTN if n != "fc"})
    mtp = {
        k: ((0.1 if "norm" in k else 0.08) * rng.standard_normal(s)).astype(np.float32)
        for k, s in shapes.items()
    }
    save_file({**tensors, **mtp}, str(st), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return {k: torch.from_numpy(v) for k, v in mtp.items()}


def write_gguf(path: Path, ref, folder: Path, mtp: dict[str, torch.Tensor]) -> None:
    """The model and its block in llama.cpp's layout (F32), as conversion/qwen.py writes them."""
    c = ref.config
    n, arch = c.num_hidden_layers, "qwen35"
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_sizes(w, c)
    w.add_block_count(n + 1)  # the MTP block counts
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_uint32(f"{arch}.ssm.conv_kernel", c.linear_conv_kernel_dim)
    w.add_uint32(f"{arch}.ssm.state_size", c.linear_key_head_dim)
    w.add_uint32(f"{arch}.ssm.group_count", c.linear_num_key_heads)
    w.add_uint32(f"{arch}.ssm.time_step_rank", c.linear_num_value_heads)
    w.add_uint32(f"{arch}.ssm.inner_size", c.linear_num_value_heads * c.linear_value_head_dim)
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    recurrent = [t == "linear_attention" for t in c.layer_types] + [False]
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    add_bpe_tokenizer(w, folder, c)
    tensors = llama_cpp_tensors(ref)
    for name, t in mtp.items():
        rest = name.removeprefix("mtp.")
        if rest.startswith("layers.0."):
            stem, part = rest.removeprefix("layers.0.").rsplit(".", 1)
            key = f"blk.{n}.{BLOCK[stem]}.{part}"
        else:
            key = f"blk.{n}.nextn.{NEXTN[rest.rsplit('.', 1)[0]]}.weight"
        tensors[key] = t.numpy() + (1.0 if key.endswith("norm.weight") else 0.0)
    for name, a in tensors.items():
        w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder model, GGUF model, transformers model, the mtp tensors, folder)."""
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    ref = build(folder, dict(QWEN35["qwen3_5"], mtp_num_hidden_layers=1))
    mtp = add_mtp(folder, ref)
    path = folder.parent / "qwen3_5_mtp.gguf"
    write_gguf(path, ref, folder, mtp)
    return mlxlis.load(folder, "float32"), mlxlis.load(path, "float32"), ref, mtp, folder


# ---------------------------------------------------------------- the reference (vLLM's structure)


def rms_plus_one(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class ReferenceMTP:
    """vLLM's Qwen3_5MultiTokenPredictor in torch: the block's decoder layer and final norm as a
    one-layer transformers Qwen3.5 run on `inputs_embeds`, the target's head."""

    def __init__(self, ref, mtp: dict[str, torch.Tensor]):
        c = copy.deepcopy(ref.config)
        c.num_hidden_layers, c.layer_types = 1, ["full_attention"]
        self.ref, self.mtp, self.eps = ref, mtp, c.rms_norm_eps
        self.layer = ref.__class__(c).eval()
        sd = {"model." + k.removeprefix("mtp."): v for k, v in mtp.items() if ".layers.0." in k}
        sd["model.norm.weight"] = mtp["mtp.norm.weight"]
        sd["lm_head.weight"] = ref.lm_head.weight.detach()
        sd["model.embed_tokens.weight"] = ref.model.embed_tokens.weight.detach()
        missing, unexpected = self.layer.load_state_dict(sd, strict=False)
        assert not unexpected and not missing, (missing, unexpected)

    def pair(self, token: int, hidden: torch.Tensor) -> torch.Tensor:
        """fc(concat(embedding normed, hidden normed)): (hidden,)"""
        m = self.mtp
        e = self.ref.model.embed_tokens(torch.tensor([token]))[0]
        e = rms_plus_one(e, m["mtp.pre_fc_norm_embedding.weight"], self.eps)
        h = rms_plus_one(hidden, m["mtp.pre_fc_norm_hidden.weight"], self.eps)
        return torch.cat([e, h]) @ m["mtp.fc.weight"].T

    def run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, states after mtp.norm) of the last of the pairs `inputs`."""
        embeds = torch.stack(inputs)[None]
        out = self.layer.model(inputs_embeds=embeds, use_cache=False).last_hidden_state[0]
        return self.layer.lm_head(out[-1]), out[-1]

    @torch.no_grad()
    def drafts(self, ids: list[int], chained: list[int]) -> list[np.ndarray]:
        """Logits of the drafts after `ids` (the target's states of ids[:-1] after its final
        norm, paired with ids[1:]), then after each of `chained` (paired with the block's
        state)."""
        g = self.ref.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        inputs = [self.pair(ids[j + 1], g[j]) for j in range(len(ids) - 1)]
        logits, state = self.run(inputs)
        out = [logits.numpy()]
        for t in chained:
            inputs.append(self.pair(t, state))
            logits, state = self.run(inputs)
            out.append(logits.numpy())
        return out


def propose(model, ids: list[int], k: int, params: SamplingParams):
    """The drafter's proposal after `ids` fed as the core feeds a prompt (its states handed
    over), and the target's greedy next token appended."""
    drafter = Speculation("mtp").drafter(params, model)
    logits, states = forward(
        model.net, [model.make_cache()], mx.array(ids, mx.int32), StepKind.PROMPT, hidden=True
    )
    drafter.feed_hidden(ids, states)
    first = int(mx.argmax(logits, axis=-1).item())
    return drafter.propose([*ids, first], k), [*ids, first]


def test_drafting_steps_match_the_reference(tiny):
    """First and second (chained) drafting steps: the drafter's log-probabilities (temperature
    1, no filter: log-softmax of its logits) against the reference's, within 1e-4 (measured
    3.3e-6 and 2.4e-6)."""
    model, _, ref, mtp, _ = tiny
    ids = trajectory(PROMPT, vocab=model.config.vocab_size)
    prop, seq = propose(model, ids, 2, SamplingParams(temperature=1.0, seed=3))
    theirs = ReferenceMTP(ref, mtp).drafts(seq, prop.tokens[:1])
    ours = np.log(np.array(prop.q))
    for i, logits in enumerate(theirs):
        shifted = logits - logits.max()
        delta = np.abs(ours[i] - (shifted - np.log(np.exp(shifted).sum()))).max()
        assert delta < 1e-4, f"step {i + 1}: max |Δ log p| = {delta}"
    assert np.abs(theirs[0]).max() > 1.0  # logits that tell tokens apart


def test_folder_and_gguf_blocks_propose_the_same(tiny):
    """The block read from the folder and from the GGUF (llama.cpp's names, +1 norms): the same
    greedy proposals, and the same probabilities when sampling (within 1e-5, measured
    7.5e-9)."""
    folder_model, gguf_model, *_ = tiny
    assert any(n.startswith("blk.4.nextn.") for n in gguf_model.skipped)
    ids = trajectory(PROMPT, seed=2, vocab=folder_model.config.vocab_size)
    a, _ = propose(folder_model, ids, 4, SamplingParams())
    b, _ = propose(gguf_model, ids, 4, SamplingParams())
    assert a.tokens == b.tokens and len(a.tokens) == 4
    params = SamplingParams(temperature=0.8, seed=1)
    a, _ = propose(folder_model, ids, 3, params)
    b, _ = propose(gguf_model, ids, 3, params)
    assert a.tokens == b.tokens
    assert np.abs(np.array(a.q) - np.array(b.q)).max() < 1e-5


@pytest.mark.parametrize("which", ["folder", "gguf"])
def test_greedy_mtp_speculation_gives_the_plain_greedy_tokens(tiny, which):
    """1 and 3 drafts a step, and the Governor's choice (plain probe steps in between, whose
    positions the block fills from its own states); from the GGUF, 3: the plain greedy
    tokens."""
    model = tiny[0] if which == "folder" else tiny[1]
    prompt = trajectory(PROMPT, seed=4, vocab=model.config.vocab_size)
    plain, _ = tokens_of(model, prompt)
    assert len(plain) >= 100
    ks = (1, 3, None) if which == "folder" else (3,)
    for spec in (Speculation("mtp", tokens=k) for k in ks):
        got, seq = tokens_of(model, prompt, spec)
        assert got == plain, spec.tokens
        assert seq.usage.draft_tokens > 0, spec.tokens


class Corrupted(Drafter):
    """The MTP drafter run as it is (its cache fed, drafted on and trimmed), its proposals
    replaced by the plain greedy continuation `truth` with one token wrong at position (call
    count mod k + 1): each verification keeps a known number of them."""

    wants_hidden = True

    def __init__(self, inner, truth: list[int], vocab: int):
        self.inner, self.truth, self.vocab = inner, truth, vocab
        self.fed: list[int] = []
        self.calls = 0

    def feed_hidden(self, ids, hidden) -> None:
        self.fed += list(ids)
        self.inner.feed_hidden(ids, hidden)

    def propose(self, history, k):
        assert len(self.inner.propose(history, k).tokens) == k
        n = len(history)
        tokens = list(self.truth[n : n + k])
        wrong = self.calls % (k + 1)
        self.calls += 1
        if wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % self.vocab
        return Proposal(tokens)


def test_the_block_cache_holds_each_position_once_after_kept_and_rejected_drafts(tiny):
    """3 drafts a step, 0..3 of them kept in turn: the plain greedy tokens, and the block's KV
    cache as one pass of the whole fed sequence builds it (within 2e-4, measured 5.1e-5: the
    target's states come from verification steps, not one chunked forward)."""
    model = tiny[0]
    prompt = trajectory(PROMPT, seed=6, vocab=model.config.vocab_size)
    plain, _ = tokens_of(model, prompt)
    inner = Speculation("mtp").drafter(SamplingParams(), model)
    drafter = Corrupted(inner, prompt + plain, model.config.vocab_size)
    got, seq = tokens_of(model, prompt, Speculation("custom", make=lambda p: drafter, tokens=3))
    assert got == plain
    assert 0 < seq.usage.accepted_tokens < seq.usage.draft_tokens
    assert drafter.fed == (prompt + plain)[: len(drafter.fed)] and len(drafter.fed) > PROMPT + 50
    once = Speculation("mtp").drafter(SamplingParams(), model)
    _, states = forward(
        model.net,
        [model.make_cache()],
        mx.array(drafter.fed, mx.int32),
        StepKind.PROMPT,
        hidden=True,
    )
    once.feed_hidden(drafter.fed, states)
    (a,), (b,) = inner.cache, once.cache
    assert a.offset == b.offset == len(drafter.fed) - 1
    for x, y in zip(a.state, b.state, strict=True):
        delta = np.abs(np.array(x[..., : a.offset, :]) - np.array(y[..., : b.offset, :])).max()
        assert delta < 2e-4, delta


def test_a_model_without_the_block_is_refused(tiny, tmp_path):
    """No mtp.* tensors (as mlx-lm's conversion leaves a folder): a SpeculativeError on the
    `speculative` field naming the model."""
    from safetensors.numpy import load_file, save_file

    *_, folder = tiny
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    st = bare / "model.safetensors"
    save_file({k: v for k, v in load_file(st).items() if not k.startswith("mtp.")}, str(st))
    model = mlxlis.load(bare, "float32")
    with pytest.raises(SpeculativeError, match="no multi-token-prediction block") as e:
        Speculation("mtp").drafter(SamplingParams(), model)
    assert e.value.field == "speculative" and model.name in str(e.value)
