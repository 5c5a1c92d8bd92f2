"""mlxlis/settings.py against its documentation and the code: docs/environment.md's table names
exactly the variables of the code's table; Settings has one field per mlxlis variable with the
same default; values parse, and a bad one is an error naming its variable; no module outside
settings.py reads a mlxlis variable itself, and the native rows are what the C/C++ code reads;
the backend is chosen from the device and the settings alone."""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

from mlxlis.errors import ConfigError, LayersSplitError, MlxlisError
from mlxlis.runtime import backend
from mlxlis.settings import DEVELOPMENT, HONOURED, NATIVE, VARS, Settings, reload, settings

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environment.md"


def documented() -> set[str]:
    """The variables the first column of the doc's table names (a cell may name several)."""
    names = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_the_documented_table_names_every_variable_and_no_other():
    code = [v.name for v in (*VARS, *NATIVE, *DEVELOPMENT, *HONOURED)]
    assert len(code) == len(set(code)), "a variable in two rows"
    assert documented() == set(code)


def test_the_readme_links_the_table():
    assert "docs/environment.md" in (ROOT / "README.md").read_text()


def test_settings_has_one_field_per_variable_with_its_default():
    assert [(f.name, f.default) for f in fields(Settings)] == [(v.field, v.default) for v in VARS]
    assert all(v.field is None for v in (*NATIVE, *DEVELOPMENT, *HONOURED))
    assert Settings.from_env({}) == Settings()


def test_values_parse():
    got = Settings.from_env(
        {
            "MLXLIS_MODELS": "/m",
            "MLXLIS_LMSTUDIO_MODELS": "/a:/b",
            "MLXLIS_DEVICE": "GPU",
            "MLXLIS_MAX_MEMORY": "1.5G",
            "MLXLIS_LAYERS_SPLIT": "14, 10",
            "MLXLIS_RANK_TIMEOUT": "2.5",
            "MLXLIS_BLAS": "Wheel",
            "MLXLIS_NO_OPENBLAS": "1",
            "MLXLIS_FUSED": "0",
            "MLXLIS_FAST_MATH": "off",
            "MLXLIS_BLAS_GEMV": "false",
            "MLXLIS_MALLOC_TUNE": "1",
            "MLXLIS_API_KEY": "k",
        }
    )
    assert got == replace(
        Settings(),
        models=Path("/m"),
        lmstudio_models=(Path("/a"), Path("/b")),
        device="gpu",
        max_memory=3 << 29,
        layers_split=(14, 10),
        rank_timeout=2.5,
        blas="wheel",
        no_openblas=True,
        fused=False,
        fast_math=False,
        blas_gemv=False,
        api_key="k",
    )
    # empty is unset, except for the LM Studio folders, where it lists none
    assert Settings.from_env({"MLXLIS_FUSED": "", "MLXLIS_MODELS": ""}) == Settings()
    assert Settings.from_env({"MLXLIS_LMSTUDIO_MODELS": ""}).lmstudio_models == ()


@pytest.mark.parametrize(
    "name,value,error",
    [
        ("MLXLIS_DEVICE", "tpu", ConfigError),
        ("MLXLIS_MAX_MEMORY", "lots", ConfigError),
        ("MLXLIS_RANK_TIMEOUT", "-1", ConfigError),
        ("MLXLIS_RANK_TIMEOUT", "nan", ConfigError),
        ("MLXLIS_BLAS", "mkl", ConfigError),
        ("MLXLIS_FUSED", "maybe", ConfigError),
        ("MLXLIS_BUILD_KERNELS", "2", ConfigError),
        ("MLXLIS_LAYERS_SPLIT", "14,0", LayersSplitError),
    ],
)
def test_a_bad_value_names_its_variable(name, value, error):
    with pytest.raises(error) as e:
        Settings.from_env({name: value})
    assert isinstance(e.value, MlxlisError) and e.value.field == name
    assert str(e.value).startswith(f"{name}: ")


def test_read_once_and_again_after_reload(monkeypatch):
    before = settings()
    assert settings() is before  # cached
    monkeypatch.setenv("MLXLIS_RANK_TIMEOUT", "7")  # conftest's fixture reloads
    assert settings().rank_timeout == 7.0
    monkeypatch.setenv("MLXLIS_RANK_TIMEOUT", "x")
    with pytest.raises(ConfigError, match="MLXLIS_RANK_TIMEOUT"):
        settings()
    monkeypatch.delenv("MLXLIS_RANK_TIMEOUT")
    reload()
    assert settings().rank_timeout == 30.0


def sources(*suffixes: str):
    for top in ("mlxlis", "tui"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in suffixes:
                yield path


def test_only_settings_reads_mlxlis_variables():
    """os.environ / getenv with a mlxlis name appear only in settings.py (the CLI's chat command
    writes MLXLIS_LAYERS_SPLIT for its loader, then reloads)."""
    name = r"""["'](MLXLIS|QMV)_[A-Z0-9_]+["']"""
    read = re.compile(rf"(environ\.get\(|getenv\(){name}|environ\[{name}\](?!\s*=)")
    readers = [
        p.relative_to(ROOT).as_posix()
        for p in sources(".py")
        if p.name != "settings.py" and read.search(p.read_text())
    ]
    assert readers == []


def test_the_native_rows_are_what_the_compiled_code_reads():
    read = set()
    for path in sources(".c", ".cpp", ".h", ".cc"):
        read |= set(re.findall(r'getenv\("([A-Z0-9_]+)"\)', path.read_text()))
    assert read == {v.name for v in NATIVE}


def test_the_backend_is_chosen_from_the_device_and_settings():
    on = Settings()
    assert isinstance(backend.choose("metal", on), backend.MLX)
    assert isinstance(backend.choose("cuda", on), backend.MLX)
    off = replace(on, fused=False, fast_math=False)
    assert type(backend.choose("cpu", off)) is backend.MLX
    cpu = backend.choose("cpu", replace(on, fast_math=False))
    assert isinstance(cpu, backend.CPU) and cpu.nodes and not cpu.fast_math
    assert backend.select("cpu", off) is backend.current()


def test_the_cli_refuses_a_bad_value_in_one_line(monkeypatch, capsys):
    from mlxlis.commands.cli import main

    monkeypatch.setenv("MLXLIS_RANK_TIMEOUT", "soon")
    assert main(["inspect", "nothing"]) == 2
    assert "mlxlis: error: MLXLIS_RANK_TIMEOUT: " in capsys.readouterr().err
