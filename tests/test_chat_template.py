"""mlxlis.prompt.template: transformers parity, discovery order, sandbox, missing-template
diagnosis.

The reference rendering is transformers' own `apply_chat_template(tokenize=False)` on a minimal
PreTrainedTokenizerFast whose chat_template (and bos/eos) we set. Real GGUF metadata is read with
gguf-py's GGUFReader (slow: ~10 s a file), kept in pytest's cache between runs.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from mlxlis.errors import TemplateError
from mlxlis.loading.gguf_split import read_gguf
from mlxlis.prompt.template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    builtin_template,
    diagnose_missing_template,
    discover_template,
    end_of_turn_tokens,
)

import pytest
from conftest import llama_cpp_reference, memory_bound, need_pulled

# Tokens the reference tokenizer carries for each template: (bos, eos).
SPECIALS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<bos>", "<eos>"),
    "llama2": ("<s>", "</s>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "smollm2-135m": ("<|im_start|>", "<|im_end|>"),
    "qwen2.5-coder-0.5b": ("<|endoftext|>", "<|im_end|>"),
}
SYSTEM = {"role": "system", "content": "You are terse. Ünïcødé ✓ <b>&</b>"}
ONE = [{"role": "user", "content": "What is coffee?"}]
THREE = [
    {"role": "user", "content": "  Hi there!  "},
    {"role": "assistant", "content": "Hello. How can I help?\n"},
    {"role": "user", "content": 'Say "quoted" things: {{ not a template }} 日本語'},
]
CONVERSATIONS = {"one": ONE, "three": THREE, "system+three": [SYSTEM, *THREE]}


def reference(text: str, messages: list[dict], agp: bool, bos: str, eos: str) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[unk]": 0}, unk_token="[unk]")),
        bos_token=bos,
        eos_token=eos,
    )
    tok.chat_template = text
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)


def assert_parity(template: ChatTemplate, specials: tuple[str, str]) -> None:
    bos, eos = specials
    for name, messages in CONVERSATIONS.items():
        for agp in (True, False):
            ours = template.render(
                messages, add_generation_prompt=agp, bos_token=bos, eos_token=eos
            )
            ref = reference(template.text, messages, agp, bos, eos)
            assert ours == ref, (template.source, name, agp)


@functools.cache
def gguf_facts(name: str) -> dict:
    """A real model's GGUF metadata as the loader passes it on (mlxlis's reader, whose parity
    with gguf-py's is test_gguf_reader's), plus its control/user-defined tokens as {token: id};
    skips when the model is not pulled."""
    with read_gguf(need_pulled(name)) as gf:
        meta = dict(gf.metadata)
    kinds = [int(k) for k in meta["tokenizer.ggml.token_type"]]
    tokens = meta["tokenizer.ggml.tokens"]
    special = {t: i for i, (t, k) in enumerate(zip(tokens, kinds, strict=True)) if k in (3, 4)}
    return {"meta": meta, "special": special}


@pytest.fixture
def facts():
    return gguf_facts


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_builtin_matches_transformers(name: str):
    """Each built-in renders 1- and 3-turn chats (with and without a system message, with and
    without the generation prompt) exactly as transformers' apply_chat_template does."""
    assert_parity(builtin_template(name), SPECIALS[name])


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_builtin_chatml_matches_official_chatml_templates(name: str, facts):
    """Reference parity of the built-in chatml with the official ChatML templates the models'
    authors ship (SmolLM2's and Qwen2.5's, from their GGUFs): the same text for every
    conversation that starts with a system message (without one, each injects its own default
    system prompt) and no tools, with and without the generation prompt. The other test only
    shows that transformers renders our file as we do; this one pins the file's text."""
    official = ChatTemplate(source=name, text=facts(name)["meta"]["tokenizer.chat_template"])
    ours = builtin_template("chatml")
    for messages in ([SYSTEM, *ONE], [SYSTEM, *THREE]):
        for agp in (True, False):
            assert ours.render(messages, add_generation_prompt=agp) == official.render(
                messages, add_generation_prompt=agp
            ), (name, messages, agp)


@pytest.mark.real
def test_builtin_gemma_matches_the_official_gemma_template():
    """Reference parity of the built-in gemma with Google's own Gemma 2 chat template (as
    llama.cpp keeps it, models/templates/google-gemma-2-2b-it.jinja) on conversations without
    a system message (Google's refuses one; ours folds it into the first user turn, as Gemma 3's
    official template does), with and without the generation prompt."""
    path = llama_cpp_reference("templates/google-gemma-2-2b-it.jinja")
    official = ChatTemplate(source=path.name, text=path.read_text())
    ours = builtin_template("gemma")
    for messages in (ONE, THREE):
        for agp in (True, False):
            kw = dict(add_generation_prompt=agp, bos_token="<bos>", eos_token="<eos>")
            assert ours.render(messages, **kw) == official.render(messages, **kw), (messages, agp)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_gguf_template_matches_transformers(name: str, facts):
    """The real GGUF templates (SmolLM2's, and Qwen2.5's with its injected default system
    prompt) render exactly as transformers renders them, for every conversation shape."""
    meta = facts(name)["meta"]
    template = discover_template(explicit=None, folder=None, gguf_metadata=meta, gguf_path=None)
    assert template is not None and template.source == "gguf:tokenizer.chat_template"
    assert_parity(template, SPECIALS[name])
    if name.startswith("qwen"):
        assert "You are Qwen" in template.render(ONE) and "You are Qwen" not in template.render(
            [SYSTEM, *ONE]
        )


def test_helpers_match_transformers():
    """tojson (no HTML escaping, non-ASCII kept, indent), namespace, loop controls, dict(),
    {% generation %}, tools/documents as none, and extra variables behave as in transformers."""
    text = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m | tojson }}|"
        "{{ m | tojson(indent=2) }}{% endfor %}{{ ns.n }}{{ tools is none }}{{ documents is none }}"
        "{{ dict(a=1) | tojson }}{% generation %}{{ eos_token }}{% endgeneration %}"
        "{{ enable_thinking is defined }}"
    )
    ours = ChatTemplate(source="t", text=text).render([SYSTEM, *THREE], eos_token="</s>")
    assert ours == reference(text, [SYSTEM, *THREE], True, "<s>", "</s>")
    assert "<b>&</b>" in ours and "Ünïcødé" in ours
    text = (  # loop variables, reverse walks, macros with caller, filters, string methods
        "{% macro wrap(r) %}[{{ r | upper }}:{{ caller() }}]{% endmacro %}"
        "{% for m in messages[::-1] if m.role != 'system' %}{% call wrap(m.role) %}"
        "{{ loop.index }}/{{ loop.length }}/{{ loop.revindex0 }}{{ loop.last }}"
        "{{ m.content.strip().split(' ')[0] | title }}{% endcall %}\n  {% endfor %}"
        "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content')"
        " | join('|') }}"
        "{{ (messages | length) is divisibleby 2 }}{{ bos_token ~ '%s-%d' | format('a', 3) }}"
    )
    ours = ChatTemplate(source="t", text=text).render([SYSTEM, *THREE], bos_token="<s>")
    assert ours == reference(text, [SYSTEM, *THREE], True, "<s>", "</s>")


def test_compiled_once():
    """A template's text is parsed and compiled once, however many ChatTemplates and renders."""
    from mlxlis.prompt import sandbox as chat_sandbox

    text = "{{ messages | length }} compiled-once"
    before = chat_sandbox.compile_template.cache_info().misses
    for _ in range(3):
        assert ChatTemplate(source="t", text=text).render(ONE) == "1 compiled-once"
    assert chat_sandbox.compile_template.cache_info().misses == before + 1


# ---------------------------------------------------------------- discovery


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_discovery_order(tmp_path: Path):
    """First found wins: --chat-template FILE|NAME › chat_template.jinja › tokenizer_config.json
    (string form) › GGUF metadata; each result reports where it came from."""
    gguf = {"tokenizer.chat_template": "GGUF{{ messages[0].content }}"}
    find = lambda **kw: discover_template(  # noqa: E731
        **{"explicit": None, "folder": tmp_path, "gguf_metadata": gguf, "gguf_path": None, **kw}
    )
    assert find().source == "gguf:tokenizer.chat_template"
    assert find(gguf_path=tmp_path / "m.gguf").file == str(tmp_path / "m.gguf")
    cfg = write(tmp_path / "tokenizer_config.json", json.dumps({"chat_template": "CFG"}))
    assert (find().source, find().text) == (str(cfg), "CFG")
    jinja = write(tmp_path / "chat_template.jinja", "JINJA")
    assert (find().source, find().text) == (str(jinja), "JINJA")
    explicit = write(tmp_path / "mine.jinja", "MINE")
    assert find(explicit=str(explicit)).source == f"{explicit} (--chat-template)"
    assert find(explicit="gemma").source == "builtin:gemma"
    assert find(explicit="chatml").text == builtin_template("chatml").text
    assert discover_template(explicit=None, folder=None, gguf_metadata=None, gguf_path=None) is None


def test_discovery_config_list_form_and_edge_cases(tmp_path: Path):
    """tokenizer_config.json's list form uses the "default" entry (and says so when there is
    none); a null or empty chat_template falls through to the GGUF; an explicit .json works."""
    cfg = tmp_path / "tokenizer_config.json"
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}]
    write(cfg, json.dumps({"chat_template": named}))
    found = discover_template(explicit=None, folder=tmp_path, gguf_metadata=None, gguf_path=None)
    assert (found.text, found.source, found.key) == ("DEF", str(cfg), "chat_template")
    assert (
        discover_template(explicit=str(cfg), folder=None, gguf_metadata=None, gguf_path=None).text
        == "DEF"
    )
    write(cfg, json.dumps({"chat_template": named[:1]}))
    with pytest.raises(TemplateError, match="tool_use.*'default'") as e:
        discover_template(explicit=None, folder=tmp_path, gguf_metadata=None, gguf_path=None)
    assert str(cfg) in str(e.value)
    for value in (None, ""):
        write(cfg, json.dumps({"chat_template": value}))
        gguf = {"tokenizer.chat_template": "G"}
        found = discover_template(
            explicit=None, folder=tmp_path, gguf_metadata=gguf, gguf_path=None
        )
        assert found.source == "gguf:tokenizer.chat_template"


def test_explicit_unknown_lists_builtins():
    """An --chat-template that is neither a file nor a built-in name is an error naming the
    built-ins (never a silent fallback)."""
    with pytest.raises(TemplateError) as e:
        discover_template(explicit="qwen9", folder=None, gguf_metadata=None, gguf_path=None)
    assert all(name in str(e.value) for name in BUILTIN_TEMPLATES)


# ---------------------------------------------------------------- the sandbox


# A work bound, not a clock: Python memory the render may allocate before the sandbox stops it.
# The worst payload here peaks at 56 MiB (a million "{{ i }}" pieces before the operation
# limit); without the sandbox the size bombs would allocate gigabytes.
SANDBOX_MEMORY = 128 << 20


def refuse(text: str, **kw) -> TemplateError:
    with memory_bound(SANDBOX_MEMORY, text[:60]):
        with pytest.raises(TemplateError) as e:
            ChatTemplate(source="payload.jinja", text=text).render(ONE, **kw)
    assert "payload.jinja" in str(e.value)
    return e.value


PAYLOADS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ ''['__class__'] }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {P}').read() }}",
    "{{ joiner.__init__.__globals__['__builtins__']['open']('{P}', 'w') }}",
    "{{ lipsum.__globals__['os'].system('touch {P}') }}",
    "{{ self }}",
    "{{ self.__init__.__globals__.__builtins__.open('{P}', 'w') }}",
    "{{ self._TemplateReference__context }}",
    "{{ config.__class__.__init__.__globals__['os'].popen('touch {P}') }}",
    "{{ config.items() }}",
    "{{ request.application.__globals__.__builtins__.__import__('os').popen('touch {P}') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ messages.append(1) }}",
    "{{ 'a' | attr('__class__') }}",
    "{{ messages | map(attribute='__class__') | list }}",
    "{{ '{0.__class__}'.format('') }}",
    "{% set ns = namespace(__x=1) %}",
    "{{ range(10**10) | length }}",
    "{{ 'x' * 10**10 }}",
    "{{ 10 ** 1000000 }}",
    "{{ 'x' | center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '{:>{}}'.format('x', 10**9) }}",
    "{{ messages | tojson(indent=10**9) }}",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_sandbox_refuses(payload: str, tmp_path: Path):
    """Attribute walking, mutation, huge ranges and size bombs raise TemplateError quickly and
    execute nothing: the file the payload tries to create never appears."""
    target = tmp_path / "pwned"
    refuse(payload.replace("{P}", str(target)))
    assert not target.exists()


def test_payloads_are_live_outside_the_sandbox(tmp_path: Path):
    """Control for the test above: in a plain (unsandboxed) jinja2 Environment the same file
    payloads do create the file, so "nothing was created" really means the sandbox stopped them."""
    import jinja2

    for payload in [p for p in PAYLOADS if "{P}" in p][:3]:
        target = tmp_path / "pwned"
        jinja2.Environment().from_string(payload.replace("{P}", str(target))).render()
        assert target.exists(), payload
        target.unlink()


@pytest.mark.parametrize(
    "payload",
    [
        # (with {{ i }} inside as well: the same operation bound, 14 s to reach on 2 cores)
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
        "{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}{{ ns.s }}",
        "{% set x %}{% for i in range(100000) %}{{ 'y' * 4000 }}{% endfor %}{% endset %}{{ x }}",
        "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    ],
)
def test_sandbox_stops_unbounded_work(payload: str):
    """Nested loops, doubling strings, captured output and runaway recursion stop with a
    TemplateError at one of the sandbox's bounds (operations, sizes, recursion depth), within
    the memory bound, instead of eating the CPU or memory."""
    message = str(refuse(payload))
    assert re.search(
        r"exceeded \d+ operations|over the limit|exceeded \d+ char|recursion", message
    ), message


def test_errors_name_source_and_line():
    """A syntax error, a runtime error and raise_exception all become TemplateErrors naming the
    template's source and the line."""
    with pytest.raises(TemplateError, match=r"payload\.jinja: .*line 3"):
        ChatTemplate(source="payload.jinja", text="a\nb\n{% for %}")
    e = refuse("ok\n\n{{ 1 // 0 }}")
    assert "line 3" in str(e) and "ZeroDivisionError" in str(e)
    e = refuse("x\n{{ raise_exception('Conversation roles must alternate') }}")
    assert "line 2" in str(e) and "Conversation roles must alternate" in str(e)
    gguf = {"tokenizer.chat_template": "{{ raise_exception('no') }}"}
    found = discover_template(
        explicit=None, folder=None, gguf_metadata=gguf, gguf_path=Path("m.gguf")
    )
    with pytest.raises(TemplateError, match=r"^m\.gguf: tokenizer\.chat_template: "):
        found.render(ONE)


# ---------------------------------------------------------------- missing-template diagnosis


@pytest.mark.real
def test_diagnose_base_model_gemma(facts):
    """gemma3-270m (a base model whose vocabulary still has Gemma's turn markers) is diagnosed
    as cause 1, with --no-chat first and --chat-template gemma as the named alternative."""
    meta = facts("gemma3-270m")["meta"]
    assert discover_template(explicit=None, folder=None, gguf_metadata=meta, gguf_path=None) is None
    text = diagnose_missing_template(model_name="gemma3-270m", folder=None, gguf_metadata=meta)
    first, *rest = text.splitlines()
    assert "base" in first and "gemma3-270m" in first and "Cause 1 of 4" in text
    ways = text[text.index("Ways out") :]
    assert ways.index("--no-chat") < ways.index("--chat-template gemma")


def test_diagnose_instruct_without_template():
    """A name saying Instruct, with no template and no family markers, is cause 3."""
    text = diagnose_missing_template(model_name="Foo-7B-Instruct", folder=None, gguf_metadata=None)
    assert "instruction-tuned" in text.splitlines()[0] and "Cause 3 of 4" in text
    assert "--chat-template PATH" in text and "--no-chat" in text


def test_diagnose_template_not_downloaded(tmp_path: Path):
    """A folder whose tokenizer_config.json refers to an absent chat_template.jinja is cause 2
    (fetch the file), even though the folder name says Instruct."""
    folder = tmp_path / "Bar-3B-Instruct"
    folder.mkdir()
    write(
        folder / "tokenizer_config.json", json.dumps({"chat_template_file": "chat_template.jinja"})
    )
    text = diagnose_missing_template(model_name="bar", folder=folder, gguf_metadata=None)
    assert "not downloaded" in text.splitlines()[0] and "Cause 2 of 4" in text
    assert "chat_template.jinja" in text and "fetch" in text


def test_diagnose_clone_of_known_family():
    """A non-instruct name whose vocabulary defines <|im_start|> is a clone of a ChatML family
    (cause 4), and the way out names --chat-template chatml."""
    meta = {"general.name": "Mystery 1B", "tokenizer.ggml.tokens": ["<unk>", "<|im_start|>", "a"]}
    text = diagnose_missing_template(model_name="mystery-1b", folder=None, gguf_metadata=meta)
    assert "finetune" in text.splitlines()[0] and "Cause 4 of 4" in text
    assert "--chat-template chatml" in text and "--no-chat" in text


# ---------------------------------------------------------------- end-of-turn tokens


@pytest.mark.real
@pytest.mark.parametrize(
    "name,marker", [("smollm2-135m", "<|im_end|>"), ("qwen2.5-coder-0.5b", "<|im_end|>")]
)
def test_end_of_turn_real_templates(name: str, marker: str, facts):
    """The real GGUF templates end turns with <|im_end|>, which their vocabularies define."""
    got = facts(name)
    text = got["meta"]["tokenizer.chat_template"]
    assert end_of_turn_tokens(text, got["special"]) == [got["special"][marker]]


@pytest.mark.real
def test_end_of_turn_builtins_on_real_vocab(facts):
    """Gemma's built-in ends turns with <end_of_turn> (id 106 in gemma3-270m's vocabulary);
    chatml with <|im_end|> in SmolLM2's; a template emitting eos_token (Llama 2) reports it."""
    gemma = facts("gemma3-270m")["special"]
    assert end_of_turn_tokens(builtin_template("gemma").text, gemma) == [106]
    assert end_of_turn_tokens(builtin_template("chatml").text, gemma) == []
    smol = facts("smollm2-135m")["special"]
    assert end_of_turn_tokens(builtin_template("chatml").text, smol) == [2]
    vocab = {"<s>": 1, "</s>": 2, "<|eot_id|>": 9}
    assert end_of_turn_tokens(builtin_template("llama2").text, vocab, eos_token="</s>") == [2]
    assert end_of_turn_tokens(builtin_template("llama3").text, vocab) == [9]
