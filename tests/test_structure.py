"""The package's shape: no import circles, the engine never imports the app, the app never
imports the CLI, and the family registry is consistent. Each module is imported first, alone,
in a fresh interpreter, so an import order that only works from one entry point fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlxlis.families import GGUF_ARCHS, HF_MODEL_TYPES, REGISTRY

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for pkg in ("mlxlis", "tui")
    for p in (ROOT / pkg).rglob("*.py")
)
PROBE = """
import sys
import {name}
loaded = set(sys.modules)
print(",".join(sorted(m for m in loaded if m.split(".")[0] in ("tui", "textual")
                      or m == "mlxlis.cli")))
"""


def _first_import(name: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(name=name)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, f"import {name} alone failed:\n{out.stderr[-2000:]}"
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("mlxlis")])
def test_engine_module_imports_alone_without_the_app(name: str):
    loaded = _first_import(name)
    assert not [m for m in loaded if m.split(".")[0] in ("tui", "textual")], loaded


def test_app_imports_alone_without_the_cli():
    for name in [m for m in MODULES if m.startswith("tui")]:
        assert "mlxlis.cli" not in _first_import(name), name


def test_registry_names_are_unique_and_complete():
    """Every family is reachable from its names, and no name is claimed twice."""
    types = [t for f in REGISTRY.values() for t in f.hf_model_types]
    archs = [a for f in REGISTRY.values() for a in f.gguf_archs]
    assert len(types) == len(set(types)) and len(archs) == len(set(archs))
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert all(HF_MODEL_TYPES[t] is spec for t in spec.hf_model_types)
        assert all(GGUF_ARCHS[a] is spec for a in spec.gguf_archs)
        assert HF_MODEL_TYPES[spec.export_model_type] is spec  # convert writes a name we read
