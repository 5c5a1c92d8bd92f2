"""LoadOptions is `mlxlis.load`'s keyword arguments, as the command line and the chat app
gather them: the same names and defaults as load's signature (read from it), and kwargs()
leaves a subclass's own fields (the app's Options) out."""

from __future__ import annotations

import inspect

from mlxlis.api import LoadOptions, load

from tui.engine import Options


def test_the_fields_are_loads_keywords_with_its_defaults():
    params = list(inspect.signature(load).parameters.values())[1:]  # after the reference
    assert LoadOptions().kwargs() == {p.name: p.default for p in params}


def test_the_apps_options_pass_only_loads_keywords():
    options = Options(model="m", dtype="float32", system="s", kv_bits=8, mmproj=False)
    assert options.kwargs() == {
        **LoadOptions().kwargs(),
        "dtype": "float32",
        "kv_bits": 8,
        "mmproj": False,
    }
