"""Reasoning split from the answer, proven on llama.cpp's corpus of official chat templates.

For every template of the corpus: render a conversation whose last assistant turn has the
reasoning R and the answer A, take what the assistant's turn adds after the generation
prompt (the text a model trained on that template writes, cut where the answer ends: the
engine stops at the turn's end), stream it in pieces cut at arbitrary places through the
splitter mlxlis picks for that template and prompt, and get R and A back exactly. The tags
come from the template's own rendering, not from the splitter's table: a round trip through
independent text. The whitespace rules (reasoning.py): the reasoning is stripped at both ends
and so is the gap between its closing tag and the answer; R and A have no whitespace at their
ends, so they compare exactly.

A template that never renders past reasoning is still probed where it shows its tags: a
generation prompt that opens the block (DeepSeek-R1, QwQ: the reply is R, the close tag the
template cuts its history at, then A), a turn that keeps the tags but drops what was between
them (Kimi K2 Thinking, DeepSeek V3.1), or the empty block its thinking-off prompt ends with
(SmolLM3, Gemma 4): R is put inside those very tags. With thinking off (each template's own
switch), the prompt's tail decides: a reply that starts with the answer has no reasoning.
"""

from __future__ import annotations

import functools
import random
import re
import sys
from pathlib import Path

from mlxlis.prompt.reasoning import ANSWER, REASONING, ReasoningSplitter, join
from mlxlis.prompt.reasoning_styles import (
    PROBE_TOOLS,
    PROBE_USER,
    THINKING_OFF,
    THINKING_ON,
    ReasoningStyle,
    probe_turns,
    render,
    spliced,
    template_reasoning,
)
from mlxlis.prompt.template import ChatTemplate

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from fetch_references import reference_dir  # noqa: E402

R = "First, 2 × 3 = 6.\n  Then — a naïve check: ok"  # multi-line, non-ASCII
A = "The answer is 6 (ü)."
CORPUS = reference_dir() / "templates"
NAMES = sorted(p.name for p in CORPUS.glob("*.jinja")) or ["(corpus not fetched)"]

# Templates whose reasoning mlxlis cannot split, and why. A template of a family mlxlis runs
# or is adding (FAMILIES) is never listed here: its failure fails the suite.
XFAIL = {
    "unsloth-Apriel-1.5.jinja": "renders a turn's `thought` after its answer "
    "(A<thinking>R</thinking>): reasoning that follows the answer is no block the stream opens",
    "upstage-Solar-Open-100B.jinja": "reasoning is a message of its own, "
    "<|think|>R<|end|><|begin|>assistant<|content|>A: <|end|> is the end-of-turn token the "
    "engine stops at, and <|end|><|begin|>assistant also ends every generation prompt",
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "names <think></think> and "
    "<response></response> only in its system prompt's prose; it renders no reasoning in a "
    "turn and no block in a generation prompt, so there is nothing of its own to probe",
}
# Templates that render no reasoning at all (no field, no tags in a prompt): the probe finds
# none, and a reply is all answer.
NO_REASONING = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "GigaChat3-10B-A1.8B.jinja",
    "GigaChat3.1-10B-A1.8B.jinja",
    "Kimi-K2-Instruct.jinja",
    "LFM2-8B-A1B.jinja",
    "LFM2.5-Instruct.jinja",  # cuts `</think>` out of past content, but renders none itself
    "MiMo-VL.jinja",
    "MiniMax-M1.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen3-Coder.jinja",
    "google-gemma-2-2b-it.jinja",
    "ibm-granite-granite-4.0.jinja",
    "ibm-granite-granite-4.1.jinja",
    "meetkai-functionary-medium-v3.1.jinja",
    "meetkai-functionary-medium-v3.2.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "moonshotai-Kimi-K2.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
}
# The corpus's templates of the families mlxlis runs or is adding.
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "llama",
    "llama-cpp-deepseek-r1.jinja": "llama",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "qwen2",
    "Qwen-QwQ-32B.jinja": "qwen2",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "qwen2",
    "Qwen-Qwen3-0.6B.jinja": "qwen3",
    "Qwen3-Coder.jinja": "qwen3_moe",
    "Qwen3.5-4B.jinja": "qwen3_5",
    "HuggingFaceTB-SmolLM3-3B.jinja": "smollm3",
    "microsoft-Phi-3.5-mini-instruct.jinja": "phi3",
    "google-gemma-2-2b-it.jinja": "gemma2",
    "google-gemma-4-31B-it.jinja": "gemma4",
    "google-gemma-4-31B-it-interleaved.jinja": "gemma4",
    "openai-gpt-oss-120b.jinja": "gpt_oss",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral3",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral3",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v3",
    "Kimi-K2-Thinking.jinja": "deepseek_v3",
    "moonshotai-Kimi-K2.jinja": "deepseek_v3",
    "Kimi-K2-Instruct.jinja": "deepseek_v3",
    "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek_v32",
    "deepseek-ai-DeepSeek-V4.jinja": "deepseek_v4",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "deepseek_v4",
    "GLM-4.6.jinja": "glm4_moe",
    "GLM-4.7-Flash.jinja": "glm4_moe",
    "MiniMax-M2.jinja": "minimax_m2",
    "NVIDIA-Nemotron-Nano-v2.jinja": "nemotron_h",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "nemotron_h",
    "ibm-granite-granite-4.0.jinja": "granitemoehybrid",
    "LFM2-8B-A1B.jinja": "lfm2",
    "LFM2.5-8B-A1B.jinja": "lfm2",
    "LFM2.5-Instruct.jinja": "lfm2",
}


def pieces(text: str) -> list[list[str]]:
    """`text` cut into pieces: whole, at every fixed width 1..5 and 8, and at random places."""
    cuts = [[text]] + [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 5, 8)]
    rng = random.Random(len(text))
    for _ in range(4):
        at = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 4)))
        cuts.append([text[i:j] for i, j in zip([0, *at], [*at, len(text)], strict=True)])
    return cuts


def split(template: ChatTemplate, prompt: str, reply: str) -> set[tuple[str, str]]:
    """(reasoning, answer) from the splitter mlxlis picks for `prompt`, once per way of
    cutting `reply`: one element when every cut agrees."""
    got = set()
    for cut in pieces(reply):
        splitter = ReasoningSplitter.for_prompt(None, prompt, template)
        segments = [seg for piece in cut for seg in splitter.feed(piece)] + splitter.flush()
        got.add((join(segments, REASONING), join(segments, ANSWER)))
    return got


def up_to_answer(rest: str, style: ReasoningStyle) -> str:
    """`rest` cut right after the answer and the style's answer-closing tag, if it has one
    there: what follows is the turn's end, where the engine stops."""
    end = rest.rindex(A) + len(A)
    tail = rest[end:]
    if style.answer_close and tail.lstrip().startswith(style.answer_close):
        end += len(tail) - len(tail.lstrip()) + len(style.answer_close)
    return rest[:end]


def filled(style: ReasoningStyle, text: str, where: str) -> str | None:
    """`text` with R put inside its first empty block of `style` (followed by `where`, a
    pattern), its whitespace shared around R; None without such a block."""
    opening = re.escape(style.open) + (f"(?:{re.escape(style.label)})?" if style.label else "")
    m = re.search(f"({opening})(\\s*)({re.escape(style.close)})(?={where})", text)
    if m is None:
        return None
    ws = m.group(2)
    half = (len(ws) + 1) // 2
    inner = m.group(1) + ws[:half] + R + ws[half:] + m.group(3)
    return text[: m.start()] + inner + text[m.end() :]


def assistant_reply(template: ChatTemplate, found, head: str) -> tuple[str, str]:
    """What the model writes after `head` (thinking on), and how the test got it."""
    turns = probe_turns(R, A)
    for turn in turns:
        if "tool_calls" in turn:  # the call would sit in the answer (Gemma 4 puts it first)
            continue
        whole = render(template, [PROBE_USER, turn], False, THINKING_ON)
        if whole is not None and R in whole and A in whole[whole.index(R) :]:
            return up_to_answer(spliced(head, whole)[len(head) :], found.style), "its turn"
    style = found.style
    whole = render(template, [PROBE_USER, turns[0]], False, THINKING_ON)
    rest = up_to_answer(spliced(head, whole or head + A)[len(head) :], style)
    if found.opens:  # the generation prompt opened the block; the turn drops R
        assert style.close in template.text, "the close tag is nowhere in the template"
        if rest.lstrip().startswith(style.close):  # the turn keeps the close tag (V3.1)
            return R + rest, "its generation prompt and turn"
        return f"{R}\n{style.close}\n\n{rest}", "its generation prompt and history cut"
    if (inside := filled(style, rest, re.escape(A))) is not None:
        return inside, "the empty block of its turn"
    for switches in THINKING_OFF:
        off = render(template, [PROBE_USER], True, switches) or ""
        block = re.search(re.escape(style.open) + r".*\Z", off, re.S)
        if block is not None and (inside := filled(style, block.group(0), r"\s*\Z")):
            return inside + rest, "the empty block of its thinking-off prompt"
    raise AssertionError(f"no text of the template's own to build a reply from ({found})")


@functools.cache
def survey(name: str) -> tuple[str, str]:
    """(outcome, detail) for one template: "split", "none" (renders no reasoning), "skip"
    (neither renderer renders it) or "FAIL"."""
    template = ChatTemplate(name, (CORPUS / name).read_text())
    head = render(template, [PROBE_USER], True, THINKING_ON)
    if head is None:
        from transformers.utils.chat_template_utils import render_jinja_template

        errors = []
        for tools in (None, PROBE_TOOLS):
            try:
                render_jinja_template([[PROBE_USER]], tools, chat_template=template.text)
                return "FAIL", "transformers renders it, mlxlis does not"
            except Exception as e:  # whatever the template raises
                errors.append(f"{type(e).__name__}: {e}")
        return "skip", f"neither mlxlis nor transformers renders it ({errors[-1]})"
    shown = any(
        R in (render(template, [PROBE_USER, turn, *after], False, THINKING_ON) or "")
        for turn in probe_turns(R, A)
        for after in ([], [{"role": "user", "content": "Next?"}])
    )
    found = template_reasoning(template)
    if found is None:
        if shown:
            return "FAIL", "renders the reasoning, but no style of the table wraps it"
        if name not in NO_REASONING:
            return "FAIL", "shows no reasoning: list it in NO_REASONING if it has none"
        got = split(template, head, A)
        return ("none", "") if got == {("", A)} else ("FAIL", f"a plain reply split: {got}")
    try:
        reply, how = assistant_reply(template, found, head)
    except (AssertionError, ValueError) as e:
        return "FAIL", f"{found.style.name}: {e}"
    got = split(template, head, reply)
    if got != {(R, A)}:
        return "FAIL", f"{found.style.name} from {how}: {reply!r} split as {sorted(got)}"
    return "split", f"{found.style.name} ({found.evidence}; reply from {how})"


@pytest.mark.parametrize("name", NAMES)
def test_template_reasoning_splits_exactly(name, request):
    """The reasoning and answer a model trained on the template writes come back exactly."""
    if not CORPUS.is_dir():
        pytest.skip("llama.cpp references not fetched (scripts/fetch_references.py)")
    if name in XFAIL:
        request.applymarker(pytest.mark.xfail(reason=XFAIL[name], strict=True))
    outcome, detail = survey(name)
    if outcome == "skip":
        pytest.skip(detail)
    assert outcome in ("split", "none"), f"{name}: {detail}"
    assert (outcome == "none") == (name in NO_REASONING), f"{name}: {outcome} {detail}"


@pytest.mark.parametrize("name", NAMES)
def test_thinking_off_the_prompts_tail_decides(name):
    """With thinking off the way the template spells it, a prompt whose tail leaves the
    reply outside the block gets a reply that starts with the answer as all answer."""
    if not CORPUS.is_dir() or name in XFAIL or survey(name)[0] != "split":
        pytest.skip("no reasoning split for this template")
    template = ChatTemplate(name, (CORPUS / name).read_text())
    style = template_reasoning(template).style
    prompts = {render(template, [PROBE_USER], True, sw) for sw in THINKING_OFF}
    no_think = [{"role": "system", "content": "/no_think"}, PROBE_USER]  # Nemotron, SmolLM3
    prompts.add(render(template, no_think, True, THINKING_OFF[0]))
    switched = [
        p
        for p in prompts - {None}
        if not ReasoningSplitter.for_prompt(None, p, template).in_reasoning
    ]
    if not switched:
        pytest.skip(f"no thinking switch: every prompt opens the reasoning ({style.name})")
    for prompt in switched:
        reply = A + style.answer_close
        if not prompt.rstrip().endswith(style.answer_open):
            reply = style.answer_open + reply
        assert split(template, prompt, reply) == {("", A)}, (name, prompt[-60:], reply)


def test_the_corpus_count(capsys):
    """Every template classified; the count printed: rendering reasoning, split exactly, and
    the ones that fail, with why. No template of a family mlxlis runs may fail."""
    if not CORPUS.is_dir():
        pytest.skip("llama.cpp references not fetched (scripts/fetch_references.py)")
    results = {name: survey(name) for name in NAMES}
    reasoning = {n for n, (o, _) in results.items() if o in ("split", "FAIL")}
    split_ok = {n for n, (o, _) in results.items() if o == "split"}
    failing = {n: d for n, (o, d) in results.items() if o == "FAIL"}
    lines = [
        f"reasoning corpus: {len(results)} templates, {len(reasoning)} render reasoning, "
        f"{len(split_ok)} split exactly, {len(failing)} fail, "
        f"{sum(o == 'skip' for o, _ in results.values())} unrenderable",
        *(f"  fails: {n}: {XFAIL.get(n, d)}" for n, d in sorted(failing.items())),
    ]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not set(XFAIL) & set(FAMILIES), "a family mlxlis runs may not be excused"
    assert set(failing) == set(XFAIL), {
        n: failing.get(n, "passes") for n in set(failing) ^ set(XFAIL)
    }
