"""The mutation check: does the test suite notice a small wrong change to the numerics?

usage: python scripts/mutants.py [--only ID ...] [--list]

Each mutant below is one deliberate bug (a snippet of a source file replaced by another). For
each, the tree is copied to a temporary folder, the mutant applied there, and the named tests
run on the copy; a mutant is killed when they fail. The same tests first run on an unmutated
copy and must pass, else a "kill" would prove nothing. Exit status 0 only when every mutant is
killed. Run it before a refactor and after adding a family (`make mutants`); it is not part of
`make test`. A mutant whose snippet is no longer in the source is reported as stale (the list
must follow the code).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest paths / node ids expected to kill it
    what: str


LLAMA4_HF = "tests/test_llama4.py::test_logits_match_transformers_fp32"
LLAMA4_CACHE = "tests/test_llama4.py::test_cached_decode_and_batches_equal_the_full_forward"
OSS_HF = "tests/test_gpt_oss.py::test_logits_match_transformers_fp32"
OSS_CACHE = "tests/test_gpt_oss.py::test_cached_decode_and_batches_equal_the_full_forward"
OSS_GGUF = "tests/test_gpt_oss.py::test_gguf_matches_transformers_on_the_files_weights"
M3_HF = "tests/test_mistral3.py::test_logits_match_transformers_fp32"
M3_GGUF = "tests/test_mistral3.py::test_gguf_matches_transformers_on_the_files_weights"
G3N_HF = "tests/test_gemma3n.py::test_logits_match_transformers_fp32"
G3N_GGUF = "tests/test_gemma3n.py::test_gguf_matches_transformers_on_the_files_weights"
Q3N_HF = "tests/test_qwen3_next.py::test_logits_match_transformers_fp32"
Q3N_GGUF = "tests/test_qwen3_next.py::test_gguf_matches_transformers_on_the_files_weights"
NET4 = "mlxlis/models/qwen4_exp_net.py"
PARTS4 = "mlxlis/models/qwen4_exp_parts.py"
QMV_GRID = "tests/test_qmv.py::test_every_width_and_group_matches_float64_and_mlx"
QMV_PREFILL = "tests/test_qmv.py::test_prefill_dequantizes_tiles_into_sgemm"
QMV_GEMM = "tests/test_qmv.py::test_prompt_rows_through_the_isas_own_product"
QMV_SUPER = "tests/test_qmv.py::test_super_block_formats_equal_the_float_scales_layout"
QUANTS_SUPER = "tests/test_quants.py::test_k_quants_held_as_stored_bit_exact"
FUSED = "tests/test_fused.py"
Q4X_HF = "tests/test_qwen4_exp.py::test_logits_match_transformers_fp32"
THINKING_SWITCH = "tests/test_thinking_switch.py"
SERVE_MODELS = "tests/test_serve_models.py"
LORA = "tests/test_lora.py"
LORA_ENGINE = "tests/test_lora_engine.py"
LORA_GGUF = "tests/test_lora_gguf.py"
OLMO3_HF = "tests/test_olmo3.py::test_logits_match_transformers_fp32"
OLMO3_LOCAL = "tests/test_olmo3.py::test_sliding_layers_keep_their_own_rope"
OLMO3_GGUF = "tests/test_olmo3.py::test_gguf_from_llama_cpp_converter_equals_the_folder"
LFM2_HF = "tests/test_lfm2.py::test_logits_match_transformers_fp32"
LFM2_CACHE = "tests/test_lfm2.py::test_chunked_prefill_decode_and_batches_equal_the_full_forward"
LFM2_REWIND = "tests/test_lfm2.py::test_a_rejection_at_each_position_rewinds_the_conv_state_exactly"
LFM2_ENGINE = "tests/test_lfm2.py::test_speculation_and_engine_batches_give_the_lone_greedy_tokens"
LFM2_GGUF = "tests/test_lfm2.py::test_gguf_from_llama_cpp_converter_equals_the_folder"
Q4X_CACHE = (
    "tests/test_qwen4_exp.py::test_a_trimmed_verification_and_a_saved_cache_decode_on_exactly"
)
G3N_CACHE = "tests/test_gemma3n.py::test_cached_decode_and_batches_equal_the_full_forward"
TOOL_CORPUS = "tests/test_tool_corpus.py"
TOOL_FORCING = "tests/test_tool_forcing.py::test_a_forced_call_reads_back_and_validates"
STYLES_WRITER = (
    "tests/test_tool_forcing_styles.py::test_the_writers_text_is_what_the_grammar_allows"
)
STYLES_WALKS = (
    "tests/test_tool_forcing_styles.py::test_random_calls_read_back_valid_and_write_back_the_same"
)

MUTANTS = (
    Mutant(
        "rope-freqs-divide",
        "mlxlis/models/rope.py",
        "periods = periods * freq_factors.astype(mx.float32)",
        "periods = periods / freq_factors.astype(mx.float32)",
        ("tests/test_gguf_tiny.py",),
        "GGUF rope_freqs applied by dividing the wavelengths instead of multiplying",
    ),
    Mutant(
        "gemma-gguf-sliding-flip",
        "mlxlis/models/gemma.py",
        "types = tuple(LAYER_TYPES[(i + 1) % v.pattern != 0] for i in range(n))",
        "types = tuple(LAYER_TYPES[(i + 1) % v.pattern == 0] for i in range(n))",
        ("tests/test_gguf_tiny.py",),
        "Gemma 2/3 GGUF: which layers are sliding flipped",
    ),
    Mutant(
        "gemma3-local-rope",
        "mlxlis/models/gemma.py",
        'attention["rope_local"] = RopeConfig(theta=10000.0)',
        'attention["rope_local"] = RopeConfig(theta=1000000.0)',
        ("tests/test_gguf_tiny.py",),
        "Gemma 3 GGUF local RoPE base 1e4 -> 1e6",
    ),
    Mutant(
        "temperature-multiplies",
        "mlxlis/generation/sampling.py",
        "logits = logits * inv_t",
        "logits = logits * params.temperature",
        ("tests/test_sampling.py",),
        "sampling temperature multiplies instead of divides",
    ),
    Mutant(
        "top-p-skipped",
        "mlxlis/generation/sampling.py",
        "logits = _top_p(logits, top_p)",
        "logits = logits",
        ("tests/test_sampling.py",),
        "top-p filter skipped in the sampler",
    ),
    Mutant(
        "chatml-newline",
        "mlxlis/prompt/templates/chatml.jinja",
        "message['content'] + '<|im_end|>' + '\\n'",
        "message['content'] + '<|im_end|>' + ' '",
        ("tests/test_chat_template.py",),
        "built-in chatml template: a newline replaced by a space",
    ),
    Mutant(
        "gemma-turn-newline",
        "mlxlis/prompt/templates/gemma.jinja",
        "{{ '<end_of_turn>\n' }}",
        "{{ '<end_of_turn>' }}",
        ("tests/test_chat_template.py",),
        "built-in gemma template: the newline after <end_of_turn> dropped",
    ),
    Mutant(
        "qk-unpermute",
        "mlxlis/models/conventions.py",
        "w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)",
        "w.reshape(n_heads, 2, rows // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)",
        ("tests/test_conventions.py",),
        "Llama Q/K un-permute applies llama.cpp's permute instead of its inverse",
    ),
    Mutant(
        "gemma-norm-offset",
        "mlxlis/models/conventions.py",
        "return w.astype(mx.float32) - 1.0",
        "return w.astype(mx.float32)",
        ("tests/test_gguf_tiny.py",),
        "Gemma GGUF norm weights keep llama.cpp's +1",
    ),
    Mutant(
        "window-off-by-one",
        "mlxlis/cache/kv.py",
        "keep = keep & (k > q - window)",
        "keep = keep & (k >= q - window)",
        ("tests/test_gemma_parity.py",),
        "sliding window one key too wide",
    ),
    Mutant(
        "q4k-scale-min-swap",
        "mlxlis/loading/quant_blocks.py",
        "np.multiply(d, sc.astype(np.float32), out=s)\n"
        "    np.multiply(dmin, mn.astype(np.float32), out=m)",
        "np.multiply(d, mn.astype(np.float32), out=s)\n"
        "    np.multiply(dmin, sc.astype(np.float32), out=m)",
        ("tests/test_quants.py",),
        "Q4_K/Q5_K sub-block scales and mins swapped",
    ),
    Mutant(
        "rmsnorm-eps",
        "mlxlis/models/layers.py",
        "return RMSNorm(dims, eps=cfg.norms.eps)",
        "return RMSNorm(dims, eps=1e-2)",
        ("tests/test_llama_parity.py",),
        "RMSNorm eps not taken from the config (Llama/Qwen norms)",
    ),
    Mutant(
        "gemma-scale-skipped",
        "mlxlis/models/decoder.py",
        "h = h * mx.array(cfg.hidden_size**0.5, mx.float32).astype(h.dtype)",
        "h = h",
        ("tests/test_gemma_parity.py",),
        "Gemma embeddings not scaled by √hidden",
    ),
    Mutant(
        "qk-norm-skipped",
        "mlxlis/models/layers.py",
        "q, k = self.q_norm(q), self.k_norm(k)",
        "q, k = q, k",
        ("tests/test_qwen3.py",),
        "Qwen3 / Gemma 3 q/k RMSNorm not applied",
    ),
    Mutant(
        "router-bottom-k",
        "mlxlis/models/experts.py",
        "mx.argpartition(-probs, kth=k - 1, axis=-1)",
        "mx.argpartition(probs, kth=k - 1, axis=-1)",
        ("tests/test_qwen3.py",),
        "MoE router picks the k least likely experts",
    ),
    Mutant(
        "router-renorm-flipped",
        "mlxlis/models/experts.py",
        "if self.norm_topk_prob:",
        "if not self.norm_topk_prob:",
        ("tests/test_qwen3.py",),
        "MoE top-k probabilities renormalised exactly when the config says not to",
    ),
    Mutant(
        "experts-stacked-reversed",
        "mlxlis/loading/plan.py",
        "parts = tuple(by_name.get(k, k) for k in lay.parts)",
        "parts = tuple(by_name.get(k, k) for k in reversed(lay.parts))",
        ("tests/test_qwen3.py",),
        "per-expert checkpoint tensors stacked in the wrong order",
    ),
    Mutant(
        "sparse-step-off-by-one",
        "mlxlis/models/reading.py",
        "return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))",
        "return tuple(i not in dense and i % step == 0 for i in range(n))",
        ("tests/test_qwen3.py",),
        "decoder_sparse_step counts layers from 0 instead of 1",
    ),
    Mutant(
        "qwen3moe-gguf-no-renorm",
        "mlxlis/models/qwen3_moe.py",
        "return base.with_(moe=moe_config(size, sparse, norm_topk_prob=True))",
        "return base.with_(moe=moe_config(size, sparse, norm_topk_prob=False))",
        ("tests/test_qwen3_gguf.py",),
        "Qwen3-MoE GGUF: top-k weights not renormalised as llama.cpp does",
    ),
    Mutant(
        "delta-rule-no-beta",
        "mlxlis/models/deltanet.py",
        "delta = (v - kv) * beta[..., None]",
        "delta = v - kv",
        ("tests/test_qwen3_5.py",),
        "Gated DeltaNet decode step ignores the write strength beta",
    ),
    Mutant(
        "delta-chunk-no-identity",
        "mlxlis/models/deltanet.py",
        "a = a + mx.eye(CHUNK, dtype=a.dtype)",
        "a = a + 2 * mx.eye(CHUNK, dtype=a.dtype)",
        ("tests/test_qwen3_5.py",),
        "chunked delta rule: the within-chunk system gets the wrong diagonal",
    ),
    Mutant(
        "attn-gate-skipped",
        "mlxlis/models/layers.py",
        "out = out * mx.sigmoid(gate)",
        "out = out",
        ("tests/test_qwen3_5.py",),
        "Qwen3.5 attention output gate not applied",
    ),
    Mutant(
        "partial-rope-full",
        "mlxlis/models/decoder.py",
        "dims, inter = a.rotary_dim or cfg.head_dim, a.rope_interleaved",
        "dims, inter = cfg.head_dim, a.rope_interleaved",
        ("tests/test_qwen3_5.py",),
        "partial RoPE rotates every dim",
    ),
    Mutant(
        "qwen35-heads-not-untiled",
        "mlxlis/models/conventions.py",
        "w = w.reshape(vh // kh, kh, width, *rest).swapaxes(0, 1).reshape(vh * width, *rest)",
        "w = w.reshape(vh // kh, kh, width, *rest).reshape(vh * width, *rest)",
        ("tests/test_qwen3_5_gguf.py",),
        "Qwen3.5 GGUF: llama.cpp's tiled value-head order kept",
    ),
    Mutant(
        "no-recurrent-snapshot",
        "mlxlis/cache/recurrent.py",
        "self._snapshots.append((self.offset, conv, self.recurrent))",
        "pass",
        ("tests/test_qwen3_5.py",),
        "no snapshot of recurrent states: chat prefix reuse silently lost on hybrid models",
    ),
    Mutant(
        "ring-restore-shares-snapshot",
        "mlxlis/cache/kv.py",
        "self.keys, self.values = keys[..., :size, :], values[..., :size, :]",
        "self.keys, self.values = keys, values",
        (
            "tests/test_agent_reuse.py::test_ring_snapshot_is_its_own_copy_and_restores_more_than_once",
        ),
        "a ring restored from its snapshot writes into the snapshot's own arrays: a second"
        " return there gets later keys",
    ),
    Mutant(
        "prefill-ignores-snapshot-at",
        "mlxlis/generation/core.py",
        "n = size if mark is None else min(size, mark - at)",
        "n = size",
        ("tests/test_agent_reuse.py::test_agent_session_reuses_every_cached_token_exactly",),
        "prefill chunks not ended at the requested snapshot positions: an agent's next turn"
        " finds no snapshot on rings and recurrent layers (whole prompts prefilled again)",
    ),
    Mutant(
        "gemma4-kv-source-first",
        "mlxlis/models/gemma4.py",
        "        out[i] = src[-1]",
        "        out[i] = src[0]",
        ("tests/test_gemma4.py::test_logits_match_transformers_fp32",),
        "Gemma 4: a KV-shared layer reads the first, not the last, earlier layer of its type",
    ),
    Mutant(
        "gemma4-proportional-rope-whole",
        "mlxlis/models/gemma4.py",
        "int(part * head_dim // 2), float(factor)",
        "head_dim // 2, float(factor)",
        ("tests/test_gemma4.py::test_logits_match_transformers_fp32",),
        "Gemma 4: proportional RoPE turns every pair of the full layers",
    ),
    Mutant(
        "gemma4-router-not-renormalised",
        "mlxlis/models/gemma4_net.py",
        "weights = weights / weights.sum(axis=-1, keepdims=True)",
        "weights = weights",
        ("tests/test_gemma4.py::test_logits_match_transformers_fp32",),
        "Gemma 4: the top-k router weights not renormalised",
    ),
    Mutant(
        "gemma4-gguf-rope-freqs-ignored",
        "mlxlis/models/gemma4_gguf.py",
        "return cfg.with_(family_config=replace(cfg.own(Structure), full_rotated=turned)), None",
        "return cfg.with_(family_config=replace(cfg.own(Structure), full_rotated=None)), None",
        ("tests/test_gemma4_gguf.py",),
        "Gemma 4 GGUF: rope_freqs read as config but every pair turned",
    ),
    Mutant(
        "gemma-residual-float16",
        "mlxlis/models/decoder.py",
        "h = h.astype(mx.float32)\n        return h",
        "return h",
        ("tests/test_gemma_real.py::test_float16_finite_and_close_past_float16_range",),
        "Gemma's residual stream kept in float16 (it outgrows 65 504 at the first token)",
    ),
    Mutant(
        "batch-keys-crossed",
        "mlxlis/cache/batch.py",
        "self.keys[row : row + 1, :, :n] = c._keys[..., :n, :]",
        "self.keys[len(caches) - 1 - row : len(caches) - row, :, :n] = c._keys[..., :n, :]",
        ("tests/test_serve_engine.py::test_interleaved_requests_equal_each_alone",),
        "batched decode: each query attends over another sequence's keys",
    ),
    Mutant(
        "batch-mask-crossed",
        "mlxlis/cache/batch.py",
        "mask = mx.arange(s)[None, :] < mx.array(valid)[:, None]",
        "mask = mx.arange(s)[None, :] < mx.array(valid[::-1])[:, None]",
        ("tests/test_serve_engine.py::test_interleaved_requests_equal_each_alone",),
        "batched decode: each row masked to another sequence's length",
    ),
    Mutant(
        "gemma4-batch-one-position",
        "mlxlis/models/gemma4_net.py",
        "offset = mx.array([c.offset for c in cache[0].caches])",
        "offset = cache[0].caches[0].offset",
        ("tests/test_serve_engine.py::test_interleaved_requests_equal_each_alone",),
        "Gemma 4 batched decode: every sequence turned by RoPE at the first one's position",
    ),
    Mutant(
        "core-rows-crossed",
        "mlxlis/generation/core.py",
        "s.sample(logits[i : i + 1])",
        "s.sample(logits[len(going) - 1 - i : len(going) - i])",
        ("tests/test_serve_engine.py::test_batched_rows_keep_their_own_processors_and_samplers",),
        "the core's batched step: each row's processors and sampler given another row's logits",
    ),
    Mutant(
        "rewind-one-short",
        "mlxlis/cache/rewind.py",
        "drop = held - target",
        "drop = held - target - 1",
        ("tests/test_serve_engine.py::test_prefix_cache_reuse_equals_a_fresh_run",),
        "prefix reuse: the caches rewound one position short of the shared prefix",
    ),
    Mutant(
        "overlap-stale-token",
        "mlxlis/generation/core.py",
        "mx.concatenate([s.pending for s in g]),",
        "mx.array([s.history[-1] for s in g]),",
        ("tests/test_llama_parity.py::test_greedy_generation_follows_argmax",),
        "the core's overlap: the next step fed the last token read (one step old), not the one"
        " just sampled",
    ),
    Mutant(
        "constraint-wrong-row",
        "mlxlis/generation/core.py",
        "s.sample(logits[i : i + 1])",
        "s.sample(logits[len(going) - 1 - i : len(going) - i])",
        ("tests/test_constraints.py::test_batched_constrained_and_free_rows_equal_each_alone",),
        "structured output: a row's grammar mask and sampler given another row's logits",
    ),
    Mutant(
        "constraint-mask-lags",
        "mlxlis/generation/constraints.py",
        "for token in history[self.start + self.fed :]:",
        "for token in history[self.start + self.fed : -1]:",
        ("tests/test_constraints.py::test_the_mask_is_the_engines_own_answer",),
        "structured output: the mask computed one token behind (the newest token not fed)",
    ),
    Mutant(
        "constraint-end-ignored",
        "mlxlis/generation/constraints.py",
        "eos_token=sorted(stops)",
        "eos_token=[max(stops) + 1]",
        (
            "tests/test_constraints.py::test_sampled_replies_follow_every_schema",
            "tests/test_constraints.py::test_the_mask_is_the_engines_own_answer",
        ),
        "structured output: the grammar's end handed to a token that is no stop: replies run on",
    ),
    Mutant(
        "constraint-binds-reasoning",
        "mlxlis/generation/constraints.py",
        'self.state = reasoning.state if reasoning is not None else "after"',
        'self.state = "after"',
        ("tests/test_thinking.py::test_a_constraint_starts_after_the_reasoning",),
        "structured output: a reasoning model's reasoning constrained too (no thinking first)",
    ),
    Mutant(
        "spec-kept-off-by-one",
        "mlxlis/generation/verify.py",
        "drop = width - 1 - kept  #",
        "drop = width - 2 - kept  #",
        (
            "tests/test_speculative.py::test_each_verification_keeps_exactly_the_agreeing_proposals",
            "tests/test_speculative.py::test_batched_speculation_gives_each_request_its_lone_tokens",
        ),
        "speculative decoding: the caches keep one proposal more than was accepted",
    ),
    Mutant(
        "spec-bonus-dropped",
        "mlxlis/generation/verify.py",
        """        if i == len(drafts):  # every proposal kept: the target's own next token
            nxt = s.sampler(row)
            break""",
        """        if i == len(drafts):  # every proposal kept: the target's own next token
            nxt = mx.array([drafts[-1]], mx.int32)
            break""",
        ("tests/test_speculative.py::test_a_draft_of_the_target_itself_is_always_kept",),
        "speculative decoding: after every proposal was kept, the target's bonus token is"
        " not the one that goes on",
    ),
    Mutant(
        "spec-recurrent-not-rewound",
        "mlxlis/cache/recurrent.py",
        "for p, conv, state in [*self._steps, *self._snapshots]:",
        "for p, conv, state in [(p, c, self.recurrent) for p, c, _ in self._steps]:",
        (
            "tests/test_speculative.py::test_a_rejection_at_each_position_rewinds_every_cache_exactly",
        ),
        "speculative decoding: a recurrent layer trimmed after a verification keeps the state"
        " of every verified token",
    ),
    Mutant(
        "spec-no-ratio-test",
        "mlxlis/generation/speculative.py",
        "if (u * qd < p[d]).item():",
        "if True:",
        ("tests/test_speculative.py::test_kept_or_replaced_tokens_follow_the_target_distribution",),
        "speculative sampling: proposals kept without the ratio test (the draft's distribution)",
    ),
    Mutant(
        "kv-quant-group",
        "mlxlis/models/attention.py",
        "x, *parts, transpose=keys, group_size=f.group_size, bits=f.bits",
        "x, *parts, transpose=keys, group_size=64, bits=f.bits",
        ("tests/test_kv_quant.py",),
        "quantized KV: the packed products read the scales of groups of 64 whatever the format",
    ),
    Mutant(
        "kv-quant-bias-dropped",
        "mlxlis/models/attention.py",
        "parts = [p[:, :, None] for p in kv.parts]",
        "parts = [p[:, :, None] for p in kv.parts[:2]] + [mx.zeros_like(kv.parts[2])[:, :, None]]",
        ("tests/test_kv_quant.py",),
        "quantized KV: the packed products drop the groups' biases",
    ),
    Mutant(
        "kv-quant-cpu-chunk-requantized",
        "mlxlis/cache/store.py",
        "return x if isinstance(x, QArray) else QArray.of(x, self.fmt)",
        "return QArray.of(x.dequantize() * 1.01 if isinstance(x, QArray) else x, self.fmt)",
        ("tests/test_kv_quant.py",),
        "quantized KV: positions already quantized are changed when a ring or batch moves them",
    ),
    Mutant(
        "kv-footprint-values-missed",
        "mlxlis/models/footprint.py",
        "per_token += (size - tail_bytes) // c.keys.shape[2]",
        "per_token += sum(a.nbytes for a in c.state[:1]) // c.keys.shape[2]",
        ("tests/test_kv_memory.py::test_kv_bytes_per_token_and_a_4000_token_context_as_measured",),
        "memory: a full-attention layer's bytes per token counted from its first array only",
    ),
    Mutant(
        "disk-foreign-accepted",
        "mlxlis/cache/disk.py",
        'if meta.get("fingerprint") != self.fingerprint:',
        "if False:",
        ("tests/test_prefix_disk.py::test_a_bad_entry_is_skipped_warned_and_deleted",),
        "prefix cache on disk: an entry of another model or KV format is loaded",
    ),
    Mutant(
        "disk-hash-unchecked",
        "mlxlis/cache/disk.py",
        'if not hmac.compare_digest(meta.get("mac", ""), seal(self.key, meta, arrays)):',
        "if False:",
        ("tests/test_prefix_disk.py::test_a_bad_entry_is_skipped_warned_and_deleted",),
        "prefix cache on disk: a file whose bytes changed is loaded (its seal unchecked)",
    ),
    Mutant(
        "kv-tail-dropped",
        "mlxlis/cache/kv.py",
        "        if self.tailed:\n            return self._grow_tail(*dense)\n",
        "",
        ("tests/test_kv_quant.py",),
        "quantized KV: the newest block is read quantized, not from its full-precision tail",
    ),
    Mutant(
        "kv-tail-batch-counted-twice",
        "mlxlis/cache/batch.py",
        "[mx.arange(s)[None, :] < before, mx.arange(width)[None, :] < used], axis=1",
        "[mx.arange(s)[None, :] < s, mx.arange(width)[None, :] < used], axis=1",
        ("tests/test_kv_quant.py",),
        "batched tails: a row also attends to the quantized copies of its tail's positions",
    ),
    Mutant(
        "vision-mean-ignored",
        "mlxlis/prompt/images.py",
        "return (x - mean) / std",
        "return (x - 0.5) / std",
        ("tests/test_gemma3_vision.py",),
        "image preprocessing: the processor's normalisation mean is not the one read",
    ),
    Mutant(
        "vision-pool-axes",
        "mlxlis/models/gemma3_vision.py",
        "pooled = h.reshape(b, t, k, t, k, d).mean(axis=(2, 4))",
        "pooled = h.reshape(b, k, t, k, t, d).mean(axis=(1, 3))",
        ("tests/test_gemma3_vision.py",),
        "Gemma 3's projector pools strided patches instead of each token's square of the grid",
    ),
    Mutant(
        "image-features-offset",
        "mlxlis/models/multimodal.py",
        "pieces += [h[:, at:o], f[None].astype(h.dtype)]",
        "pieces += [h[:, at : o + 1], f[None, :-1].astype(h.dtype)]",
        ("tests/test_images.py",),
        "an image's features placed one placeholder late (the first placeholder's embedding kept)",
    ),
    Mutant(
        "image-blocks-causal",
        "mlxlis/models/multimodal.py",
        "    return base | same",
        "    return base",
        ("tests/test_images.py",),
        "an image's positions attend causally only (transformers' token_type_ids blocks dropped)",
    ),
    Mutant(
        "image-chunk-splits",
        "mlxlis/generation/core.py",
        "                n = s.start - at if s.start > at else s.end - at",
        "                pass",
        ("tests/test_images.py",),
        "a prefill chunk ends inside an image's run (its halves fed as separate images)",
    ),
    Mutant(
        "image-cache-key-ids",
        "mlxlis/generation/core.py",
        "        keyed = cache_ids(req.prompt, req.images)",
        "        keyed = list(req.prompt)",
        ("tests/test_images.py",),
        "prefix entries keyed by token ids alone: another image's caches reused",
    ),
    Mutant(
        "gemma4-vision-rope-axes",
        "mlxlis/models/gemma4_vision.py",
        "_rotate(x[..., k * half : (k + 1) * half], cos[:, None, k], sin[:, None, k])",
        "_rotate(x[..., k * half : (k + 1) * half], cos[:, None, 1 - k], sin[:, None, 1 - k])",
        ("tests/test_gemma4_vision.py",),
        "Gemma 4's vision RoPE turns each head's first half by y and its second by x",
    ),
    Mutant(
        "gemma4-vision-pool-transposed",
        "mlxlis/models/gemma4_vision.py",
        "cell = (pos[:, 0] // k) + (cols // k) * (pos[:, 1] // k)",
        "cell = (pos[:, 1] // k) + (cols // k) * (pos[:, 0] // k)",
        ("tests/test_gemma4_vision.py",),
        "Gemma 4's pooled soft tokens in column-major order",
    ),
    Mutant(
        "gemma4-placeholder-id",
        "mlxlis/models/gemma4_vision.py",
        "        self.fill_id = fill_id  # the text model's pad id",
        "        self.fill_id = image_token_id  # the text model's pad id",
        ("tests/test_gemma4_vision.py",),
        "Gemma 4's per-layer embeddings read the image token at its placeholders, not the pad",
    ),
    Mutant(
        "gemma4-image-blocks-ignored",
        "mlxlis/models/gemma4_net.py",
        "                masks[True] = with_blocks("
        "masks[True], blocks, cfg.attention.sliding_window)",
        "                pass",
        ("tests/test_gemma4_vision.py",),
        "Gemma 4 (use_bidirectional_attention vision): an image's positions attend causally",
    ),
    Mutant(
        "qwen-vision-positions-transposed",
        "mlxlis/models/qwen3_5_vision.py",
        "ang = mx.array(np.concatenate([fr, fc, fr, fc], -1))[None]",
        "ang = mx.array(np.concatenate([fc, fr, fc, fr], -1))[None]",
        ("tests/test_qwen3_5_vision.py",),
        "Qwen3.5's vision RoPE: the 2-D positions transposed (rows read as columns)",
    ),
    Mutant(
        "qwen-mrope-streams-swapped",
        "mlxlis/models/qwen3_5_vision.py",
        "        stream[1 : 3 * mrope_section[1] : 3] = 1",
        "        stream[1 : 3 * mrope_section[1] : 3] = 2",
        ("tests/test_qwen3_5_vision.py",),
        "Qwen3.5's M-RoPE: the rows' pairs read the column stream",
    ),
    Mutant(
        "qwen-mrope-shift-dropped",
        "mlxlis/models/qwen3_5_vision.py",
        "                out += max(lh, lw) - lh * lw",
        "                out += 0",
        ("tests/test_qwen3_5_vision.py",),
        "Qwen3.5: text after an image at its index, not where the image's M-RoPE positions end",
    ),
    Mutant(
        "qwen-reused-shift-lost",
        "mlxlis/generation/core.py",
        "        seq.set_shift(self.model)\n",
        "\n",
        ("tests/test_qwen3_5_vision.py",),
        "caches reused past a Qwen3.5 image keep no RoPE shift",
    ),
    Mutant(
        "mmproj-gemma3-norm-shift",
        "mlxlis/models/gemma3_mmproj.py",
        "        - 1.0,\n",
        "        - 0.0,\n",
        ("tests/test_mmproj.py",),
        "a Gemma 3 mmproj's soft_emb_norm read as stored (the converter's + 1 kept)",
    ),
    Mutant(
        "mmproj-gemma4-patch-layout",
        "mlxlis/models/gemma4_mmproj.py",
        "w.transpose(0, 2, 3, 1).reshape(d, -1)",
        "w.reshape(d, -1)",
        ("tests/test_mmproj.py",),
        "a Gemma 4 mmproj's conv-shaped patch embedding read channel-first, not (y, x, channel)",
    ),
    Mutant(
        "mmproj-qwen-one-frame",
        "mlxlis/models/qwen3_5_mmproj.py",
        "np.stack(frames, axis=2)",
        "np.stack([frames[0], frames[0]], axis=2)",
        ("tests/test_mmproj.py",),
        "a Qwen3.5 mmproj's second patch-embedding frame (.weight.1) not read",
    ),
    Mutant(
        "pan-and-scan-edge",
        "mlxlis/prompt/images.py",
        "rgb.crop((x, y, min(x + cw, w), min(y + ch, h)))",
        "rgb.crop((x, y, x + cw, y + ch))",
        ("tests/test_images.py",),
        "pan and scan's last crop padded past the image's edge instead of cut at it",
    ),
    Mutant(
        "disk-shape-unchecked",
        "mlxlis/cache/kv.py",
        "            check_pair(self.keys, self.values, self.offset)\n",
        "",
        ("tests/test_prefix_disk.py::test_a_bad_entry_is_skipped_warned_and_deleted",),
        "prefix cache on disk: keys holding fewer positions than the entry says are loaded",
    ),
    Mutant(
        "kv-request-format-ignored",
        "mlxlis/generation/core.py",
        "        kv = resolve(req.kv_format, self.model.kv_format)\n",
        "        kv = self.model.kv_format\n",
        ("tests/test_kv_quant.py::test_requests_of_several_kv_formats_decode_together",),
        "a request's own KV format (kv_bits) is ignored: its caches take the model's",
    ),
    Mutant(
        "kv-plan-format-ignored",
        "mlxlis/generation/engine.py",
        "total += len(rs) * self.of(kv).reserve(min(longest, self.context))",
        "total += len(rs) * self.footprint.reserve(min(longest, self.context))",
        ("tests/test_kv_memory.py::test_requests_that_would_outgrow_the_memory_are_refused_first",),
        "the memory plan counts every request at the model's KV format, whatever it asked for",
    ),
    Mutant(
        "spec-draft-unmasked",
        "mlxlis/generation/speculative.py",
        "processors = forked(self.processors)  # state of their own for the drafted tokens",
        "processors = []",
        ("tests/test_speculative.py::test_a_constrained_draft_proposes_under_the_grammar",),
        "speculative decoding: a draft model proposes without the request's grammar mask",
    ),
    Mutant(
        "spec-ring-spill-dropped",
        "mlxlis/cache/kv.py",
        "if n > size - self.window + 1 and self._spilled():",
        "if False:",
        (
            "tests/test_speculative.py::test_a_rejection_at_each_position_rewinds_every_cache_exactly",
        ),
        "speculative decoding: a ring trimmed after a verification forgets the positions the"
        " verification pushed out",
    ),
    Mutant(
        "spec-assistant-centroids-off-by-one",
        "mlxlis/models/gemma4_assistant.py",
        "kth=self.top_k - 1, axis=-1)[..., : self.top_k]",
        "kth=self.top_k - 1, axis=-1)[..., : self.top_k - 1]",
        ("tests/test_speculative_gemma4.py::test_a_drafting_step_matches_transformers_fp32",),
        "Gemma 4 assistant: the ordered-embedding head scores one cluster fewer than the"
        " reference's centroid_intermediate_top_k",
    ),
    Mutant(
        "spec-mtp-concat-swapped",
        "mlxlis/models/qwen3_5_mtp.py",
        "u = self.fc(mx.concatenate([e, h], axis=-1))",
        "u = self.fc(mx.concatenate([h, e], axis=-1))",
        ("tests/test_speculative_mtp.py::test_drafting_steps_match_the_reference",),
        "Qwen3.5 MTP: fc over concat(hidden, embedding) instead of concat(embedding, hidden)",
    ),
    Mutant(
        "spec-mtp-prenorm-hidden",
        "mlxlis/models/qwen3_5_mtp.py",
        "return self.net.model.norm(hidden)",
        "return hidden",
        ("tests/test_speculative_mtp.py::test_drafting_steps_match_the_reference",),
        "Qwen3.5 MTP: the block reads the target's state before its final norm",
    ),
    Mutant(
        "spec-mtp-chain-kept",
        "mlxlis/generation/mtp.py",
        "c.trim(k - 1)",
        "c.trim(k - 2)",
        (
            "tests/test_speculative_mtp.py::"
            "test_the_block_cache_holds_each_position_once_after_kept_and_rejected_drafts",
        ),
        "Qwen3.5 MTP: a chained draft's entry stays in the block's cache",
    ),
    Mutant(
        "llama4-chunk-mask-off",
        "mlxlis/cache/kv.py",
        "keep = keep & (k // chunk == q // chunk)",
        "keep = keep",
        (LLAMA4_HF,),
        "Llama 4: chunked layers see every earlier key (no chunk boundary)",
    ),
    Mutant(
        "llama4-chunk-ring-sees-old",
        "mlxlis/cache/kv.py",
        "        return age <= since",
        "        return age <= since + 1",
        (LLAMA4_CACHE,),
        "Llama 4: a decoding query also sees the last key of the chunk before",
    ),
    Mutant(
        "llama4-temperature-floor",
        "mlxlis/models/llama4.py",
        '        temperature=(size["floor_scale"], float(scale)) if tuning else None,',
        '        temperature=(size["floor_scale"], float(scale)) if tuning else None,'
        "\n        temperature_offset=0,",
        (LLAMA4_HF,),
        "Llama 4: NoPE temperature from ⌊p / floor⌋ instead of ⌊(p + 1) / floor⌋",
    ),
    Mutant(
        "llama4-after-rope-skipped",
        "mlxlis/models/layers.py",
        "        q, k = self.after_rope(q, k, offset)",
        "        q, k = q, k",
        (LLAMA4_HF,),
        "Llama 4: the L2 q/k norm and the temperature skipped on a lone sequence",
    ),
    Mutant(
        "llama4-after-rope-batch-skipped",
        "mlxlis/models/layers.py",
        "        q, k = self.after_rope(q, k, offsets[:, None, None])",
        "        q, k = q, k",
        (LLAMA4_CACHE,),
        "Llama 4: the L2 q/k norm and the temperature skipped in the batched step",
    ),
    Mutant(
        "llama4-l2-norm-skipped",
        "mlxlis/models/llama4.py",
        "        if self._l2_eps is not None:\n            q = fused.rms_norm(",
        "        if False:\n            q = fused.rms_norm(",
        (LLAMA4_HF,),
        "Llama 4: q and k not L2-normed after RoPE on the RoPE layers",
    ),
    Mutant(
        "llama4-temperature-every-layer",
        "mlxlis/models/llama4.py",
        "        if rope is not None:\n            self._temperature = None",
        "        if False:\n            self._temperature = None",
        (LLAMA4_HF,),
        "Llama 4: the temperature on the RoPE layers' queries too, not the NoPE layers' only",
    ),
    Mutant(
        "llama4-router-scales-output",
        "mlxlis/models/llama4.py",
        "y = self.experts(x[..., None, :] * scores[..., None], mx.stop_gradient(inds))",
        "y = self.experts(x, mx.stop_gradient(inds)) * scores[..., None]",
        (LLAMA4_HF,),
        "Llama 4: the router's score scales the experts' output instead of their input",
    ),
    Mutant(
        "llama4-rope-halves",
        "mlxlis/models/llama4.py",
        "        rope_interleaved=True,\n        qk_l2_norm=flag(",
        "        rope_interleaved=False,\n        qk_l2_norm=flag(",
        (LLAMA4_HF,),
        "Llama 4: RoPE on rotate-half pairs instead of adjacent ones",
    ),
    Mutant(
        "llama4-gguf-nope-shifted",
        "mlxlis/models/llama4.py",
        "nope = tuple((i + 1) % GGUF_NOPE_EVERY == 0 for i in range(n))",
        "nope = tuple(i % GGUF_NOPE_EVERY == 0 for i in range(n))",
        ("tests/test_llama4.py::test_gguf_matches_transformers_on_the_files_weights",),
        "Llama 4 GGUF: the NoPE layers one earlier than llama.cpp's",
    ),
    Mutant(
        "oss-sinks-dropped",
        "mlxlis/models/gpt_oss.py",
        "mask, self.softcap, self.sinks, heads_last=True)",
        "mask, self.softcap, None, heads_last=True)",
        (OSS_HF,),
        "gpt-oss: the attention sinks left out of the softmax",
    ),
    Mutant(
        "oss-sinks-batch-dropped",
        "mlxlis/models/layers.py",
        "        return self.attend_heads(q, keys, values, mask)",
        "        return Attention.attend_heads(self, q, keys, values, mask)",
        (OSS_CACHE,),
        "gpt-oss: the attention sinks left out of the batched step (the common softmax there)",
    ),
    Mutant(
        "oss-sinks-kept-in-probs",
        "mlxlis/models/attention.py",
        "        probs = probs[..., :-1]",
        "        probs = probs[..., 1:]",
        (OSS_HF,),
        "gpt-oss: the sink's column dropped from the wrong end of the probabilities",
    ),
    Mutant(
        "oss-yarn-ramp-reversed",
        "mlxlis/models/rope.py",
        "    return (1.0 / (rope.factor * pos)) * ramp + (1.0 / pos) * extrapolated",
        "    return (1.0 / (rope.factor * pos)) * extrapolated + (1.0 / pos) * ramp",
        (OSS_HF,),
        "YaRN: the fast pairs interpolated and the slow ones kept",
    ),
    Mutant(
        "oss-yarn-truncate-ignored",
        "mlxlis/models/rope.py",
        "    if rope.truncate:\n",
        "    if True:\n",
        (OSS_HF,),
        "YaRN: the ramp's ends rounded although the config says truncate false",
    ),
    Mutant(
        "oss-yarn-mscale-dropped",
        "mlxlis/models/rope.py",
        "        if self.mscale == 1.0:\n            return x",
        "        if True:\n            return x",
        (OSS_HF,),
        "YaRN: q and k not scaled by the attention factor",
    ),
    Mutant(
        "oss-swiglu-up-plus-one",
        "mlxlis/models/activations.py",
        "        return gate * mx.sigmoid(gate * alpha) * (up + 1)",
        "        return gate * mx.sigmoid(gate * alpha) * up",
        (OSS_HF,),
        "gpt-oss: the clamped SwiGLU without its (up + 1)",
    ),
    Mutant(
        "oss-swiglu-unclamped",
        "mlxlis/models/activations.py",
        "        up = mx.clip(up, -limit, limit)",
        "        up = up",
        (OSS_HF,),
        "gpt-oss: the up projection not clamped",
    ),
    Mutant(
        "oss-router-softmax-all",
        "mlxlis/models/gpt_oss.py",
        "        top = mx.take_along_axis(logits, inds, axis=-1)",
        "        top = mx.take_along_axis(mx.log_softmax(logits, axis=-1), inds, axis=-1) * 2",
        (OSS_HF,),
        "gpt-oss: the expert weights from another softmax than over the top k's logits",
    ),
    Mutant(
        "oss-expert-bias-dropped",
        "mlxlis/models/experts.py",
        '    if "bias" not in module:\n        return y',
        "    if True:\n        return y",
        (OSS_HF,),
        "gpt-oss: the experts' biases left out",
    ),
    Mutant(
        "oss-halves-not-strided",
        "mlxlis/loading/plan.py",
        "cut = slice(b.half, None, 2) if b.strided else",
        "cut = slice(b.half * n, (b.half + 1) * n) if b.strided else",
        (OSS_HF,),
        "gpt-oss: OpenAI's interleaved gate/up split as contiguous halves",
    ),
    Mutant(
        "oss-gguf-mxfp4-nibbles",
        "mlxlis/loading/quants.py",
        "    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # (n, 32) in element order",
        "    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 32)",
        ("tests/test_quants.py::test_mxfp4_blocks_are_mlx_mxfp4_bit_exact", OSS_GGUF),
        "GGUF MXFP4: ggml's code order taken as MLX's",
    ),
    Mutant(
        "oss-gguf-window-layers-swapped",
        "mlxlis/models/gpt_oss.py",
        "layer_types=tuple(LAYER_TYPES[i % 2] for i in range(n)),",
        "layer_types=tuple(LAYER_TYPES[1 - i % 2] for i in range(n)),",
        (OSS_GGUF,),
        "gpt-oss GGUF: the sliding layers on odd indices instead of even ones",
    ),
    Mutant(
        "m3-window-ignored",
        "mlxlis/models/mistral3.py",
        "    return cfg.with_(attention=attention, layer_types=(SLIDING,) * n if window else ())",
        "    return cfg.with_(attention=attention, layer_types=())",
        (M3_HF,),
        "Mistral: the sliding window left out",
    ),
    Mutant(
        "m3-temperature-offset",
        "mlxlis/models/mistral3.py",
        "cfg.attention, temperature=temperature, temperature_offset=0,",
        "cfg.attention, temperature=temperature, temperature_offset=1,",
        (M3_HF,),
        "Ministral 3: the temperature from ⌊(p + 1) / floor⌋ instead of ⌊p / floor⌋",
    ),
    Mutant(
        "m3-temperature-nope-only",
        "mlxlis/models/mistral3.py",
        "    attention = TemperedAttention",
        "    attention = DecoderLayer.attention",
        (M3_HF,),
        "Ministral 3: the temperature on NoPE layers only (none: the common attention)",
    ),
    Mutant(
        "tempered-log-dropped",
        "mlxlis/models/layers.py",
        "t = mx.log1p(mx.floor((p + self._temperature_offset) / floor)) * scale + 1.0",
        "t = mx.floor((p + self._temperature_offset) / floor) * scale + 1.0",
        (M3_HF,),
        "the position temperature linear in ⌊(p + offset) / floor⌋, not logarithmic",
    ),
    Mutant(
        "m3-yarn-mscale-all-dim-ignored",
        "mlxlis/models/config.py",
        "            attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all)",
        "            attn = yarn_mscale(factor)",
        (M3_HF,),
        "YaRN: mscale / mscale_all_dim ignored",
    ),
    Mutant(
        "m3-gguf-log-mul-ignored",
        "mlxlis/models/gguf_config.py",
        "        attn = yarn_mscale(factor) / yarn_mscale(factor, log_mul)",
        "        attn = yarn_mscale(factor)",
        (M3_GGUF,),
        "GGUF YaRN: yarn_log_multiplier ignored",
    ),
    Mutant(
        "m3-gguf-unpermuted",
        "mlxlis/models/mistral3.py",
        "        conventions=(UNPERMUTE_Q, UNPERMUTE_K),  # Ministral3Model is a LlamaModel",
        "        conventions=(),",
        (M3_GGUF,),
        "Ministral 3 GGUF: Q/K left in llama.cpp's permuted order",
    ),
    Mutant(
        "tekken-merges-unsorted",
        "mlxlis/tokenizer/tekken.py",
        "    merges.sort(key=lambda m: m[0])",
        "    merges.sort(key=lambda m: -m[0])",
        ("tests/test_tekken.py::test_ids_match_tiktoken_on_the_same_ranks",),
        "tekken.json: merges out of rank order",
    ),
    Mutant(
        "harmony-analysis-as-answer",
        "mlxlis/prompt/harmony.py",
        '        elif channel is not None and channel.group(1) == "analysis":',
        '        elif channel is not None and channel.group(1) == "final":',
        ("tests/test_harmony.py::test_thinking_and_answer_split_back",),
        "harmony: the analysis channel shown as the answer",
    ),
    Mutant(
        "llama4-batch-chunk-ignored",
        "mlxlis/cache/batch.py",
        "        if any(x is not None for x in seen):",
        "        if False:",
        (LLAMA4_CACHE,),
        "Llama 4: batched decoding ignores the chunk boundary of each row",
    ),
    Mutant(
        "g3n-predict-transposed",
        "mlxlis/models/gemma3n_net.py",
        "        return (h + coefs.astype(h.dtype) @ h).astype(h.dtype)",
        "        return (h + coefs.astype(h.dtype).swapaxes(-1, -2) @ h).astype(h.dtype)",
        (G3N_HF,),
        "Gemma 3n: AltUp's prediction coefficients read transposed",
    ),
    Mutant(
        "g3n-correct-no-plus-one",
        "mlxlis/models/gemma3n_net.py",
        "        coefs = self.correction_coefs(self.modalities(activated)) + 1.0",
        "        coefs = self.correction_coefs(self.modalities(activated))",
        (G3N_HF,),
        "Gemma 3n: AltUp's correction without the + 1",
    ),
    Mutant(
        "g3n-router-scale",
        "mlxlis/models/gemma3n_net.py",
        "        self.inv_hidden = 1.0 / d",
        "        self.inv_hidden = d**-0.5",
        (G3N_HF,),
        "Gemma 3n: the router's input scaled by 1/√hidden instead of 1/hidden",
    ),
    Mutant(
        "g3n-laurel-unscaled",
        "mlxlis/models/gemma3n_net.py",
        "        x = (active + self.post_attention_layernorm(a) + laurel) * 2**-0.5",
        "        x = active + self.post_attention_layernorm(a) + laurel",
        (G3N_HF,),
        "Gemma 3n: attention + LAuReL not divided by √2",
    ),
    Mutant(
        "g3n-sparsity-ignored",
        "mlxlis/models/gemma3n_net.py",
        "        if self.std is not None:",
        "        if False:",
        (G3N_HF,),
        "Gemma 3n: the MLP gate's Gaussian top-k left out",
    ),
    Mutant(
        "g3n-sparsity-sample-std",
        "mlxlis/models/gemma3n_net.py",
        "            cutoff = mean + mx.std(g32, axis=-1, keepdims=True) * self.std",
        "            cutoff = mean + mx.std(g32, axis=-1, keepdims=True, ddof=1) * self.std",
        (G3N_HF,),
        "Gemma 3n: the gate's cutoff from the sample (n − 1) standard deviation",
    ),
    Mutant(
        "g3n-per-layer-to-all-streams",
        "mlxlis/models/gemma3n_net.py",
        "        rest = corrected[..., 1:, :] + g[..., None, :]",
        "        rest = corrected[..., 1:, :]",
        (G3N_HF,),
        "Gemma 3n: the per-layer input's projection not added to the streams",
    ),
    Mutant(
        "g3n-correct-scale-ignored",
        "mlxlis/models/gemma3n_net.py",
        "        if self.correct_scale:",
        "        if False:",
        (G3N_HF,),
        "Gemma 3n: correct_output_scale not applied",
    ),
    Mutant(
        "g3n-expand-unscaled",
        "mlxlis/models/gemma3n_net.py",
        "        extra = [rescaled(p(h), target) for p in self.model.altup_projections]",
        "        extra = [p(h) for p in self.model.altup_projections]",
        (G3N_HF,),
        "Gemma 3n: the projected streams not rescaled to the embedding's RMS",
    ),
    Mutant(
        "g3n-merge-first-only",
        "mlxlis/models/gemma3n_net.py",
        "        return super().head(mx.mean(mx.stack([first, *rest], axis=-2), axis=-2))",
        "        return super().head(first)",
        (G3N_HF,),
        "Gemma 3n: the head reads stream 0 only",
    ),
    Mutant(
        "g3n-icdf-off",
        "mlxlis/models/gemma3n.py",
        "    return float(erfinv * np.float32(math.sqrt(2)))",
        "    return float(erfinv)",
        (G3N_HF,),
        "Gemma 3n: Φ⁻¹ without the √2",
    ),
    Mutant(
        "g3n-gguf-stack-order",
        "mlxlis/models/from_gguf.py",
        '                weights.update({f"{m}.{part}": new[k] for k, m in enumerate(modules)})',
        '                weights.update({f"{m}.{part}": new[-1 - k] for k, m in '
        "enumerate(modules)})",
        (G3N_GGUF,),
        "GGUF: a stacked tensor's modules in reverse order",
    ),
    Mutant(
        "g3n-gguf-dense-as-sparse",
        "mlxlis/models/gemma3n.py",
        "    stds = tuple(None if s == -math.inf else float(np.float32(s)) "
        "for s in scales.tolist())",
        "    stds = tuple(0.0 if s == -math.inf else float(np.float32(s)) "
        "for s in scales.tolist())",
        (G3N_GGUF,),
        "Gemma 3n GGUF: a dense layer (Φ⁻¹ = −∞) cut at its mean",
    ),
    Mutant(
        "g3n-shared-kv-own",
        "mlxlis/models/gemma3n.py",
        '        kv_source=kv_sources(types, shared, path, "num_kv_shared_layers"),',
        '        kv_source=kv_sources(types, 0, path, "num_kv_shared_layers"),',
        (G3N_HF,),
        "Gemma 3n: KV-shared layers computing K/V of their own",
    ),
    Mutant(
        "q3n-qkvz-v-z-swapped",
        "mlxlis/models/deltanet.py",
        "            q, k, v, z = mx.split(m, [dk, 2 * dk, 2 * dk + rv], axis=-1)",
        "            q, k, z, v = mx.split(m, [dk, 2 * dk, 2 * dk + rv], axis=-1)",
        (Q3N_HF,),
        "Qwen3-Next: in_proj_qkvz's v and z read in each other's place",
    ),
    Mutant(
        "q3n-ba-swapped",
        "mlxlis/models/deltanet.py",
        "            beta, a = ba[..., :r].reshape(b, t, -1), ba[..., r:].reshape(b, t, -1)",
        "            a, beta = ba[..., :r].reshape(b, t, -1), ba[..., r:].reshape(b, t, -1)",
        (Q3N_HF,),
        "Qwen3-Next: in_proj_ba's β and α swapped",
    ),
    Mutant(
        "q3n-topk-always-renormalised",
        "mlxlis/models/qwen3_next.py",
        "moe=replace(out.moe, sparse_layers=sparse, norm_topk_prob=top),",
        "moe=replace(out.moe, sparse_layers=sparse, norm_topk_prob=True),",
        (Q3N_HF,),
        "Qwen3-Next: norm_topk_prob false ignored",
    ),
    Mutant(
        "q3n-gguf-retiled",
        "mlxlis/models/conventions.py",
        "QWEN3NEXT_GGUF: tuple[Convention, ...] = (_CONV_UNSQUEEZED, _A_LOG, "
        "ZERO_CENTRED_NORM_MINUS_ONE)",
        "QWEN3NEXT_GGUF = QWEN35_GGUF",
        (Q3N_GGUF,),
        "Qwen3-Next GGUF: value heads untiled as for Qwen3.5 (llama.cpp keeps them grouped)",
    ),
    Mutant(
        "q3n-export-norms-unshifted",
        "mlxlis/models/qwen3_next.py",
        "        return (w.astype(mx.float32) + 1.0).astype(w.dtype)",
        "        return w",
        ("tests/test_qwen3_next.py::test_convert_round_trip_and_mlx_lm",),
        "Qwen3-Next convert: norms written without mlx-lm's + 1",
    ),
    Mutant(
        "smollm3-nope-shifted",
        "mlxlis/models/smollm3.py",
        "        return [int((i + 1) % every != 0) for i in range(n)]",
        "        return [int(i % every != 0) for i in range(n)]",
        ("tests/test_smollm3.py::test_derived_layers_as_transformers_derives_them",),
        "SmolLM3: the NoPE layers one early",
    ),
    Mutant(
        "smollm3-window-everywhere",
        "mlxlis/models/smollm3.py",
        "        types = [LAYER_TYPES[on and not r] for r in rope_on]",
        "        types = [LAYER_TYPES[on] for r in rope_on]",
        ("tests/test_smollm3.py::test_derived_layers_as_transformers_derives_them",),
        "SmolLM3: the sliding window on every layer, not the NoPE ones only",
    ),
    Mutant(
        "smollm3-gguf-all-rope",
        "mlxlis/models/smollm3.py",
        "    return base.with_(attention=replace(base.attention, no_rope_layers=nope))",
        "    return base",
        ("tests/test_smollm3.py::test_gguf_matches_transformers_on_the_files_weights",),
        "SmolLM3 GGUF: RoPE on every layer (llama.cpp's fixed NoPE step ignored)",
    ),
    Mutant(
        "olmo3-norm-before-attn",
        "mlxlis/models/layers.py",
        "        h = h + self.post_attention_layernorm(self.self_attn(h, mask, cache, positions))",
        "        h = h + self.self_attn(self.post_attention_layernorm(h), mask, cache, positions)",
        (OLMO3_HF,),
        "OLMo 3: the post-attention norm moved before attention (pre-norm)",
    ),
    Mutant(
        "olmo3-q-norm-per-head",
        "mlxlis/models/layers.py",
        "self.heads(self.q_norm(self.q_proj(x)), ",
        "self.heads(mx.fast.rms_norm(self.q_proj(x).reshape(*x.shape[:2], self.n_heads, -1), "
        "None, 1e-5).reshape(*x.shape[:2], -1) * self.q_norm.weight, ",
        (OLMO3_HF,),
        "OLMo 3: q RMSNormed per head over head_dim, not over the whole projection",
    ),
    Mutant(
        "olmo3-window-off-by-one",
        "mlxlis/models/olmo3.py",
        '("sliding_window", window)}, path)["sliding_window"]',
        '("sliding_window", window)}, path)["sliding_window"] + 1',
        (OLMO3_HF,),
        "OLMo 3: the sliding window one key wider",
    ),
    Mutant(
        "olmo3-local-rope-is-full",
        "mlxlis/models/olmo3.py",
        "rope_local=local if types else None)",
        "rope_local=None)",
        (OLMO3_LOCAL,),
        "OLMo 3: the sliding layers turned by the full layers' RoPE (YaRN, their θ)",
    ),
    Mutant(
        "olmo3-gguf-pattern-flipped",
        "mlxlis/models/olmo3.py",
        "        types = [SLIDING if x else FULL for x in pattern.tolist()]",
        "        types = [FULL if x else SLIDING for x in pattern.tolist()]",
        (OLMO3_GGUF,),
        "OLMo 3 GGUF: sliding_window_pattern read inverted",
    ),
    Mutant(
        "olmo3-gguf-swa-theta",
        "mlxlis/models/olmo3.py",
        'RopeConfig(theta=m.get("rope.freq_base_swa", base.rope.theta, float))',
        "RopeConfig(theta=base.rope.theta)",
        (OLMO3_GGUF,),
        "OLMo 3 GGUF: rope.freq_base_swa ignored (the sliding layers on the full θ)",
    ),
    Mutant(
        "lfm2-conv-state-one-short",
        "mlxlis/models/shortconv.py",
        "        cache.conv_state = xp[:, -n:]",
        "        cache.conv_state = xp[:, -n - 1 : -1]",
        (LFM2_CACHE,),
        "LFM2: the conv state kept one token behind (the newest gated input left out)",
    ),
    Mutant(
        "lfm2-b-gate-dropped",
        "mlxlis/models/shortconv.py",
        "xp = self._with_state(b_gate * h, cache)",
        "xp = self._with_state(h, cache)",
        (LFM2_HF,),
        "LFM2: the convolution's input not gated by B",
    ),
    Mutant(
        "lfm2-conv-state-not-rewound",
        "mlxlis/models/shortconv.py",
        "mx.contiguous(xp[:, i + 1 : i + 1 + n])",
        "mx.contiguous(xp[:, -n:])",
        (LFM2_REWIND,),
        "LFM2: a verification's kept conv states all the newest (a trim leaves it unrewound)",
    ),
    Mutant(
        "lfm2-batch-rows-share-state",
        "mlxlis/models/shortconv.py",
        "            c.conv_state = both.conv_state[i : i + 1]",
        "            c.conv_state = both.conv_state[:1]",
        (LFM2_ENGINE,),
        "LFM2: a batched decode step hands every row the first row's conv state",
    ),
    Mutant(
        "lfm2-qk-norm-dropped",
        "mlxlis/models/lfm2.py",
        "        return self.q_layernorm(q), self.k_layernorm(k)",
        "        return q, self.k_layernorm(k)",
        (LFM2_HF,),
        "LFM2: the per-head q norm left out",
    ),
    Mutant(
        "lfm2-gguf-kernel-reversed",
        "mlxlis/models/lfm2.py",
        "    lambda w, c, _: w.reshape(w.shape[0], 1, -1),",
        "    lambda w, c, _: w.reshape(w.shape[0], 1, -1)[..., ::-1],",
        (LFM2_GGUF,),
        "LFM2 GGUF: the squeezed conv kernel's taps read in reverse",
    ),
    Mutant(
        "phi3-qkv-k-v-swapped",
        "mlxlis/models/phi3.py",
        "        q, k, v = mx.split(self.qkv_proj(x), self._split, axis=-1)",
        "        q, v, k = mx.split(self.qkv_proj(x), self._split, axis=-1)",
        ("tests/test_phi3.py::test_logits_match_transformers_fp32",),
        "Phi-3: qkv_proj's key and value rows swapped",
    ),
    Mutant(
        "phi3-gate-up-swapped",
        "mlxlis/models/layers.py",
        "            return self.down_proj(self.act(*mx.split(self.gate_up_proj(x), 2, axis=-1)))",
        "            return self.down_proj(self.act(*mx.split(self.gate_up_proj(x), 2, axis=-1)"
        "[::-1]))",
        ("tests/test_phi3.py::test_logits_match_transformers_fp32",),
        "Phi-3: gate_up_proj's halves swapped",
    ),
    Mutant(
        "phi3-longrope-always-long",
        "mlxlis/models/rope.py",
        "            long = offset + t > self._within",
        "            long = True",
        ("tests/test_phi3.py::test_logits_match_transformers_fp32",),
        "LongRoPE: the long factors within the original context too (mlx-lm's choice)",
    ),
    Mutant(
        "phi3-longrope-no-attention-factor",
        "mlxlis/models/rope.py",
        '        self.mscale = rope.attention_factor if rope.type in ("yarn", "longrope") else 1.0',
        '        self.mscale = rope.attention_factor if rope.type == "yarn" else 1.0',
        ("tests/test_phi3.py::test_logits_match_transformers_fp32",),
        "LongRoPE: q and k not scaled by the attention factor",
    ),
    Mutant(
        "phi3-gguf-factors-swapped",
        "mlxlis/models/phi3.py",
        'ROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")',
        'ROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")',
        ("tests/test_phi3.py::test_gguf_matches_transformers_on_the_files_weights",),
        "Phi-3 GGUF: the short and long factor tensors read in each other's place",
    ),
    Mutant(
        "q4x-mix-summed",
        NET4,
        "        mixed = (w.reshape(b, t, self.n, self.d) * hn.reshape(b, t, self.n, self.d))"
        ".mean(axis=-2)",
        "        mixed = (w.reshape(b, t, self.n, self.d) * hn.reshape(b, t, self.n, self.d))"
        ".sum(axis=-2)",
        (Q4X_HF,),
        "Qwen4-Exp: the streams' mix summed instead of averaged",
    ),
    Mutant(
        "q4x-injection-halved",
        NET4,
        "        return mixed, 2 * mx.sigmoid(self.block_inject_weight(hn) / self.n)",
        "        return mixed, mx.sigmoid(self.block_inject_weight(hn) / self.n)",
        (Q4X_HF,),
        "Qwen4-Exp: injection weights without their factor 2",
    ),
    Mutant(
        "q4x-ngram-past-eos",
        PARTS4,
        "            shifted.append(mx.where(since >= k, back, eos))",
        "            shifted.append(back)",
        (Q4X_HF,),
        "Qwen4-Exp: n-gram contexts reaching past an EOS",
    ),
    Mutant(
        "q4x-ple-undilated",
        PARTS4,
        "        self.kernel, self.dilation = s.ple_conv_kernel_size, s.ngram_size",
        "        self.kernel, self.dilation = s.ple_conv_kernel_size, 1",
        (Q4X_HF,),
        "Qwen4-Exp: PLE's convolution without its dilation",
    ),
    Mutant(
        "q4x-ple-gate-unsigned-root",
        PARTS4,
        "        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)",
        "        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6))",
        (Q4X_HF,),
        "Qwen4-Exp: PLE's gate loses its sign",
    ),
    Mutant(
        "q4x-qsa-no-own-block",
        NET4,
        "        return (in_block | own)[:, None]  # (B, 1, T, S)",
        "        return (in_block | (key_pos == p))[:, None]  # (B, 1, T, S)",
        (Q4X_HF,),
        "Qwen4-Exp: QSA drops the query's unfinished block (but itself)",
    ),
    Mutant(
        "q4x-qsa-block-rope-at-end",
        NET4,
        "        starts = mx.broadcast_to((mx.arange(nb) * self.ratio)[:, None], "
        "(nb, self.rope.dims // 2))",
        "        starts = mx.broadcast_to((mx.arange(nb) * self.ratio + self.ratio - 1)[:, None], "
        "(nb, self.rope.dims // 2))",
        (Q4X_HF,),
        "Qwen4-Exp: block keys turned to their last position, not their first",
    ),
    Mutant(
        "q4x-gate-always-silu",
        "mlxlis/models/qwen4_exp.py",
        "        deltanet=replace(out.deltanet, gate_act=gate),",
        '        deltanet=replace(out.deltanet, gate_act="silu"),',
        (Q4X_HF,),
        "Qwen4-Exp: output_gate_type sigmoid ignored",
    ),
    Mutant(
        "q4x-joint-trims-one-part",
        "mlxlis/cache/joint.py",
        "        if not all(p.trim(n) == n for p in self.parts):  # a part broke its rewind_point",
        "        if not self.parts[0].trim(n) == n:  # a part broke its rewind_point",
        (Q4X_CACHE,),
        "Qwen4-Exp: a joint cache trims its first part only",
    ),
    Mutant(
        "q4x-ple-verify-states-off",
        PARTS4,
        "            if cache.keep:",
        "            if False:",
        (Q4X_CACHE,),
        "Qwen4-Exp: PLE keeps no per-token states for a verification's rewind",
    ),
    Mutant(
        "qmv-scale-of-next-group",
        "mlxlis/runtime/kernels/src/kernels_avx2.cpp",
        "      const size_t gi = size_t(n) * G + g;",
        "      const size_t gi = size_t(n) * G + (g + 1) % G;",
        (QMV_GRID,),
        "CPU kernels: each group's products scaled by the next group's scale and bias",
    ),
    Mutant(
        "qmv-5bit-high-bits-lost",
        "mlxlis/runtime/kernels/src/kernels_avx2.cpp",
        "          c[1] = byte + 1 < 8 ? int8_t(byte + 1) : int8_t(-128);",
        "          c[1] = int8_t(-128);",
        (QMV_GRID,),
        "CPU kernels: a 5- or 6-bit code's bits in the next byte dropped",
    ),
    Mutant(
        "qmv-decode-remainder-skipped",
        "mlxlis/runtime/kernels/src/compute.cpp",
        "  const int ntasks = (p.N + rpt - 1) / rpt;",
        "  const int ntasks = p.N / rpt;",
        (QMV_GRID,),
        "CPU kernels: the rows after the last whole task never computed",
    ),
    Mutant(
        "qmv-prefill-tile-remainder-skipped",
        "mlxlis/runtime/kernels/src/compute.cpp",
        "    const int n1 = std::min(p.N, n0 + tile);",
        "    const int n1 = n0 + tile;\n    if (n1 > p.N) break;",
        (QMV_PREFILL,),
        "CPU kernels: a prompt's last, partial tile of weight rows skipped",
    ),
    Mutant(
        "gemm-full-panel-one-vector-short",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "      const int vecs = rows >= P ? P / W : (rows + W - 1) / W;",
        "      const int vecs = rows >= P ? P / W - 1 : (rows + W - 1) / W;",
        (QMV_GEMM,),
        "CPU prompt product: a full panel of x's rows summed over one vector fewer",
    ),
    Mutant(
        "gemm-x-block-offset",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "      const float* xp = xt + (size_t(pi) * p.K + k0) * P;",
        "      const float* xp = xt + size_t(pi) * p.K * P;",
        (QMV_GEMM,),
        "CPU prompt product: every block of w's columns times x's first block",
    ),
    Mutant(
        "gemm-blocks-not-accumulated",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "      const int rows = p.M - P * pi, first = k0 == 0;",
        "      const int rows = p.M - P * pi, first = 1;",
        (QMV_GEMM,),
        "CPU prompt product: each block of 128 columns overwrites the sums of the last",
    ),
    Mutant(
        "gemm-pack-first-panel",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "Vec::transpose(rows ? x + size_t(P * pi + j0) * K + k0 : x,",
        "Vec::transpose(rows ? x + size_t(j0) * K + k0 : x,",
        (QMV_GEMM,),
        "CPU prompt product: every panel of x packed from its first rows",
    ),
    Mutant(
        "gemm-unpack-edge-width",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "        memcpy(out + (j0 + j) * N + r0, edge + j * W, size_t(nw) * 4);",
        "        memcpy(out + (j0 + j) * N + r0, edge + j * W, size_t(nw - 1) * 4);",
        (QMV_GEMM,),
        "CPU prompt product: an edge block's last output column left unwritten",
    ),
    Mutant(
        "gemm-unpack-full-block-at-edge",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "      if (nw == W && j0 + W <= rows) {",
        "      if (j0 + W <= rows) {",
        (QMV_GEMM,),
        "CPU prompt product: a task's last columns written W at a time, over its neighbour's",
    ),
    Mutant(
        "gemm-task-split-drops-a-unit",
        "mlxlis/runtime/kernels/src/compute.cpp",
        "  const int n1 = std::min(p.N, int(long(u + 1) * c->units / c->nu) * 24);",
        "  const int n1 = std::min(p.N, int(long(u + 1) * c->units / c->nu) * 24 - (u == 0) * 24);",
        (QMV_GEMM,),
        "CPU prompt product: the first task's last 24 weight rows never computed",
    ),
    Mutant(
        "gemm-panel-group-drops-a-panel",
        "mlxlis/runtime/kernels/src/compute.cpp",
        "pb = int(long(gi + 1) * c->panels / c->ng);",
        "pb = int(long(gi + 1) * c->panels / c->ng) - (gi == 0);",
        (QMV_GEMM,),
        "CPU prompt product: the first group's last panel of x's rows never computed",
    ),
    Mutant(
        "gemm-panel-group-out-offset",
        "mlxlis/runtime/kernels/src/gemm_impl.h",
        "      float* cp = ct + size_t(pi - pa) * nbp * P;",
        "      float* cp = ct + size_t(pi % (pb - pa)) * nbp * P;",
        (QMV_GEMM,),
        "CPU prompt product: a later group's panels summed into the wrong rows of its scratch",
    ),
    Mutant(
        "dequant512-second-half-first-group",
        "mlxlis/runtime/kernels/src/gemm_avx512.cpp",
        "_mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(sc[i1]),",
        "_mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(sc[i0]),",
        (QMV_GEMM,),
        "AVX-512 prompt product: codes 16-31 of a chunk scaled by the first group's scale",
    ),
    Mutant(
        "dequant512-code-high-byte-dropped",
        "mlxlis/runtime/kernels/src/gemm_avx512.cpp",
        "u.idx[h][4 * i + 1] = uint8_t(byte + 1 < 4 * B ? byte + 1 : 63);",
        "u.idx[h][4 * i + 1] = 63;",
        (QMV_GEMM,),
        "AVX-512 prompt product: a code across two bytes loses the second byte's bits",
    ),
    Mutant(
        "dequant512-super-min-from-d",
        "mlxlis/runtime/kernels/src/gemm_avx512.cpp",
        "_mm256_set1_ps(-_cvtsh_ss(p.kd[2 * sup + 1]));",
        "_mm256_set1_ps(-_cvtsh_ss(p.kd[2 * sup]));",
        (QMV_SUPER,),
        "AVX-512 prompt product: a super-block's bias −d·m instead of −dmin·m",
    ),
    Mutant(
        "dequant512-bfloat16-as-float16",
        "mlxlis/runtime/kernels/src/gemm_avx512.cpp",
        "if (p.sb_type == SB_F16) return _mm256_cvtph_ps(h);",
        "if (p.sb_type != SB_F32) return _mm256_cvtph_ps(h);",
        ("tests/test_qmv.py::test_half_precision_scales",),
        "AVX-512 prompt product: bfloat16 scales read as float16",
    ),
    Mutant(
        "gemm-avx2-pack-high-columns",
        "mlxlis/runtime/kernels/src/gemm_avx2.cpp",
        "_mm256_storeu_ps(d + (k + 4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));",
        "_mm256_storeu_ps(d + (k + 4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));",
        (QMV_GEMM,),
        "AVX2 prompt product: columns 4-7 of each 8 transposed as 0-3 (x's pack, out's unpack)",
    ),
    Mutant(
        "gemm-avx512-pack-lane-order",
        "mlxlis/runtime/kernels/src/gemm_avx512.cpp",
        "_mm512_storeu_ps(d + (k + 4 + c) * ldd, _mm512_shuffle_f32x4(u0, u2, 0xDD));",
        "_mm512_storeu_ps(d + (k + 4 + c) * ldd, _mm512_shuffle_f32x4(u0, u2, 0x88));",
        (QMV_GEMM,),
        "AVX-512 prompt product: columns 4-7 of each 16 transposed as 0-3 (x's pack, out's unpack)",
    ),
    Mutant(
        "qmv-g16-second-group-scale",
        "mlxlis/runtime/kernels/src/kernels_avx2.cpp",
        "        acc[m] = _mm256_fmadd_ps(t1, s1, _mm256_fmadd_ps(t0, s0, acc[m]));",
        "        acc[m] = _mm256_fmadd_ps(t1, s0, _mm256_fmadd_ps(t0, s0, acc[m]));",
        (QMV_GRID,),
        "CPU kernels, groups of 16 (Q6_K): a chunk's second group scaled as its first",
    ),
    Mutant(
        "qmv512-digit-shift",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "      t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), q, _mm512_loadu_si512(d + 64));",
        "      t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 7), q, _mm512_loadu_si512(d + 64));",
        (QMV_GRID,),
        "AVX-512 kernels: x's middle digit weighted 128 instead of 256",
    ),
    Mutant(
        "qmv512-8bit-high-digit",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.0f),",
        "      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65535.0f),",
        (QMV_GRID,),
        "AVX-512 kernels, 8-bit codes: x's high digit weighted 65535",
    ),
    Mutant(
        "qmv512-exponent-not-raised",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "        ex = _mm512_mask_add_ps(ex, over, ex, _mm512_set1_ps(1.0f));",
        "",
        ("tests/test_qmv.py",),
        "AVX-512 kernels: a lane whose largest x needs 24 bits kept at 2^(e-22) (digits overflow)",
    ),
    Mutant(
        "qmv512-tail-block-skipped",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "    if (full < nb)  // the last 32 weights of a row (K % 64 == 32: groups of 16 or 32)",
        "    if (false)",
        (QMV_GRID,),
        "AVX-512 kernels: a row's last 32 weights (K not a multiple of 64) skipped",
    ),
    Mutant(
        "qmv512-tiny-x-underflow",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "        ex = _mm512_max_ps(ex, _mm512_set1_ps(-149.0f));",
        "        ex = _mm512_max_ps(ex, _mm512_set1_ps(-126.0f));",
        ("tests/test_qmv.py::test_x_of_any_magnitude",),
        "AVX-512 kernels: subnormal x rounded to multiples of 2^-126 (lost)",
    ),
    Mutant(
        "super-expand-second-block",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "  const __m512i di = per == 8 ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0,",
        "  const __m512i di = per == 8 ? _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0,",
        (QMV_SUPER,),
        "super-block rows (AVX-512): groups 8-15 of 16 take the first super-block's d and dmin",
    ),
    Mutant(
        "half-scales-first-chunk-only",
        "mlxlis/loading/quants.py",
        "        for i in range(0, av.size, CHUNK_ELEMENTS):",
        "        for i in range(0, min(av.size, CHUNK_ELEMENTS), CHUNK_ELEMENTS):",
        ("tests/test_quants.py::test_float16_scales_only_where_every_value_survives",),
        "float16 scales and biases: only the first chunk checked for a value float16 loses",
    ),
    Mutant(
        "super-scale-super-block-of-32",
        "mlxlis/runtime/kernels/src/kernels.h",
        "  return sb_load(p.kd, SB_F16, 2 * (idx >> p.gshift)) * sub_scale(p, idx);",
        "  return sb_load(p.kd, SB_F16, 2 * (idx >> 3)) * sub_scale(p, idx);",
        (QMV_SUPER,),
        "super-block formats (scalar): Q6_K's 16 groups a super-block read as 8 (the wrong d)",
    ),
    Mutant(
        "super-avx2-bias-sign",
        "mlxlis/runtime/kernels/src/kernels_avx2.cpp",
        "  return -(_cvtsh_ss(p.kd[2 * (idx >> p.gshift) + 1]) * sub_min(p, idx));",
        "  return _cvtsh_ss(p.kd[2 * (idx >> p.gshift) + 1]) * sub_min(p, idx);",
        (QMV_SUPER,),
        "super-block formats (AVX2): the bias +dmin·m instead of −dmin·m",
    ),
    Mutant(
        "super-mins-high-bits",
        "mlxlis/loading/quant_blocks.py",
        "(mid >> np.uint8(6)) << np.uint8(4), out=mn",
        "(lo >> np.uint8(6)) << np.uint8(4), out=mn",
        (QUANTS_SUPER,),
        "Q4_K/Q5_K mins 4-7: their high bits taken from the scales' bytes",
    ),
    Mutant(
        "super-q6k-d-offset",
        "mlxlis/loading/quant_blocks.py",
        "        d=208,",
        "        d=206,",
        (QUANTS_SUPER,),
        "Q6_K held as stored: d read two bytes early",
    ),
    Mutant(
        "q6k-sub-block-bias",
        "mlxlis/runtime/kernels/src/kernels.h",
        "  if (!p.biases) return -float(1 << (p.bits - 1)) * scale;",
        "  if (!p.biases) return -float((1 << (p.bits - 1)) - 1) * scale;",
        (QMV_GRID,),
        "Q6_K held without biases: the scalar / AVX2 kernels' bias −31·d·sc instead of −32·d·sc",
    ),
    Mutant(
        "qmv512-symmetric-bias",
        "mlxlis/runtime/kernels/src/kernels_avx512.cpp",
        "                             : _mm512_mul_ps(s, _mm512_set1_ps(-float(1 << (B - 1))));",
        "                             : _mm512_mul_ps(s, _mm512_set1_ps(-float(1 << (B - 2))));",
        (QMV_GRID,),
        "AVX-512 kernels, a format held without biases: −2^(bits−2)·scale",
    ),
    Mutant(
        "embedding-lookup-in-float16",
        "mlxlis/models/quantized.py",
        "        if s.dtype == mx.float16 and self._lookup_dtype == mx.float32:",
        "        if False:",
        ("tests/test_qmv.py",),
        "an embedding's float16 scales not widened for a float32 lookup",
    ),
    Mutant(
        "fused-rope-turned-backwards",
        "mlxlis/runtime/kernels/src/fused_kernels.cpp",
        "            o[i + half] = x2 * co + x1 * si;",
        "            o[i + half] = x2 * co - x1 * si;",
        (FUSED,),
        "fused RoPE: the second half of each pair turned the wrong way",
    ),
    Mutant(
        "fused-attention-sees-the-next-key",
        "mlxlis/runtime/kernels/src/fused_kernels.cpp",
        "  const int L = a.causal ? std::min(S, S - T + t + 1) : S;",
        "  const int L = a.causal ? std::min(S, S - T + t + 2) : S;",
        (FUSED,),
        "fused attention: a causal query also sees the key after its own",
    ),
    Mutant(
        "fused-rms-norm-without-eps",
        "mlxlis/runtime/kernels/src/fused_kernels.cpp",
        "    const float inv = 1.0f / sqrtf(dot(xr, xr, D) / float(D) + eps);",
        "    const float inv = 1.0f / sqrtf(dot(xr, xr, D) / float(D));",
        (FUSED,),
        "fused RMSNorm: eps left out",
    ),
    Mutant(
        "fused-attention-other-kv-head",
        "mlxlis/runtime/kernels/src/fused_kernels.cpp",
        "    attend_heads(a, b, g, t, g * G + first,",
        "    attend_heads(a, b, (g + 1) % Hkv, t, g * G + first,",
        (FUSED,),
        "fused attention: a KV head's query heads read the next KV head's keys and values",
    ),
    Mutant(
        "fused-attention-denominator-tail",
        "mlxlis/runtime/kernels/src/fused_kernels.cpp",
        "    for (int j = 0; j < L; ++j) sum += pi[j];",
        "    for (int j = 0; j + 1 < L; ++j) sum += pi[j];",
        (FUSED,),
        "fused attention: the softmax denominator without its last key",
    ),
    Mutant(
        "fused-attention-heads-last-ignored",
        "mlxlis/runtime/kernels/src/fused_kernels.cpp",
        "(a.heads_last ? (int64_t(b) * T + t) * H + h : (int64_t(b) * H + h) * T + t)",
        "((int64_t(b) * H + h) * T + t)",
        (FUSED,),
        "fused attention: heads-last output written in the heads-first order",
    ),
    Mutant(
        "fused-rope-flat-head-stride",
        "mlxlis/runtime/kernels/src/fused.cpp",
        "  v.s[1] = flat ? int64_t(D) : s[2];",
        "  v.s[1] = s[2];",
        (FUSED,),
        "fused RoPE: a flat (B, T, H·D) input's heads one element apart instead of D",
    ),
    Mutant(
        "rope-heads-last-untransposed",
        "mlxlis/runtime/backend.py",
        "        x = x.transpose(0, 2, 1, 3)\n",
        "        pass\n",
        (FUSED,),
        "RoPE heads last where the kernel does not apply: MLX's rope on the untransposed input",
    ),
    Mutant(
        "vocabulary-limit-dropped",
        "mlxlis/generation/core.py",
        "        limit = [VocabularyLimit(model.tokenizer.vocab_size)]",
        "        limit = []",
        ("tests/test_serve_hostile.py::test_padded_ids_are_never_sampled",),
        "ids of a head padded past the tokenizer left in the distributions sampled from",
    ),
    Mutant(
        "accept-guard-dropped",
        "mlxlis/generation/core.py",
        "                try:\n                    out += [(s, ev) for ev in s.accept(token)]\n"
        "                except Exception as e:  # noqa: BLE001 — an unreadable token\n"
        "                    out += self._fail([s], e)\n",
        "                out += [(s, ev) for ev in s.accept(token)]\n",
        ("tests/test_engine_guards.py::test_an_unreadable_token_ends_its_request_alone",),
        "a token that cannot be read fails the whole step, not its own request",
    ),
    Mutant(
        "engine-step-guard-dropped",
        "mlxlis/generation/engine.py",
        "        except Exception as e:  # noqa: BLE001 — no one request's\n"
        "            self._step_failed(e)\n",
        "        except ZeroDivisionError as e:\n            self._step_failed(e)\n",
        ("tests/test_engine_guards.py::test_a_failed_step_ends_its_requests_and_the_loop_goes_on",),
        "a step that fails outside the per-request guards ends the engine's loop silently",
    ),
    Mutant(
        "head-deadline-dropped",
        "mlxlis/serve/http_protocol.py",
        "                self.transport.close()\n",
        "                pass\n",
        ("tests/test_serve_hostile.py::test_a_connection_that_stalls_in_its_head_is_closed",),
        "a connection that stalls in a request's head held forever",
    ),
    Mutant(
        "unread-bound-dropped",
        "mlxlis/generation/engine.py",
        "        if self._sent - self._read > MAX_UNREAD:",
        "        if False:",
        ("tests/test_engine_guards.py::test_a_stream_nobody_reads_is_cancelled_at_its_bound",),
        "a stream nobody reads holds its whole reply",
    ),
    Mutant(
        "disk-header-unsealed",
        "mlxlis/cache/sealed.py",
        'h.update(json.dumps(facts, sort_keys=True).encode() + b"\\0")',
        'h.update(b"\\0")',
        (
            "tests/test_prefix_disk_hostile.py::test_an_entry_altered_without_the_key_is_not_believed",
        ),
        "prefix cache on disk: the header (ids, model, layers) left out of the seal",
    ),
    Mutant(
        "disk-symlink-followed",
        "mlxlis/cache/sealed.py",
        "READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK",
        "READ = os.O_RDONLY | os.O_NONBLOCK",
        (
            "tests/test_prefix_disk_hostile.py::test_a_link_in_the_folder_is_never_followed_nor_deleted",
        ),
        "prefix cache on disk: an entry opened through a symbolic link",
    ),
    Mutant(
        "disk-not-regular-read",
        "mlxlis/cache/sealed.py",
        "    if not stat.S_ISREG(st.st_mode):\n",
        "    if False:\n",
        ("tests/test_prefix_disk_hostile.py::test_a_fifo_in_the_folder_is_never_read",),
        "prefix cache on disk: what is not a regular file (a FIFO) read and deleted",
    ),
    Mutant(
        "schema-depth-unbounded",
        "mlxlis/generation/schema_bounds.py",
        "MAX_DEPTH = 64\n",
        "MAX_DEPTH = 1 << 30\n",
        (
            "tests/test_constraints_hostile.py::test_bounds_and_the_first_tokens_are_checked_at_compile_time",
        ),
        "structured output: a schema's nesting through $ref unbounded (a chain of 2500 crashed)",
    ),
    Mutant(
        "constraint-probe-dropped",
        "mlxlis/generation/constraints.py",
        "    probe(mask.matcher, tok, stops, where)\n",
        "",
        (
            "tests/test_constraints_hostile.py::test_bounds_and_the_first_tokens_are_checked_at_compile_time",
        ),
        "structured output: a grammar's first tokens not tried before the reply (fails mid-reply)",
    ),
    Mutant(
        "schema-finiteness-unchecked",
        "mlxlis/generation/schema_bounds.py",
        "    _finite(schema, done, refs, field)\n",
        "",
        ("tests/test_constraints_hostile.py::test_anthropic_and_responses_name_their_own_fields",),
        "structured output: a schema only a $ref to itself left to the engine (an empty reply)",
    ),
    Mutant(
        "schema-row-unbounded",
        "mlxlis/generation/schema_bounds.py",
        "MAX_ROW = 1_500\n",
        "MAX_ROW = 1 << 30\n",
        (
            "tests/test_constraints_hostile.py::test_bounds_and_the_first_tokens_are_checked_at_compile_time",
        ),
        "structured output: a value's alternatives past the parser's row (fails mid-reply)",
    ),
    Mutant(
        "tool-parameters-not-their-own-resource",
        "mlxlis/generation/tool_grammar/__init__.py",
        '            params = {**params, "$id": f"urn:mlxlis:tools:{i}"}\n',
        "            pass\n",
        ("tests/test_constraints_hostile.py::test_pydantic_schemas_are_forced_in_every_dialect",),
        "forced tool calls: a tool's $defs left unresolvable inside the call object",
    ),
    Mutant(
        "reasoning-close-misspelled",
        "mlxlis/prompt/reasoning_styles.py",
        'THINK = ReasoningStyle("think", "<think>", "</think>")',
        'THINK = ReasoningStyle("think", "<think>", "</thinking>")',
        ("tests/test_reasoning_corpus.py::test_template_reasoning_splits_exactly",),
        "reasoning styles: the <think> style's close tag misspelled",
    ),
    Mutant(
        "reasoning-prompt-open-ignored",
        "mlxlis/prompt/reasoning.py",
        "            in_reasoning=starts_in_reasoning(prompt, style.open),\n",
        "            in_reasoning=False,\n",
        ("tests/test_reasoning_corpus.py::test_template_reasoning_splits_exactly",),
        "reasoning split: a generation prompt that opens the block not seen (reasoning as answer)",
    ),
    Mutant(
        "reasoning-prompt-open-not-probed",
        "mlxlis/prompt/reasoning_styles.py",
        '            return TemplateReasoning(style, True, "generation prompt")\n',
        "            pass\n",
        ("tests/test_reasoning_corpus.py::test_template_reasoning_splits_exactly",),
        "reasoning styles: tags shown only by the generation prompt opening them (QwQ, R1) unseen",
    ),
    Mutant(
        "tool-xml-integer-a-string",
        "mlxlis/prompt/tool_formats/values.py",
        "        return True, int(word)\n",
        "        return True, word\n",
        (TOOL_CORPUS,),
        "tool calls: an XML integer parameter left the string it was written as",
    ),
    Mutant(
        "tool-second-call-dropped",
        "mlxlis/prompt/tool_calls.py",
        "                    new += self._finish(parsed)\n",
        "                    new += self._finish(parsed[:1])\n",
        (TOOL_CORPUS,),
        "tool calls: the second of two parallel calls in one block dropped",
    ),
    Mutant(
        "tool-text-before-call-lost",
        "mlxlis/prompt/tool_calls.py",
        "            out += self._text(buf[:at])\n",
        "            self._text(buf[:at])\n",
        (TOOL_CORPUS,),
        "tool calls: the text before a call lost",
    ),
    Mutant(
        "tool-open-tag-not-held",
        "mlxlis/prompt/tool_calls.py",
        "                keep = partial_suffix(buf, op)\n",
        "                keep = 0\n",
        (TOOL_CORPUS,),
        "tool calls: a call tag's start streamed out as text before the rest of the tag came",
    ),
    Mutant(
        "tool-close-tag-not-held",
        "mlxlis/prompt/tool_calls.py",
        "                at = buf.find(cl) if cl is not None else -1\n",
        "                at = buf.find(cl, len(buf) - len(text)) if cl is not None else -1\n",
        (TOOL_CORPUS,),
        "tool calls: a close tag split across pieces not held together (only the newest looked at)",
    ),
    Mutant(
        "tool-grammar-required-optional",
        "mlxlis/generation/tool_grammar/args.py",
        "        items = [(self.row(k, p, params), k in required) for k, p in props]\n",
        "        items = [(self.row(k, p, params), False) for k, p in props]\n",
        (TOOL_FORCING,),
        "forced tool calls: an XML format's required parameters left optional",
    ),
    Mutant(
        "tool-grammar-greedy-string",
        "mlxlis/generation/tool_grammar/args.py",
        '        return self.lark.rule(join(quoted[0], value, quoted[1]), "[lazy]")\n',
        "        return self.lark.terminal(join(quoted[0], value, quoted[1]))\n",
        ("tests/test_tool_forcing.py::test_the_templates_own_calls_are_what_the_grammar_writes",),
        "forced tool calls: a string value and its closing tag one greedy lexeme (llguidance "
        "panics at the tag token after an unbounded one)",
    ),
    Mutant(
        "grammar-specials-unchecked",
        "mlxlis/generation/constraints.py",
        "            elif not self.matcher.validate_tokens([int(token)]):\n",
        "            elif False:\n",
        (TOOL_FORCING,),
        "grammar masks: the special tokens llguidance over-allows after an optional piece kept",
    ),
    Mutant(
        "thinking-off-unrendered",
        "mlxlis/prompt/thinking_switch.py",
        "    return on_value, next((v for v, shows in found if shows), found[0][0])\n",
        "    return on_value, _off_values(name)[0]\n",
        (THINKING_SWITCH,),
        "thinking switch: reasoning_effort's first off value taken without rendering it (Hy3 "
        'refuses "none")',
    ),
    Mutant(
        "thinking-off-not-preferred",
        "mlxlis/prompt/thinking_switch.py",
        "    return on_value, next((v for v, shows in found if shows), found[0][0])\n",
        "    return on_value, found[0][0]\n",
        (THINKING_SWITCH,),
        "thinking switch: the first off value that changes the prompt taken, not the one whose "
        "prompt shows thinking off",
    ),
    Mutant(
        "thinking-level-as-switch",
        "mlxlis/prompt/thinking_switch.py",
        "    return isinstance(off_value, str) and off.replace(off_value, str(on_value)) == on\n",
        "    return False\n",
        (THINKING_SWITCH,),
        "thinking switch: a level the template only prints taken as off (gpt-oss' "
        '"Reasoning: none")',
    ),
    Mutant(
        "thinking-switch-unread",
        "mlxlis/models/model.py",
        "        return thinking_vars(self.template, on) if self.template is not None else {}\n",
        "        return {**thinking_vars(self.template, on), 'enable_thinking': on} "
        "if self.template is not None else {}\n",
        (THINKING_SWITCH,),
        "--think / --no-think: enable_thinking set on a template that does not read it",
    ),
    Mutant(
        "thinking-supports-enable-only",
        "mlxlis/models/model.py",
        "        return self.template is not None and has_thinking_switch(self.template)\n",
        '        return "enable_thinking" in self.template_variables\n',
        (THINKING_SWITCH,),
        "supports_thinking: only Qwen3's enable_thinking counts as a thinking switch",
    ),
    Mutant(
        "thinking-session-enable-only",
        "mlxlis/generation/session.py",
        "        return self.model.thinking_vars(bool(self.thinking))\n",
        '        return {"enable_thinking": bool(self.thinking)}\n',
        (THINKING_SWITCH,),
        "ChatSession: thinking passed as enable_thinking whatever the template reads",
    ),
    Mutant(
        "thinking-ollama-enable-only",
        "mlxlis/serve/ollama_requests.py",
        "        if switch := model.thinking_vars(on):\n",
        '        if switch := {"enable_thinking": on}:\n',
        (THINKING_SWITCH,),
        "Ollama's think: passed as enable_thinking whatever the template reads",
    ),
    Mutant(
        "tool-python-bool-json",
        "mlxlis/generation/tool_grammar/values.py",
        '    "python": Syntax(("True", "False", "None"),',
        '    "python": Syntax(("true", "false", "None"),',
        (STYLES_WRITER,),
        "forced tool calls: Python-style values (Seed-OSS, MiniCPM5, LFM2) write JSON's true",
    ),
    Mutant(
        "tool-python-string-double-quoted",
        "mlxlis/generation/tool_grammar/lexemes.py",
        """    return rules.terminal(f'"\\'" {single} "\\'" | "\\\\"" {double} "\\\\""')""",
        """    return rules.terminal(f'"\\\\"" {single} "\\\\"" | "\\\\"" {double} "\\\\""')""",
        (STYLES_WRITER,),
        "forced tool calls: Python reprs' strings in double quotes where repr writes single",
    ),
    Mutant(
        "tool-number-trailing-zeros",
        "mlxlis/generation/tool_grammar/lexemes.py",
        r'        r"/-?[1-9][0-9]*\.[0-9]*[1-9]/ & /-?[0-9.]{3,16}/",',
        r'        r"/-?[1-9][0-9]*\.[0-9]+/ & /-?[0-9.]{3,16}/",',
        (STYLES_WRITER,),
        "forced tool calls: a float written with trailing zeros (2.50) repr never writes",
    ),
    Mutant(
        "tool-lfm2-list-as-json",
        "mlxlis/generation/tool_grammar/args.py",
        '(fmt.args, kind) == ("python", "array")',
        '(fmt.args, kind) == ("python", "list")',
        (STYLES_WRITER,),
        "forced tool calls: LFM2's lists as JSON where its template writes Python's repr",
    ),
    Mutant(
        "tool-cdata-raw-markup",
        "mlxlis/generation/tool_grammar/args.py",
        '        plain = self.string(prop, root, closing, extra=[*extra, r"/[^<&\\n]*/"])',
        "        plain = self.string(prop, root, closing, extra=extra)",
        (STYLES_WALKS,),
        "forced tool calls: MiniCPM5's text holding < or a newline left out of its CDATA",
    ),
    Mutant(
        "tool-lfm2-escape-unread",
        "mlxlis/prompt/tool_formats/args.py",
        '        if quote and c == "\\\\":  # an escape: the next character is no quote\'s end',
        "        if False:",
        (STYLES_WRITER,),
        "LFM2's reader: an escape inside a quoted literal not skipped (its \\' taken for the end)",
    ),
    Mutant(
        "tool-sequence-ungrouped",
        "mlxlis/generation/tool_grammar/lark.py",
        """                return f"({' | '.join(f'({f})' for f in firsts)})"\n""",
        """                return " | ".join(f"({f})" for f in firsts)\n""",
        (STYLES_WALKS,),
        "forced tool calls: optional keys before a required one, ungrouped (Gemma 4's `{` lost)",
    ),
    Mutant(
        "stream-number-whole-at-text-end",
        "mlxlis/prompt/tool_formats/partial.py",
        'return text[skip_ws(text, end) : skip_ws(text, end) + 1] in (",", "}")',
        'return text[skip_ws(text, end) : skip_ws(text, end) + 1] in (",", "}", "")',
        ("tests/test_tool_stream.py", TOOL_CORPUS),
        "streamed tool calls: a number sent before what follows it says it ended (2 of 2.5)",
    ),
    Mutant(
        "stream-brace-before-done",
        "mlxlis/prompt/tool_formats/partial.py",
        'return "{" + body + ("}" if self.done else "")',
        'return "{" + body + "}"',
        ("tests/test_tool_stream.py",),
        "streamed tool calls: the arguments' object closed before its last argument came",
    ),
    Mutant(
        "stream-rest-not-sent",
        "mlxlis/prompt/tool_calls.py",
        "                elif len(args) > len(sent):\n",
        "                elif False:\n",
        ("tests/test_tool_stream.py",),
        "streamed tool calls: what the stream still lacked when the call was read whole not sent",
    ),
    Mutant(
        "stream-unoffered-tool-streamed",
        "mlxlis/prompt/tool_calls.py",
        "                if self.names and call.name not in self.names:\n",
        "                if False:\n",
        ("tests/test_tool_stream.py",),
        "streamed tool calls: a call of a tool not offered streamed as it came",
    ),
    Mutant(
        "stream-anthropic-later-pieces-dropped",
        "mlxlis/serve/anthropic_blocks.py",
        '            if fn["arguments"]:\n                delta = {"type": "input_json_delta"',
        '            if "id" in piece and fn["arguments"]:\n'
        '                delta = {"type": "input_json_delta"',
        ("tests/test_tool_serve.py",),
        "Anthropic stream: only a call's first input_json_delta sent",
    ),
    Mutant(
        "stream-responses-arguments-replaced",
        "mlxlis/serve/responses_items.py",
        '                self.open["arguments"] += fn["arguments"]',
        '                self.open["arguments"] = fn["arguments"]',
        ("tests/test_tool_serve.py",),
        "Responses stream: a call item's arguments the last delta only, not all of them",
    ),
    Mutant(
        "stream-row-closer-any",
        "mlxlis/prompt/tool_formats/base.py",
        "while text.find(closer, pos) >= 0 and (m := row.match(text, pos)) is not None:",
        "while text.find(closer, pos) < 0 and (m := row.match(text, pos)) is not None:",
        (TOOL_CORPUS, "tests/test_tool_stream.py"),
        "tool calls: a tagged row tried only when its closing tag has not come",
    ),
    Mutant(
        "pool-lru-picks-busy",
        "mlxlis/serve/pool.py",
        "idle = [s.name for s in sorted(others, key=lambda s: s.last_used) if not s.busy]",
        "idle = [s.name for s in sorted(others, key=lambda s: s.last_used)]",
        (SERVE_MODELS,),
        "several models: a model with requests in flight may be unloaded to make room",
    ),
    Mutant(
        "pool-unload-keeps-reference",
        "mlxlis/serve/pool.py",
        "        engine.others = None\n        del served\n",
        "        engine.others = None\n        self.gone = served\n",
        (SERVE_MODELS,),
        "several models: an unloaded model stays referenced (its memory not returned)",
    ),
    Mutant(
        "serve-routes-to-first-model",
        "mlxlis/serve/service.py",
        "stream = served.engine.submit(prep.gen, loop=asyncio.get_running_loop())",
        "stream = next(iter(state.pool.loaded.values())).engine.submit(\n"
        "                prep.gen, loop=asyncio.get_running_loop()\n            )",
        (SERVE_MODELS,),
        "several models: a request submitted to the first loaded model's engine",
    ),
    Mutant(
        "engine-others-ignored",
        "mlxlis/generation/engine.py",
        "room = plan.room - others",
        "room = plan.room",
        (SERVE_MODELS,),
        "several models: a request's caches checked without the other models' requests",
    ),
    Mutant(
        "serve-draft-not-counted",
        "mlxlis/serve/server.py",
        "weights += footprint(speculation.draft_model, None).weights",
        "weights += 0",
        ("tests/test_speculative.py::test_a_served_draft_model_counts_in_its_targets_memory",),
        "several models: a target's draft model left out of the memory it holds",
    ),
    Mutant(
        "lora-scale-twice",
        "mlxlis/models/lora.py",
        "return y + delta * self.scale",
        "return y + delta * self.scale * self.scale",
        (LORA,),
        "LoRA: the adapter's scale applied twice",
    ),
    Mutant(
        "lora-scale-dropped",
        "mlxlis/models/lora.py",
        "return y + delta * self.scale",
        "return y + delta",
        (LORA,),
        "LoRA: the adapter's scale not applied",
    ),
    Mutant(
        "lora-rslora-ignored",
        "mlxlis/loading/adapters.py",
        "alpha / math.sqrt(r) if rslora else alpha / r",
        "alpha / r",
        (LORA,),
        "LoRA: rsLoRA's alpha / √r read as alpha / r",
    ),
    Mutant(
        "lora-cache-key-without-adapters",
        "mlxlis/models/model.py",
        'key = f"{self.path}|{stamp}|{self.dtype}|{self.quant_summary}|{adapters}"',
        'key = f"{self.path}|{stamp}|{self.dtype}|{self.quant_summary}"',
        (LORA,),
        "LoRA: a cache saved under one adapter read under another",
    ),
    Mutant(
        "lora-row-gets-another-rows-adapter",
        "mlxlis/models/lora.py",
        "pick = mx.maximum(ids, 0)",
        "pick = mx.maximum(ids[::-1], 0)",
        (LORA,),
        "LoRA: a row's delta taken from another row's adapter",
    ),
    Mutant(
        "lora-row-scale-ignored",
        "mlxlis/models/lora.py",
        "self.scales[pick] * mult, 0.0)",
        "self.scales[pick], 0.0)",
        (LORA_ENGINE,),
        "LoRA: a request's adapter scale multiplier ignored",
    ),
    Mutant(
        "lora-decode-lanes-dropped",
        "mlxlis/generation/core.py",
        "                            lanes=lanes(g),\n",
        "                            lanes=None,\n",
        (LORA_ENGINE,),
        "LoRA: batched decode steps run every row on the base",
    ),
    Mutant(
        "lora-verify-lanes-dropped",
        "mlxlis/generation/verify.py",
        "            lanes=lanes(seqs),\n",
        "            lanes=None,\n",
        (LORA_ENGINE,),
        "LoRA: a batched speculative verification runs every row on the base",
    ),
    Mutant(
        "serve-adapter-name-runs-base",
        "mlxlis/serve/pool.py",
        "target=replace(self.target, adapter=listing.adapter),",
        "target=self.target,",
        ("tests/test_serve_lora.py",),
        "serve: a request naming BASE:ADAPTER runs on the base",
    ),
    Mutant(
        "serve-lora-field-scale-dropped",
        "mlxlis/serve/prepare.py",
        "chosen.append((names[entry.id], entry.scale))",
        "chosen.append((names[entry.id], 1.0))",
        ("tests/test_serve_lora.py",),
        "serve: llama.cpp's per-request adapter scale ignored",
    ),
    Mutant(
        "prefix-cache-crosses-adapters",
        "mlxlis/cache/prefix.py",
        "if fmt != kv or made != tag or not (n := common_prefix(held, ids)):",
        "if fmt != kv or not (n := common_prefix(held, ids)):",
        (LORA_ENGINE,),
        "LoRA: a prefix cached under one adapter taken under another",
    ),
    Mutant(
        "disk-cache-crosses-adapters",
        "mlxlis/cache/disk.py",
        "            if fmt != kv or made != tag:",
        "            if fmt != kv:",
        (LORA_ENGINE,),
        "LoRA: a prefix file written under one adapter read under another",
    ),
    Mutant(
        "gguf-lora-b-not-unpermuted",
        "mlxlis/models/lora.py",
        'b = fn(b, cfg, "weight")',
        "b = b",
        (LORA_GGUF,),
        "GGUF LoRA: B's rows left in llama.cpp's q/k permuted layout",
    ),
    Mutant(
        "gguf-lora-alpha-ignored",
        "mlxlis/loading/adapters.py",
        "lambda r: alpha / r, path, transposed=False",
        "lambda r: 1.0 / r, path, transposed=False",
        (LORA_GGUF,),
        "GGUF LoRA: adapter.lora.alpha not in the scale",
    ),
    Mutant(
        "gguf-lora-a-read-transposed",
        "mlxlis/loading/adapters.py",
        "lambda r: alpha / r, path, transposed=False",
        "lambda r: alpha / r, path, transposed=True",
        (LORA_GGUF,),
        "GGUF LoRA: lora_a / lora_b read in mlx-lm's orientation, not ggml's",
    ),
    Mutant(
        "gguf-lora-arch-unchecked",
        "mlxlis/models/lora.py",
        "if adapter.arch not in spec.gguf.archs:",
        "if adapter.arch is None:",
        (LORA_GGUF,),
        "GGUF LoRA: an adapter of another architecture applied",
    ),
    Mutant(
        "hub-adapter-takes-model-weights",
        "mlxlis/loading/hub/select.py",
        "weights = tuple(w for w in ADAPTER_WEIGHTS if w in top)",
        'weights = tuple(sorted(p for p in top if p.endswith(".safetensors")))',
        (LORA_GGUF,),
        "adapter by repo name: a model's weights beside the adapter downloaded too",
    ),
    Mutant(
        "mlx-thread-no-turns",
        "mlxlis/runtime/mlx_thread.py",
        "later = [i for i in ready if i >= self._turn]",
        "later = ready[:1]",
        ("tests/test_mlx_thread.py",),
        "several engines: the first with work always runs, the others wait",
    ),
)

IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "bench-results",
    "*.egg-info",
    "build",
    "dist",
)


def copy_tree(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=IGNORE, symlinks=True)
    return dest


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """pytest on `tree` (its own mlxlis first on sys.path); returns (exit status, the first
    failing test, or the summary line)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    res = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    lines = (res.stdout + res.stderr).strip().splitlines()
    failed = [ln.split()[1] for ln in lines if ln.startswith("FAILED ")]
    return res.returncode, failed[0] if failed else (lines[-1] if lines else "")


def check_isolation(tree: Path) -> None:
    """The copy's mlxlis, not the installed one, is what the tests import there."""
    out = subprocess.run(
        [sys.executable, "-c", "import mlxlis; print(mlxlis.__file__)"],
        cwd=tree,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not out.startswith(str(tree)):
        sys.exit(f"mutants: the copy imports mlxlis from {out}, not from {tree}")


def apply(tree: Path, m: Mutant) -> bool:
    path = tree / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        return False
    path.write_text(text.replace(m.old, m.new))
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.only or m.id in a.only]
    if a.list or not chosen:
        for m in MUTANTS:
            print(f"{m.id:<24} {m.file:<34} {m.what}")
        return 0 if a.list else 2
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="mlxlis-mutants-") as tmp:
        base = copy_tree(Path(tmp) / "base")
        check_isolation(base)
        for tests in sorted({m.tests for m in chosen}):
            status, last = run_tests(base, tests)
            if status != 0:
                print(f"baseline fails for {' '.join(tests)}: {last}")
                return 1
        for m in chosen:
            tree = Path(tmp) / m.id
            copy_tree(tree)
            t0 = time.perf_counter()
            if not apply(tree, m):
                result, detail = "STALE", f"snippet not found once in {m.file}"
                ok = False
            else:
                status, detail = run_tests(tree, m.tests)
                result = "killed" if status == 1 else ("SURVIVED" if status == 0 else "ERROR")
                ok &= result == "killed"
            shutil.rmtree(tree, ignore_errors=True)
            rows.append((m, result, detail, time.perf_counter() - t0))
            print(f"{m.id:<24} {result:<8} {time.perf_counter() - t0:5.1f} s  {detail}", flush=True)
    print()
    print("| mutant | what | result | killed by |")
    print("|---|---|---|---|")
    for m, result, detail, _ in rows:
        print(f"| {m.id} | {m.what} | {result} | {detail if result == 'killed' else ''} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
