"""Hub references and file selection, without a server: how `ORG/NAME[:QUANT | /FILE.gguf]
[@REV]` is read, which files of a repo listing a reference fetches, and the progress lines."""

from __future__ import annotations

import io
from pathlib import Path

from mlxlis.errors import AmbiguousModelError, HubError, ModelNotFoundError
from mlxlis.loading.hub import display_name
from mlxlis.loading.hub.progress import StderrProgress, done_line, progress_line
from mlxlis.loading.hub.refs import HubRef, parse_ref
from mlxlis.loading.hub.select import choice, gguf_models, quant_label, select

import pytest


@pytest.mark.parametrize(
    "text,expected",
    [
        ("mlx-community/Qwen3-4B-4bit", HubRef("mlx-community/Qwen3-4B-4bit")),
        (
            "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
            HubRef("bartowski/Llama-3.2-3B-Instruct-GGUF", quant="Q4_K_M"),
        ),
        (
            "org/repo/sub/m-Q8_0-00001-of-00002.gguf",
            HubRef("org/repo", filename="sub/m-Q8_0-00001-of-00002.gguf"),
        ),
        ("org/repo@v1.0", HubRef("org/repo", revision="v1.0")),
        ("org/repo:q4_k_m@" + "a" * 40, HubRef("org/repo", quant="q4_k_m", revision="a" * 40)),
        ("org/repo@refs/pr/3:Q8_0", HubRef("org/repo", quant="Q8_0", revision="refs/pr/3")),
        # not references: paths, bare names, malformed repo ids
        ("./org/repo", None),
        ("/abs/path", None),
        ("~/models/x", None),
        ("model.gguf", None),
        ("smollm2-135m", None),
        ("org/x.gguf", None),
        ("org/repo/notes.txt", None),
        ("org--x/repo", None),
        ("-org/repo", None),
        ("org/repo@", None),
        ("org/re po", None),
        ("org/repo@a..b", None),
        ("org/repo/../x.gguf", None),
    ],
)
def test_parse_ref(text, expected):
    """Each reference form parses to its repo, quant, file and revision (the quant may come
    before or after @REV, a git ref holds no ':'); paths, catalog names and strings the Hub
    would refuse as repo ids are not references (None: resolve then says no such file)."""
    assert parse_ref(text) == expected
    if expected is not None:
        assert parse_ref(str(expected)) == expected  # str() is a reference to the same thing


def test_a_file_and_a_quant_together_is_an_error():
    """`ORG/NAME/FILE.gguf:QUANT` names one model twice: an error, not a guess."""
    with pytest.raises(ModelNotFoundError, match="not both"):
        parse_ref("org/repo/m-Q8_0.gguf:Q4_K_M")


HF_REPO = {  # a transformers repo as the Hub lists it
    "config.json": 700,
    "generation_config.json": 100,
    "tokenizer.json": 9000,
    "tokenizer_config.json": 300,
    "special_tokens_map.json": 90,
    "chat_template.jinja": 900,
    "model-00001-of-00002.safetensors": 5,
    "model-00002-of-00002.safetensors": 5,
    "model.safetensors.index.json": 60,
    "consolidated.safetensors": 10,
    "pytorch_model.bin": 10,
    "README.md": 5,
    "figure.png": 5,
    "onnx/model.onnx": 5,
    "original/model.safetensors": 5,
    ".gitattributes": 1,
}

GGUF_REPO = {
    "README.md": 1,
    "m-Q4_K_M.gguf": 1,
    "m-Q4_K_S.gguf": 1,
    "m-IQ4_XS.gguf": 1,
    "m-Q8_0.gguf": 1,
    "mmproj-m-f16.gguf": 1,
    "m-BF16/m-BF16-00001-of-00002.gguf": 1,
    "m-BF16/m-BF16-00002-of-00002.gguf": 1,
}


def test_safetensors_repo_takes_the_index_shards_and_the_folder_files():
    """A safetensors repo with an index: first the index alone, then exactly its shards plus
    config, generation, tokenizer and template files; never the pickles, README, images, ONNX,
    subfolders nor a consolidated.safetensors the index does not list."""
    ref = HubRef("org/m")
    first = select(ref, HF_REPO)
    assert first.needs_index and first.files == ("model.safetensors.index.json",)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    sel = select(ref, HF_REPO, shards)
    assert sel.kind == "safetensors" and sel.target == ""
    assert set(sel.files) == {
        *shards,
        "model.safetensors.index.json",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
    with pytest.raises(HubError, match="lists model-00003-of-00003.safetensors, which the repo"):
        select(ref, HF_REPO, ["model-00003-of-00003.safetensors"])
    single = select(ref, {"config.json": 1, "model.safetensors": 1, "tokenizer.model": 1})
    assert set(single.files) == {"config.json", "model.safetensors", "tokenizer.model"}


def test_gguf_quant_selection_and_ambiguity():
    """`:QUANT` matches one model's file name case-insensitively and whole (Q4_K is not
    Q4_K_M, Q4_XS is not IQ4_XS); a split model is all its parts; no quant among several
    models lists every choice; mmproj files are never models, but the one beside the model
    comes with it (the repo's top one for a model in a folder of its own)."""
    ref = HubRef("org/m-GGUF", quant="q4_k_m")
    sel = select(ref, GGUF_REPO)
    assert (sel.kind, sel.files, sel.target, sel.label) == (
        "gguf",
        ("m-Q4_K_M.gguf", "mmproj-m-f16.gguf"),
        "m-Q4_K_M.gguf",
        "Q4_K_M",
    )
    bf16 = select(HubRef("org/m-GGUF", quant="BF16"), GGUF_REPO)
    assert bf16.files == (
        "m-BF16/m-BF16-00001-of-00002.gguf",
        "m-BF16/m-BF16-00002-of-00002.gguf",
        "mmproj-m-f16.gguf",
    )
    by_file = select(HubRef("org/m-GGUF", filename="m-BF16/m-BF16-00002-of-00002.gguf"), GGUF_REPO)
    assert by_file.files == bf16.files and by_file.target == bf16.target
    with pytest.raises(AmbiguousModelError) as e:
        select(HubRef("org/m-GGUF"), GGUF_REPO)
    msg = str(e.value)
    for q in ("Q4_K_M", "Q4_K_S", "IQ4_XS", "Q8_0", "BF16"):
        assert f"org/m-GGUF:{q}" in msg
    assert "mmproj" not in msg and "\n" not in msg
    for missing in ("Q4_K", "Q4_XS", "Q6_K"):
        with pytest.raises(HubError, match=f"carries {missing}; choices: org/m-GGUF:"):
            select(HubRef("org/m-GGUF", quant=missing), GGUF_REPO)
    only = select(HubRef("org/one"), {"m-Q8_0.gguf": 1, "mmproj-f16.gguf": 1, "README.md": 1})
    assert only.files == ("m-Q8_0.gguf", "mmproj-f16.gguf")  # a single model needs no quant
    # several projectors: the one nearest the model's precision, as llama.cpp's -hf picks
    projs = {"mmproj-F32.gguf": 1, "mmproj-F16.gguf": 1, "mmproj-Q8_0.gguf": 1}
    for quant, proj in (("Q4_K_M", "mmproj-Q8_0.gguf"), ("BF16", "mmproj-F16.gguf")):
        listing = {f"m-{quant}.gguf": 1, "m-F32.gguf": 1, **projs}
        assert select(HubRef("org/m", quant=quant), listing).files[-1] == proj
    assert select(HubRef("org/m", quant="F32"), {"m-F32.gguf": 1, **projs}).files[-1] == (
        "mmproj-F32.gguf"
    )
    assert select(HubRef("org/m"), {"m-Q8_0.gguf": 1}).files == ("m-Q8_0.gguf",)
    text_only = select(HubRef("org/m", quant="F32"), {"m-F32.gguf": 1, **projs}, vision=False)
    assert text_only.files == ("m-F32.gguf",)  # --no-mmproj: the projector not fetched


def test_repos_without_loadable_weights_say_why():
    """Pickles only, safetensors without config.json, a quant asked of a safetensors repo, a
    split with a part missing: each a one-line error saying what the repo lacks."""
    with pytest.raises(HubError, match="only pickled PyTorch files .pytorch_model.bin"):
        select(HubRef("org/m"), {"config.json": 1, "pytorch_model.bin": 1})
    with pytest.raises(HubError, match="no config.json"):
        select(HubRef("org/m"), {"model.safetensors": 1})
    with pytest.raises(HubError, match="no GGUF file; open its safetensors as org/m"):
        select(HubRef("org/m", quant="Q4_0"), {"config.json": 1, "model.safetensors": 1})
    with pytest.raises(HubError, match="has 1 of its 2 parts"):
        select(HubRef("org/m"), {"m-00001-of-00002.gguf": 1})


def test_quant_labels_and_choice_names():
    """The quant a file name carries, as uploaders write it; choices fall back to the file
    path when two models carry the same quant."""
    assert [
        quant_label(n)
        for n in (
            "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
            "m.IQ2_XXS.gguf",
            "x-UD-Q3_K_XL.gguf",
            "q8_0.gguf",
            "gpt-oss-20b-MXFP4.gguf",
            "plain.gguf",
        )
    ] == ["Q4_K_M", "IQ2_XXS", "Q3_K_XL", "Q8_0", "MXFP4", None]
    models = gguf_models(["a-Q8_0.gguf", "b-Q8_0.gguf", "c-F16.gguf"])
    assert [choice("o/r", m, models) for m in models] == [
        "o/r/a-Q8_0.gguf",
        "o/r/b-Q8_0.gguf",
        "o/r:F16",
    ]


def test_progress_lines_and_log_output():
    """A running download shows bytes of total, speed and ETA; a finished one its size, time
    and speed; in a log (no terminal) a big file gets a start line and every file a done
    line, and nothing is rewritten in place."""
    assert progress_line("m.gguf", 12_300_000, 45_600_000, 5_100_000) == (
        "downloading m.gguf: 12.3 MB of 45.6 MB, 5.1 MB/s, ETA 7s"  # 33.3 MB left at 5.1 MB/s
    )
    assert done_line("m.gguf", 45_600_000, 8.0) == "downloaded m.gguf: 45.6 MB in 8.0 s (5.7 MB/s)"
    log = io.StringIO()
    show = StderrProgress(log)
    show(progress_line("big.gguf", 0, 5_000_000, None), 0, 5_000_000)
    show(progress_line("big.gguf", 10, 5_000_000, 1e6), 10, 5_000_000)
    show(done_line("big.gguf", 5_000_000, 2.0), 5_000_000, 5_000_000)
    show(done_line("config.json", 700, 0.01), 700, 700)
    assert log.getvalue().splitlines() == [
        "mlxlis: downloading big.gguf (5.0 MB)",
        "mlxlis: downloaded big.gguf: 5.0 MB in 2.0 s (2.5 MB/s)",
        "mlxlis: downloaded config.json: 700 B in 0.0 s (70.0 kB/s)",
    ]


def test_display_name_of_a_cache_snapshot():
    """A snapshot folder of the Hugging Face cache is shown by its repo name, not its commit."""
    snap = Path("/c/hub/models--mlx-community--Qwen3-4B-4bit/snapshots") / ("f" * 40)
    assert display_name(snap) == "mlx-community/Qwen3-4B-4bit"
    assert display_name(Path("/models/some-folder")) is None


def test_an_existing_path_wins_over_a_repo_name(tmp_path, monkeypatch):
    """`ORG/NAME` that is also a relative folder here is that folder, with no Hub involved;
    the same text where no such folder exists is read as a repo reference."""
    from mlxlis.loading.resolve import resolve

    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert resolve("org/name") == Path("org/name")
    assert parse_ref("org/name") == HubRef("org/name")


def test_the_hubs_xet_reporter_drives_one_line_per_file():
    """huggingface_hub's own Xet download reporter, given mlxlis' bar class, folds its
    transfer bar into the file's bar: the callback sees that file only, from 0 to its size."""
    from mlxlis.loading.hub.progress import bar_class

    from huggingface_hub.utils._xet_progress_reporting import XetDownloadProgressReporter

    class Report:  # what hf_xet reports for a group of files
        total_bytes, total_bytes_completed, total_bytes_completion_rate = 100, 100, 5e6
        total_transfer_bytes, total_transfer_bytes_completed = 60, 60
        total_transfer_bytes_completion_rate = 3e6

    seen = []
    with XetDownloadProgressReporter(
        reconstruction_desc="m.gguf",
        total=100,
        log_level=20,
        tqdm_class=bar_class(lambda *a: seen.append(a)),
    ) as r:
        r.update_progress(Report())
    assert [s[1:] for s in seen] == [(0, 100), (100, 100)]
    assert seen[0][0] == "downloading m.gguf: 0 B of 100 B"
    assert seen[1][0].startswith("downloaded m.gguf: 100 B in ")
