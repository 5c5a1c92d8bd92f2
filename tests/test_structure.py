"""The package's shape, read from the source: every import of every module (those inside
functions and under TYPE_CHECKING too) resolved to the module it names, then no import circle
between modules, and no module importing a layer above its own (the order the layer table of
docs/architecture.md declares); the app never imports the CLI; the family registry is
consistent, and docs/models.md's family table names what it reads.

Not an import of each module in a fresh interpreter: without circles, no import order can
fail, and this reads 100-odd modules in well under a second."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

from mlxlis.models import GGUF_ARCHS, HF_MODEL_TYPES, REGISTRY

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# bottom to top: a module may import its own layer and the ones below (docs/architecture.md)
LAYERS = (
    ("errors", ("mlxlis.errors", "mlxlis.limits", "mlxlis.bounded", "mlxlis.settings")),
    ("runtime", ("mlxlis.runtime",)),
    ("tokenizer", ("mlxlis.tokenizer",)),
    ("prompt", ("mlxlis.prompt",)),
    ("loading", ("mlxlis.loading",)),
    ("cache", ("mlxlis.cache",)),
    ("models", ("mlxlis.models",)),
    ("generation", ("mlxlis.generation",)),
    ("distributed", ("mlxlis.distributed",)),
    ("api", ("mlxlis.api", "mlxlis")),
    ("surfaces", ("mlxlis.commands", "mlxlis.serve", "mlxlis.__main__", "tui")),
)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(p): p for pkg in ("mlxlis", "tui") for p in (ROOT / pkg).rglob("*.py")}


def imports(name: str) -> set[str]:
    """The project modules `name` imports, anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import sub` names the submodule when there is one
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import a.b.c` where c is an attribute
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def layer(name: str) -> int:
    best = max(
        (
            (i, len(p))
            for i, (_, prefixes) in enumerate(LAYERS)
            for p in prefixes
            if name == p or name.startswith(p + ".")
        ),
        key=lambda x: x[1],
        default=None,
    )
    assert best is not None, (
        f"{name} belongs to no layer: add it to LAYERS and docs/architecture.md"
    )
    return best[0]


def cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_imports_inside_functions():
    """The graph is the source's: an import inside a function body counts (the CLI imports the
    app's entry point only when `mlxlis chat` runs)."""
    assert "tui.app" in GRAPH["mlxlis.commands.cli"]
    assert "mlxlis.runtime.blas" in GRAPH["mlxlis"]


def test_no_import_circles():
    assert cycles() == []


def test_no_layer_imports_a_layer_above_it():
    bad = sorted(
        f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})"
        for a, deps in GRAPH.items()
        for b in deps
        if layer(b) > layer(a)
    )
    assert bad == []


def test_the_app_never_imports_the_cli():
    assert not [m for m in MODULES if m.startswith("tui") and "mlxlis.commands.cli" in GRAPH[m]]


def test_the_generation_core_knows_no_launcher():
    """The core and its drivers import nothing of mlx.launch (the distributed layer, or MLX's
    own distributed module)."""
    for name, path in MODULES.items():
        if name.startswith("mlxlis.generation"):
            assert "mx.distributed" not in path.read_text(), name


# declared but never imported, and why
NOT_IMPORTED = {
    "scipy-openblas32": "loaded by path before mlx.core (runtime/blas.py)",
    "protobuf": "sentencepiece's model proto module needs it",
    "accelerate": "transformers' GGUF loader needs it (the tests' references)",
    "ruff": "`make lint`",
}
# imported only where installed, each import guarded (the benchmarks: xgrammar), or by a
# script run by hand from a folder of its own (mistral_common pins an older numpy: the
# Voxtral processor check, scripts/voxtral_processor_check.py)
OPTIONAL = {"xgrammar", "mistral_common"}


def third_party(paths: list[Path]) -> set[str]:
    """Top-level names of the third-party modules `paths` import."""
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {
        p.stem for p in (ROOT / "scripts").glob("*.py")
    }
    out = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            out |= {n.split(".")[0] for n in names}
    return (
        {n for n in out if n not in sys.stdlib_module_names}
        - local
        - {"mlxlis", "tui", "__future__"}
    )


def provided(requirements: list[str]) -> dict[str, set[str]]:
    """Each requirement's distribution -> the top-level modules it installs."""
    modules = importlib.metadata.packages_distributions()
    out: dict[str, set[str]] = {}
    for req in requirements:
        dist = re.split(r"[\[<>=;! ]", req, maxsplit=1)[0]
        key = dist.lower().replace("_", "-")
        out[key] = {
            m for m, ds in modules.items() if any(d.lower().replace("_", "-") == key for d in ds)
        }
    return out


def test_dependencies_match_imports():
    """The runtime dependencies are what mlxlis and the app import (each one imported, or
    said why not); the test extra holds what only the tests and scripts import; nothing
    imported is undeclared."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime = provided(project["dependencies"])
    optional = provided(extras["convert"])  # `mlxlis convert` from a GGUF
    tests = provided(extras["test"])
    engine = third_party([p for n, p in MODULES.items()])
    scripts = [*ROOT.glob("tests/*.py"), *ROOT.glob("scripts/*.py")]
    used_by_tests = third_party(scripts) - OPTIONAL
    declared = set().union(*runtime.values(), *optional.values())
    assert engine - declared == set(), "imported by mlxlis/tui, not a dependency"
    assert used_by_tests - declared - set().union(*tests.values()) == set(), "not in [test]"
    unused = {d for d, mods in runtime.items() if not mods & engine and d not in NOT_IMPORTED}
    assert unused == set(), "runtime dependencies mlxlis never imports"
    test_only = {
        d for d, mods in tests.items() if not mods & used_by_tests and d not in NOT_IMPORTED
    }
    assert test_only == set(), "test dependencies no test imports"
    runtime_in_tests = {d for d, mods in tests.items() if mods & engine and d not in optional}
    assert runtime_in_tests == set(), "imported by mlxlis, declared only for the tests"


def test_registry_names_are_unique_and_complete():
    """Every family is reachable from its names, and no name is claimed twice."""
    types = [t for f in REGISTRY.values() for t in f.hf.model_types]
    archs = [a for f in REGISTRY.values() for a in f.gguf.archs]
    assert len(types) == len(set(types)) and len(archs) == len(set(archs))
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert all(HF_MODEL_TYPES[t] is spec for t in spec.hf.model_types)
        assert all(GGUF_ARCHS[a] is spec for a in spec.gguf.archs)
        assert HF_MODEL_TYPES[spec.export.model_type] is spec  # convert writes a name we read


def table_rows(page: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table under `## heading` in `page` (header and rule
    left out)."""
    section = (ROOT / page).read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]


def test_the_family_table_lists_every_name():
    """Every config.json model_type and GGUF architecture the registry reads is in the
    family table of docs/models.md (and the table names no other)."""
    rows = [r[1:3] for r in table_rows("docs/models.md", "Families")]
    types = {t for cell, _ in rows for t in re.findall(r"`([^`]+)`", cell)}
    archs = {a for _, cell in rows for a in re.findall(r"`([^`]+)`", cell)}
    assert types == set(HF_MODEL_TYPES)
    assert archs == set(GGUF_ARCHS)


def test_the_architecture_page_lists_the_layers_in_order():
    """The layer table of docs/architecture.md names LAYERS, bottom to top, in their order."""
    assert [r[0] for r in table_rows("docs/architecture.md", "Layers")] == [n for n, _ in LAYERS]


# ---------------------------------------------------------------- a family is one unit

PREFIX = "mlxlis.models."


def _family_modules() -> dict[str, list[str]]:
    """Each module of mlxlis.models that defines a Family (`X = Family(name=…)`) -> the names
    of the families it defines."""
    out: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if not name.startswith(PREFIX):
            continue
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, ast.Assign) else None
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Family":
                fam = next(k.value.value for k in call.keywords if k.arg == "name")
                out.setdefault(name, []).append(fam)
    return out


DEFINES = _family_modules()
UNIT_OF_FAMILY = {f: m for m, fams in DEFINES.items() for f in fams}


def unit(module: str) -> str | None:
    """The family unit a module belongs to: the module defining the family whose name is the
    longest prefix of the module's (gemma4_net -> gemma4's, gemma3_vision -> gemma's), or
    None for the shared modules (the library, the engine)."""
    if not module.startswith(PREFIX):
        return None
    short = module.removeprefix(PREFIX)
    names = [f for f in UNIT_OF_FAMILY if short == f or short.startswith(f + "_")]
    return UNIT_OF_FAMILY[max(names, key=len)] if names else None


# Modules outside a family's unit whose code holds a family's name, each with why: formats
# that share a word with a family name (tokenizer kinds, chat-template and tool-call formats)
# and the catalog's rows. They name a format or a row of data, not a family's code.
NAMES_FAMILIES = {
    "mlxlis.prompt.diagnosis": "chat-template formats (gemma's turn markers)",
    "mlxlis.prompt.template": "chat-template formats (gemma's turn markers)",
    "mlxlis.prompt.reasoning_styles": "reasoning formats named for who writes them",
    "mlxlis.prompt.tool_formats.base": "tool-call argument syntaxes (gemma4's)",
    "mlxlis.prompt.tool_formats.partial": "tool-call argument syntaxes (gemma4's)",
    "mlxlis.prompt.tool_formats.json_calls": "tool-call formats named for who writes them",
    "mlxlis.prompt.tool_formats.table": "tool-call formats named for who writes them",
    "mlxlis.prompt.tool_formats.xml_calls": "tool-call formats named for who writes them",
    "mlxlis.generation.tool_grammar.lark": "tool-call argument syntaxes (gemma4's)",
    "mlxlis.generation.tool_grammar.values": "tool-call argument syntaxes (gemma4's)",
    "mlxlis.tokenizer.gguf": "GGUF tokenizer kinds and pre-tokenizers (llama.cpp's names)",
    "mlxlis.tokenizer.tokenizer": "GGUF tokenizer kinds (llama.cpp's names)",
    "mlxlis.tokenizer.gguf_encoder": "GGUF tokenizer kinds (llama.cpp's names: its modern-bert "
    "files say gpt2 and mean byte-level BPE with an encoder's post-processor)",
}


def _names_a_family(module: str) -> list[str]:
    """What in `module`'s code names a family: an import of a unit's module, a string that is
    a registered family name, config.json model_type or GGUF architecture (docstrings
    aside), or a class only a unit defines."""
    words = set(REGISTRY) | set(HF_MODEL_TYPES) | set(GGUF_ARCHS)
    tree = ast.parse(MODULES[module].read_text())
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    found = [f"imports {t}" for t in sorted(GRAPH[module]) if unit(t)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in words and id(node) not in docs:
            found.append(f"line {node.lineno}: {node.value!r}")
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(node, (ast.Name, ast.Attribute)) and name in UNIT_CLASSES:
            found.append(f"line {node.lineno}: {name}")
    return found


def _classes(modules) -> set[str]:
    return {
        n.name
        for m in modules
        for n in ast.walk(ast.parse(MODULES[m].read_text()))
        if isinstance(n, ast.ClassDef)
    }


UNIT_CLASSES = _classes(m for m in MODULES if unit(m)) - _classes(m for m in MODULES if not unit(m))


def test_no_module_outside_a_family_names_a_family():
    """A family's config, network, formats and description live in its unit: the engine and
    the shared library name no family (the registry, mlxlis.models itself, lists them)."""
    outside = [m for m in MODULES if unit(m) is None and m != "mlxlis.models"]
    named = {m: hits for m in outside if (hits := _names_a_family(m))}
    assert set(named) <= set(NAMES_FAMILIES), {
        m: hits for m, hits in named.items() if m not in NAMES_FAMILIES
    }
    stale = set(NAMES_FAMILIES) - set(named)
    assert not stale, f"no longer names a family: take it off NAMES_FAMILIES: {sorted(stale)}"


def test_no_family_imports_another_familys_private_names():
    """A family composes the library and, at most, another family's public names."""
    bad = []
    for module in MODULES:
        mine = unit(module)
        if mine is None:
            continue
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            other = unit(node.module)
            if other is not None and other != mine:
                bad += [
                    f"{module}: {a.name} from {node.module}" for a in node.names if a.name[0] == "_"
                ]
    assert bad == []


def test_the_unit_reader_finds_every_family():
    """Self-check of the two tests above: every registered family has a unit, and the units
    are the modules the families' names lead to."""
    assert set(UNIT_OF_FAMILY) == set(REGISTRY)
    assert unit("mlxlis.models.gemma4_net") == unit("mlxlis.models.gemma4") == PREFIX + "gemma4"
    assert unit("mlxlis.models.gemma3_vision") == PREFIX + "gemma"
    assert unit("mlxlis.models.qwen3_5_mtp") == PREFIX + "qwen3_5"
    assert unit("mlxlis.models.decoder") is None and unit("mlxlis.models.reading") is None
