"""Each template's own thinking switch, proven on llama.cpp's corpus of official chat templates.

`thinking_vars(template, on)` finds the switch from the template's renders alone. The proof
is independent of that search: for every corpus template with a switch, the generation
prompt of one conversation rendered by mlxlis with `thinking_vars(t, False)` is byte-identical
to transformers' own renderer given the kwarg the model card documents for that family
(DOCUMENTED, written per file below), and the same for on; and the on and off prompts differ.
Which templates get which values is pinned (EXPECTED), and so are the templates that read a
switch's name but are left alone, with why (LEFT_ALONE). The command line's --no-think on a
Seed-OSS model gives transformers' prompt for thinking_budget=0.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import mlxlis
from mlxlis.prompt.reasoning_styles import PROBE_TOOLS
from mlxlis.prompt.template import ChatTemplate, builtin_template
from mlxlis.prompt.thinking_switch import SWITCHES, thinking_vars

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from fetch_references import reference_dir  # noqa: E402

CORPUS = reference_dir() / "templates"
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
# no system turn: one replaces Granite 3.3's thinking prompt
CONVERSATION = [
    {"role": "user", "content": "What is 2 × 3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "2 × 3 = 6.", "thinking": "6"},
    {"role": "user", "content": "And 3 × 4?"},
]
_Q3 = ({"enable_thinking": True}, {"enable_thinking": False})
_DS = ({"enable_thinking": True, "thinking": True}, {"enable_thinking": False, "thinking": False})
# what thinking_vars finds: file -> (on, off)
EXPECTED: dict[str, tuple[dict, dict]] = {
    "ByteDance-Seed-OSS.jinja": ({"thinking_budget": -1}, {"thinking_budget": 0}),
    "Cohere2MoE.jinja": (
        {"reasoning": True, "reasoning_effort": "high"},
        {"reasoning": False, "reasoning_effort": "none"},
    ),
    "Kimi-K3.jinja": ({"thinking": True}, {"thinking": False}),
    "MiniMax-M3.jinja": ({"thinking_mode": "enabled"}, {"thinking_mode": "disabled"}),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ({"thinking": True}, {"thinking": False}),
    "tencent-Hy3.jinja": ({"reasoning_effort": "high"}, {"reasoning_effort": "no_think"}),
    "upstage-Solar-Open-100B.jinja": (
        {"reasoning_effort": "high"},
        {"reasoning_effort": "minimal"},
    ),
    **dict.fromkeys(
        (
            "deepseek-ai-DeepSeek-V3.1.jinja",
            "deepseek-ai-DeepSeek-V3.2.jinja",
            "deepseek-ai-DeepSeek-V4.jinja",
            "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
        ),
        _DS,
    ),
    **dict.fromkeys(
        (
            "Apertus-8B-Instruct.jinja",
            "Bielik-11B-v3.0-Instruct.jinja",
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
            "GLM-4.6.jinja",
            "GLM-4.7-Flash.jinja",
            "HuggingFaceTB-SmolLM3-3B.jinja",
            "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
            "Qwen-QwQ-32B.jinja",
            "Qwen-Qwen3-0.6B.jinja",
            "Qwen3.5-4B.jinja",
            "Reka-Edge.jinja",
            "Spark2.5.jinja",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            "google-gemma-4-31B-it-interleaved.jinja",
            "google-gemma-4-31B-it.jinja",
            "inclusionai-ling-3.0-flash.jinja",
            "llama-cpp-rwkv-world.jinja",
            "openbmb-MiniCPM5-1B.jinja",
            "poolside-Laguna-S-2.1.jinja",
            "poolside-Laguna-XS-2.1.jinja",
            "poolside-Laguna-XS.2.jinja",
        ),
        _Q3,
    ),
}
# the kwargs the model cards document: file -> (on kwargs, off kwargs), each a list of
# spellings that must all give mlxlis' prompt; the rest use Qwen3's enable_thinking
DOCUMENTED: dict[str, tuple[list[dict], list[dict]]] = {
    # unlimited budget (-1, the template's default) / 0: "skip the thinking process"
    "ByteDance-Seed-OSS.jinja": ([{"thinking_budget": -1}], [{"thinking_budget": 0}]),
    "Cohere2MoE.jinja": (
        [{"reasoning": True}, {"reasoning_effort": "high"}],
        [{"reasoning": False}, {"reasoning_effort": "none"}],
    ),
    "Kimi-K3.jinja": ([{"thinking": True}], [{"thinking": False}]),
    "MiniMax-M3.jinja": ([{"thinking_mode": "enabled"}], [{"thinking_mode": "disabled"}]),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ([{"thinking": True}], [{"thinking": False}]),
    "tencent-Hy3.jinja": ([{"reasoning_effort": "high"}], [{"reasoning_effort": "no_think"}]),
    # "low" and "minimal" both put the empty reasoning message before the reply
    "upstage-Solar-Open-100B.jinja": (
        [{"reasoning_effort": "high"}],
        [{"reasoning_effort": "minimal"}, {"reasoning_effort": "low"}],
    ),
    # DeepSeek V3.1+: `thinking` (V4 takes enable_thinking as its alias)
    **dict.fromkeys(
        (
            "deepseek-ai-DeepSeek-V3.1.jinja",
            "deepseek-ai-DeepSeek-V3.2.jinja",
            "deepseek-ai-DeepSeek-V4.jinja",
            "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
        ),
        ([{"thinking": True}], [{"thinking": False}]),
    ),
}
# templates that read a switch's name and get no value for it, and why
LEFT_ALONE: dict[str, tuple[str, str]] = {
    "openai-gpt-oss-120b.jinja": (
        "reasoning_effort",
        'a level ("low", "medium", "high") printed as "Reasoning: <level>"; it has no off, and '
        '"none" would only print "Reasoning: none"',
    ),
    "deepseek-ai-DeepSeek-V4.jinja": (
        "reasoning_effort",
        'a level on top of `thinking` ("max" adds an effort paragraph); no value turns it off',
    ),
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": (
        "reasoning_effort",
        'a level on top of `thinking` ("high", "max" add effort paragraphs)',
    ),
}
# a read of a switch is its name as a bare identifier (not an attribute, not in quotes)
READS = re.compile(r"(?<![.\w'\"])(" + "|".join(SWITCHES) + r")\b")


@functools.cache
def template(name: str) -> ChatTemplate:
    path = CORPUS / name
    if not path.is_file():
        pytest.skip(f"{name}: llama.cpp references not fetched (scripts/fetch_references.py)")
    return ChatTemplate(source=name, text=path.read_text())


def mlxlis_prompt(t: ChatTemplate, switch: dict) -> tuple[str, list | None]:
    """The conversation's generation prompt and the tools it needed (None or PROBE_TOOLS)."""
    try:
        return t.render(CONVERSATION, tools=None, **SPECIALS, **switch), None
    except Exception:  # noqa: BLE001 - written for tool use: needs tools to render
        return t.render(CONVERSATION, tools=PROBE_TOOLS, **SPECIALS, **switch), PROBE_TOOLS


def transformers_prompt(text: str, tools: list | None, kwargs: dict) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template(
        [CONVERSATION],
        tools=tools,
        chat_template=text,
        add_generation_prompt=True,
        **SPECIALS,
        **kwargs,
    )
    return out[0]


def test_the_templates_with_a_switch_and_their_values():
    """thinking_vars finds exactly EXPECTED's values; every other corpus template gets none
    (one that never names a switch as a variable cannot read it, so it is not compiled)."""
    names = sorted(p.name for p in CORPUS.glob("*.jinja"))
    if not names:
        pytest.skip("llama.cpp references not fetched (scripts/fetch_references.py)")
    found = {}
    for name in names:
        if READS.search((CORPUS / name).read_text()):
            t = template(name)
            on, off = thinking_vars(t, True), thinking_vars(t, False)
            assert on.keys() == off.keys() and on.keys() <= t.variables, name
            if on:
                found[name] = (on, off)
    assert found == EXPECTED
    for name, (variable, _why) in LEFT_ALONE.items():
        t = template(name)
        assert variable in t.variables and variable not in thinking_vars(t, False), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_switch_renders_as_the_documented_kwarg(name):
    """On and off, mlxlis' prompt with thinking_vars is transformers' with the documented
    kwarg, byte for byte; and the two prompts differ."""
    t = template(name)
    on_docs, off_docs = DOCUMENTED.get(
        name, ([{"enable_thinking": True}], [{"enable_thinking": False}])
    )
    prompts = []
    for on, documented in ((True, on_docs), (False, off_docs)):
        prompt, tools = mlxlis_prompt(t, thinking_vars(t, on))
        for kwargs in documented:
            assert prompt == transformers_prompt(t.text, tools, kwargs), (name, on, kwargs)
        prompts.append(prompt)
    assert prompts[0] != prompts[1]


def test_off_prefers_the_value_that_shows_thinking_off():
    """Of two reasoning_effort values that change the prompt, the one whose prompt ends in an
    empty reasoning block is taken, though the other comes first; a level the template only
    prints is no switch."""
    t = ChatTemplate(
        "effort",
        "{{ messages[0].content }}{% if reasoning_effort == 'none' %} (terse){% endif %}"
        "{% if add_generation_prompt %}>{% if reasoning_effort == 'no_think' %}"
        "<think></think>{% else %}<think>{% endif %}{% endif %}",
    )
    assert thinking_vars(t, False) == {"reasoning_effort": "no_think"}
    assert thinking_vars(t, True) == {"reasoning_effort": "high"}
    level = ChatTemplate("level", "Reasoning: {{ reasoning_effort | default('medium') }}")
    assert thinking_vars(level, False) == thinking_vars(level, True) == {}


SEED = "ByteDance-Seed-OSS.jinja"


@pytest.fixture(scope="module")
def seed_model(tiny):
    """The tiny llama with Seed-OSS' template."""
    if not (CORPUS / SEED).is_file():
        pytest.skip("llama.cpp references not fetched (scripts/fetch_references.py)")
    return mlxlis.load(tiny("llama")[0], "float32", chat_template=str(CORPUS / SEED))


def test_cli_no_think_on_a_seed_oss_model(seed_model, tiny, capsys):
    """`--no-think` (chat_prompt, the one-shot command's prompt) on a model whose template is
    Seed-OSS' gives transformers' prompt for thinking_budget=0, and `--think` the one for the
    unlimited budget, with no note; a chat session does the same. ChatML has no switch: the
    note says so."""
    from mlxlis.commands.one_shot import chat_prompt

    from transformers.utils.chat_template_utils import render_jinja_template

    model, tok = seed_model, seed_model.tokenizer
    capsys.readouterr()  # what building the tiny model wrote
    assert model.supports_thinking
    messages = [{"role": "user", "content": "Hi"}]

    def reference(**kwargs) -> str:
        out, _ = render_jinja_template(
            [messages],
            chat_template=model.template.text,
            add_generation_prompt=True,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            **kwargs,
        )
        return out[0]

    off = reference(thinking_budget=0)
    assert chat_prompt(model, "Hi", thinking=False) == off
    assert "thinking budget is 0" in off and off != reference()
    assert chat_prompt(model, "Hi", thinking=True) == reference(thinking_budget=-1)
    assert capsys.readouterr().err == ""
    assert mlxlis.ChatSession(model, thinking=False).prompt_preview("Hi") == off
    chatml = mlxlis.load(tiny("llama")[0], "float32", chat_template="chatml")
    assert not chatml.supports_thinking and chatml.thinking_vars(False) == {}
    assert chat_prompt(chatml, "Hi", thinking=False) == chatml.render_chat(messages)
    assert "has no thinking switch" in capsys.readouterr().err
    assert builtin_template("chatml").variables.isdisjoint(SWITCHES)


def test_server_switches_on_a_seed_oss_model(seed_model):
    """Anthropic's `thinking` and `output_config.effort`, the Responses API's
    `reasoning.effort` and Ollama's `think` become Seed-OSS' thinking_budget."""
    from mlxlis.serve import anthropic, ollama_requests, responses
    from mlxlis.serve.responses_schemas import ResponsesRequest

    def body(cls, **fields):
        return cls.model_validate_json(json.dumps(fields))

    hi = [{"role": "user", "content": "Hi"}]
    ask = functools.partial(body, anthropic.CountTokensRequest, model="m", messages=hi)
    for req, budget in (
        (ask(thinking={"type": "disabled"}), 0),
        (ask(thinking={"type": "enabled", "budget_tokens": 1024}), -1),
        (ask(output_config={"effort": "low"}), 0),
    ):
        chat = anthropic.to_chat(req, seed_model)
        assert chat.chat_template_kwargs == {"thinking_budget": budget}
    assert anthropic.to_chat(ask(), seed_model).chat_template_kwargs is None
    for effort, budget in (("none", 0), ("high", -1)):
        req = body(ResponsesRequest, input="Hi", reasoning={"effort": effort})
        chat = responses.to_chat(req, [], seed_model)[0]
        assert chat.chat_template_kwargs == {"thinking_budget": budget}
    for think, budget in ((False, 0), (True, -1), ("high", -1)):
        req = body(ollama_requests.ChatRequest, model="m", messages=hi, think=think)
        chat = ollama_requests.to_chat(req, seed_model)
        assert chat.chat_template_kwargs == {"thinking_budget": budget}
        req = body(ollama_requests.GenerateRequest, model="m", prompt="Hi", think=think)
        chat = ollama_requests.generate_chat(req, seed_model)
        assert chat.chat_template_kwargs == {"thinking_budget": budget}
