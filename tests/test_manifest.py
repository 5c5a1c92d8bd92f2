"""Binding manifests a checkpoint whose tensor names differ from the model's
loads through a JSON or YAML manifest with logits bit-identical to the original; every
validation failure is a named BindingError; YAML is parsed in a safe subset (no tags, no
anchors) and manifests are not programs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import mlxlis
from mlxlis import errors, limits
from mlxlis.loading import manifest
from mlxlis.loading.manifest import (
    BindingDtypeError,
    BindingMissingError,
    BindingShapeError,
    DuplicateBindingError,
    ManifestError,
    QuantTripletError,
    UnboundTensorsWarning,
    UnexpectedBindingError,
    UnknownParameterError,
)

import mlx.core as mx
import numpy as np
import pytest
from conftest import memory_bound, trajectory
from safetensors.numpy import load_file, save_file

LAYERS = 3  # TINY["llama"]
# HF module name -> the renamed checkpoint's key ({i}: layer index); lm_head keeps its name
RENAMES = {
    "model.embed_tokens.weight": "transformer.wte.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "transformer.h.{i}.attn.q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "transformer.h.{i}.attn.k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "transformer.h.{i}.attn.v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "transformer.h.{i}.attn.o.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "transformer.h.{i}.mlp.gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "transformer.h.{i}.mlp.up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "transformer.h.{i}.mlp.down.weight",
    "model.layers.{i}.input_layernorm.weight": "transformer.h.{i}.ln_1.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "transformer.h.{i}.ln_2.weight",
}

# A work bound, not a clock: the Python memory a refused manifest or config may cost. Refusals
# measured here peak under 1 MiB, or about 16 MiB when the first load of the process imports
# the loader's modules; an expanded YAML bomb (9**10 strings) or a 1 GiB config.json read whole
# would not fit.
PARSE_MEMORY = 64 << 20


def flat_manifest() -> dict[str, str]:
    """The flat form: expanded paths (lm_head.weight left out: it binds by name)."""
    out = {}
    for path, key in RENAMES.items():
        for i in range(LAYERS) if "{i}" in path else (None,):
            out[path.replace("{i}", str(i))] = key.replace("{i}", str(i))
    return out


YAML_MANIFEST = """\
# the renamed checkpoint, in the rich form
sources:
  gpt:
    type: safetensors
    files: "weights-*.safetensors"
bindings:
  "model.embed_tokens.weight": {source: gpt, key: "transformer.wte.weight"}
  "model.norm.weight":
    source: gpt
    key: transformer.ln_f.weight
""" + "".join(
    f'  "{p}":\n    source: gpt\n    key: "{k}"\n' for p, k in RENAMES.items() if "{i}" in p
)


def write_renamed(src: Path, dst: Path, extra: dict[str, np.ndarray] | None = None) -> Path:
    """`src`'s checkpoint re-saved under RENAMES' keys, split over two shards."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in src.iterdir():
        if name.is_file() and "safetensors" not in name.name:
            shutil.copy(name, dst / name.name)
    tensors = load_file(src / "model.safetensors")
    renamed = {}
    for hf, arr in tensors.items():
        renamed[manifest_key(hf)] = arr
    renamed.update(extra or {})
    keys = sorted(renamed)
    half = len(keys) // 2
    save_file({k: renamed[k] for k in keys[:half]}, dst / "weights-00001-of-00002.safetensors")
    save_file({k: renamed[k] for k in keys[half:]}, dst / "weights-00002-of-00002.safetensors")
    return dst


def manifest_key(hf: str) -> str:
    return flat_manifest().get(hf, hf)


@pytest.fixture(scope="module")
def llama(tiny):
    folder, _ = tiny("llama")
    return folder


@pytest.fixture(scope="module")
def original_logits(llama):
    model = mlxlis.load(llama, "float32")
    return np.array(model.logits(trajectory(48, vocab=model.config.vocab_size)))


@pytest.fixture
def renamed(llama, tmp_path):
    return write_renamed(llama, tmp_path / "renamed")


def logits_of(model) -> np.ndarray:
    return np.array(model.logits(trajectory(48, vocab=model.config.vocab_size)))


# ---------------------------------------------------------------- happy paths


def test_renamed_checkpoint_needs_a_manifest(renamed):
    with pytest.raises(errors.MissingTensorError, match="model.embed_tokens.weight"):
        mlxlis.load(renamed, "float32")


def test_json_manifest_gives_identical_logits(renamed, original_logits):
    path = renamed / "bindings.json"
    path.write_text(json.dumps(flat_manifest(), indent=1))
    model = mlxlis.load(renamed, "float32", bindings=path)
    ours = logits_of(model)
    assert ours.dtype == np.float32 and np.array_equal(ours, original_logits)  # bitwise


def test_yaml_manifest_with_templates_and_glob(renamed, original_logits):
    path = renamed / "bindings.yaml"
    path.write_text(YAML_MANIFEST)
    model = mlxlis.load(renamed, "float32", bindings=path)
    assert np.array_equal(logits_of(model), original_logits)


def test_dict_manifest_and_manifest_in_another_folder(renamed, tmp_path, original_logits):
    """A dict works as well; a manifest elsewhere resolves `files` next to itself, and a source
    without `files` is the model folder's weights."""
    model = mlxlis.load(renamed, "float32", bindings=flat_manifest())
    assert np.array_equal(logits_of(model), original_logits)
    elsewhere = tmp_path / "manifests" / "m.yml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(YAML_MANIFEST.replace('    files: "weights-*.safetensors"\n', ""))
    model = mlxlis.load(renamed, "float32", bindings=elsewhere)
    assert np.array_equal(logits_of(model), original_logits)


def test_json_file_in_the_rich_form(renamed, original_logits):
    rich = {
        "sources": {"m": {"type": "safetensors", "files": ["weights-*.safetensors"]}},
        "bindings": {p: {"source": "m", "key": k} for p, k in RENAMES.items()},
    }
    path = renamed / "bindings.json"
    path.write_text(json.dumps(rich))
    assert np.array_equal(
        logits_of(mlxlis.load(renamed, "float32", bindings=path)), original_logits
    )


def test_two_sources(llama, tmp_path, original_logits):
    """Embedding and head from one source, the rest from another."""
    dst = write_renamed(llama, tmp_path / "two")
    shards = sorted(dst.glob("weights-*.safetensors"))
    t = {**load_file(shards[0]), **load_file(shards[1])}
    head = {k: t.pop(k) for k in ("transformer.wte.weight", "lm_head.weight")}
    for s in shards:
        s.unlink()
    (dst / "io").mkdir()
    save_file(head, dst / "io" / "embed.safetensors")
    save_file(t, dst / "body.safetensors")
    m = {
        "sources": {
            "body": {"type": "safetensors", "files": "body.safetensors"},
            "io": {"type": "safetensors", "files": "io/*.safetensors"},
        },
        "bindings": {p: {"source": "body", "key": k} for p, k in RENAMES.items()},
    }
    m["bindings"]["model.embed_tokens.weight"] = {"source": "io", "key": "transformer.wte.weight"}
    m["bindings"]["lm_head.weight"] = {"source": "io", "key": "lm_head.weight"}
    (dst / "m.json").write_text(json.dumps(m))
    model = mlxlis.load(dst, "float32", bindings=dst / "m.json")
    assert np.array_equal(logits_of(model), original_logits)


def test_shared_embedding_and_head(llama, tmp_path):
    """Documented exception to 'one tensor, one parameter': an untied model may take its
    embedding and its head from one tensor (a checkpoint storing the shared matrix once)."""
    dst = write_renamed(llama, tmp_path / "shared")
    for shard in dst.glob("weights-*.safetensors"):
        t = load_file(shard)
        t.pop("lm_head.weight", None)
        save_file(t, shard)
    m = dict(flat_manifest(), **{"lm_head.weight": "transformer.wte.weight"})
    model = mlxlis.load(dst, "float32", bindings=m)
    net = model.net
    assert mx.array_equal(net.lm_head.weight, net.model.embed_tokens.weight)


# ---------------------------------------------------------------- validation


def test_missing_tensor_names_parameter_and_key(renamed):
    m = flat_manifest()
    m["model.layers.1.self_attn.q_proj.weight"] = "transformer.h.1.attn.query.weight"
    with pytest.raises(BindingMissingError) as info:
        mlxlis.load(renamed, "float32", bindings=m)
    msg = str(info.value)
    assert "model.layers.1.self_attn.q_proj.weight" in msg
    assert "'transformer.h.1.attn.query.weight'" in msg and "found none" in msg
    assert isinstance(info.value, errors.BindingError)


def test_missing_by_name(renamed):
    m = flat_manifest()
    del m["model.norm.weight"]
    with pytest.raises(BindingMissingError, match=r"model\.norm\.weight.*bound by name"):
        mlxlis.load(renamed, "float32", bindings=m)


def test_duplicate_tensor(renamed):
    m = flat_manifest()
    m["model.layers.0.self_attn.o_proj.weight"] = "transformer.h.0.attn.q.weight"
    with pytest.raises(DuplicateBindingError) as info:
        mlxlis.load(renamed, "float32", bindings=m)
    msg = str(info.value)
    assert "'transformer.h.0.attn.q.weight'" in msg
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "o_proj" in msg


def test_parameter_bound_twice(renamed):
    m = {
        "bindings": {
            "model.layers.{i}.self_attn.q_proj.weight": "transformer.h.{i}.attn.q.weight",
            "model.layers.1.self_attn.q_proj.weight": "transformer.h.1.attn.k.weight",
        }
    }
    with pytest.raises(DuplicateBindingError, match="bound twice in the manifest"):
        mlxlis.load(renamed, "float32", bindings=m)


@pytest.fixture
def odd(llama, tmp_path):
    """The renamed checkpoint plus a third file of mis-fitting tensors."""
    dst = write_renamed(llama, tmp_path / "odd")
    save_file(
        {
            "odd.rank3": np.zeros((2, 32, 64), np.float32),
            "odd.wide": np.zeros((64, 64), np.float32),
            "odd.int": np.zeros((64,), np.int32),
            "odd.scales": np.zeros((64, 1), np.float32),
        },
        dst / "weights-odd.safetensors",
    )
    return dst


def test_wrong_rank(odd):
    m = dict(flat_manifest(), **{"model.layers.0.self_attn.k_proj.weight": "odd.rank3"})
    with pytest.raises(BindingShapeError) as info:
        mlxlis.load(odd, "float32", bindings=m)
    msg = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "'odd.rank3'" in msg
    assert "rank 3 (shape (2, 32, 64))" in msg and "expected rank 2 (shape (32, 64))" in msg


def test_wrong_dimension(odd):
    m = dict(flat_manifest(), **{"model.layers.0.self_attn.k_proj.weight": "odd.wide"})
    with pytest.raises(BindingShapeError, match=r"k_proj.*'odd\.wide'.*\(64, 64\).*\(32, 64\)"):
        mlxlis.load(odd, "float32", bindings=m)


def test_wrong_dtype(odd):
    m = dict(flat_manifest(), **{"model.norm.weight": "odd.int"})
    with pytest.raises(BindingDtypeError) as info:
        mlxlis.load(odd, "float32", bindings=m)
    msg = str(info.value)
    assert "model.norm.weight" in msg and "'odd.int'" in msg
    assert "is I32" in msg and "expected a float tensor" in msg


def test_quantized_triplet_must_come_together(odd):
    m = dict(flat_manifest(), **{"model.layers.0.self_attn.q_proj.scales": "odd.scales"})
    with pytest.raises(QuantTripletError, match=r"q_proj\.biases.*must be bound together"):
        mlxlis.load(odd, "float32", bindings=m)
    m = dict(flat_manifest(), **{"model.layers.0.self_attn.q_proj.biases": "odd.scales"})
    with pytest.raises(QuantTripletError, match=r"q_proj\.scales is not"):
        mlxlis.load(odd, "float32", bindings=m)


def test_unknown_parameter(renamed):
    m = dict(flat_manifest(), **{"model.layers.0.self_attn.qproj.weight": "x"})
    with pytest.raises(UnknownParameterError, match=r"did you mean 'model\.layers\.0\.self_attn"):
        mlxlis.load(renamed, "float32", bindings=m)
    m = {"model.layers.{i}.attn.weight": "transformer.h.{i}.attn.q.weight"}
    with pytest.raises(UnknownParameterError, match=r"model\.layers\.0\.attn\.weight"):
        mlxlis.load(renamed, "float32", bindings=m)


def test_unexpected_strict_vs_lenient(llama, tmp_path, original_logits):
    extra = {"transformer.h.0.attn.masked_bias": np.zeros((4,), np.float32)}
    dst = write_renamed(llama, tmp_path / "extra", extra)
    with pytest.raises(UnexpectedBindingError) as info:
        mlxlis.load(dst, "float32", bindings=flat_manifest())
    assert "transformer.h.0.attn.masked_bias" in str(info.value)
    assert isinstance(info.value, errors.UnexpectedTensorError)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mlxlis.load(dst, "float32", bindings=flat_manifest(), strict=False)
    ws = [w.message for w in caught if isinstance(w.message, UnboundTensorsWarning)]
    assert len(ws) == 1 and ws[0].tensors == [("model", "transformer.h.0.attn.masked_bias")]
    assert np.array_equal(logits_of(model), original_logits)


def test_identity_manifest_lenient(llama, tmp_path, original_logits):
    """Without a manifest the same rules apply to names as they are."""
    dst = tmp_path / "plain"
    shutil.copytree(llama, dst)
    t = load_file(dst / "model.safetensors")
    t["model.extra.weight"] = np.zeros((2,), np.float32)
    save_file(t, dst / "model.safetensors")
    with pytest.raises(errors.UnexpectedTensorError, match=r"model\.extra\.weight"):
        mlxlis.load(dst, "float32")
    with pytest.warns(UnboundTensorsWarning, match=r"model\.extra\.weight"):
        model = mlxlis.load(dst, "float32", strict=False)
    assert np.array_equal(logits_of(model), original_logits)


# ---------------------------------------------------------------- manifest syntax

PWNED = "/tmp/mlxlis-manifest-pwned"

BAD_YAML = {
    "python_tag": (f'bindings: !!python/object/apply:os.system ["touch {PWNED}"]\n', "tag"),
    "python_name": ("a: !!python/name:os.system\n", "tag"),
    "unknown_tag": ("model.norm.weight: !foo transformer.ln_f.weight\n", "tag '!foo'"),
    "str_tag": ("model.norm.weight: !!str transformer.ln_f.weight\n", "tag"),
    "nonspecific_tag": ("model.norm.weight: ! x\n", "tag"),
    "tag_directive": ("%TAG !e! tag:example.com,2000:\n---\na: !e!x b\n", "tag"),
    "anchor": ("a: &x transformer.ln_f.weight\nb: *x\n", "anchors"),
    "alias_only": ("a: *x\n", "invalid YAML|alias"),
    "merge_key": ("base: {a: b}\nother:\n  <<: {a: c}\n", "merge keys"),
    "duplicate_key": ("a: x\na: y\n", "duplicate key 'a'"),
    "int_key": ("1: x\n", "keys must be strings"),
    "complex_key": ("? [a, b]\n: x\n", "keys must be strings"),
    "two_documents": ("a: x\n---\nb: y\n", "more than one YAML document"),
    "not_a_mapping": ("- a\n- b\n", "a manifest is a mapping"),
    "empty": ("", "empty manifest"),
    "syntax": ("a: [b\n", "invalid YAML"),
    "deep": ("a: " + "[" * 40 + "]" * 40 + "\n", "nested deeper"),
}


@pytest.mark.parametrize("case", sorted(BAD_YAML))
def test_unsafe_or_malformed_yaml(tmp_path, case):
    text, words = BAD_YAML[case]
    p = tmp_path / "m.yaml"
    p.write_text(text)
    Path(PWNED).unlink(missing_ok=True)
    with memory_bound(PARSE_MEMORY, case), pytest.raises(ManifestError, match=words) as info:
        manifest.read_manifest(p)
    assert "m.yaml" in str(info.value)
    assert not Path(PWNED).exists()


def test_billion_laughs_is_refused_at_once(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        prev = chr(ord("a") + i - 1)
        lines.append(f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [{','.join(['*' + prev] * 9)}]")
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines) + "\n")
    with memory_bound(PARSE_MEMORY, "bomb"), pytest.raises(ManifestError, match="anchors"):
        manifest.read_manifest(p)  # expanded, the bomb would hold 9**10 strings


def test_python_tag_never_executes_through_load(renamed):
    Path(PWNED).unlink(missing_ok=True)
    p = renamed / "evil.yaml"
    p.write_text(f"!!python/object/apply:os.system ['touch {PWNED}']\n")
    with memory_bound(PARSE_MEMORY, "tag"), pytest.raises(errors.BindingError, match="tag"):
        mlxlis.load(renamed, "float32", bindings=p)
    assert not Path(PWNED).exists()


BAD_SCHEMA = {
    "unknown_top": ({"bindings": {}, "transform": "transpose"}, "unknown field 'transform'"),
    "unknown_binding_field": (
        {"bindings": {"a.weight": {"key": "b", "transpose": True}}},
        "unknown field 'transpose'",
    ),
    "binding_without_key": ({"bindings": {"a.weight": {"source": "model"}}}, "lacks its `key`"),
    "undeclared_source": ({"bindings": {"a": {"source": "s", "key": "k"}}}, "not declared"),
    "unknown_source_field": (
        {"sources": {"s": {"type": "safetensors", "exec": "rm -rf /"}}, "bindings": {}},
        "unknown field 'exec'",
    ),
    "source_type": ({"sources": {"s": {"type": "pickle"}}, "bindings": {}}, "only safetensors"),
    "absolute_glob": (
        {"sources": {"s": {"type": "safetensors", "files": "/etc/*"}}, "bindings": {}},
        "inside the manifest's folder",
    ),
    "parent_glob": (
        {"sources": {"s": {"type": "safetensors", "files": "../*.safetensors"}}},
        "inside the manifest's folder",
    ),
    "flat_non_string": ({"a.weight": 3}, "expected a tensor key string"),
    "flat_mapping": ({"a.weight": {"key": "b"}}, "flat form"),
    "expression": ({"layers.{i+1}.w": "h.{i}.w"}, "only placeholder"),
    "format_field": ({"a.w": "{0.__class__}"}, "only placeholder"),
    "index_only_in_key": ({"a.w": "h.{i}.w"}, "uses {i} but the parameter path does not"),
    "empty_key": ({"a.w": ""}, "non-empty string"),
    "not_a_dict": ([1, 2], "not list|bindings must be"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCHEMA))
def test_manifests_are_not_programs(case):
    data, words = BAD_SCHEMA[case]
    with pytest.raises(ManifestError, match=words):
        manifest.as_manifest(data)


def test_json_manifest_errors(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"a": "x", "a": "y"}')
    with pytest.raises(ManifestError, match="duplicate key 'a'"):
        manifest.read_manifest(p)
    p.write_text('{"a": NaN}')
    with pytest.raises(ManifestError, match="NaN"):
        manifest.read_manifest(p)
    p.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ManifestError, match="nested deeper"):
        manifest.read_manifest(p)
    p.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ManifestError, match="UTF-8"):
        manifest.read_manifest(p)
    with pytest.raises(ManifestError, match="file not found"):
        manifest.read_manifest(tmp_path / "nope.json")


def test_manifest_size_limit(tmp_path, monkeypatch):
    p = tmp_path / "big.json"
    p.write_text(json.dumps({f"p{i}": "k" for i in range(200)}))
    monkeypatch.setattr(limits, "MANIFEST_MAX_BYTES", 1000)
    with memory_bound(PARSE_MEMORY, "size"), pytest.raises(ManifestError, match="1000 bytes"):
        manifest.read_manifest(p)


def test_glob_matching_nothing_or_not_safetensors(renamed):
    m = {
        "sources": {"s": {"type": "safetensors", "files": "nothing-*.safetensors"}},
        "bindings": {},
    }
    with pytest.raises(ManifestError, match="matches nothing"):
        mlxlis.load(renamed, "float32", bindings=m)
    (renamed / "pytorch_model.bin").write_bytes(b"\x80\x04N.")
    m["sources"]["s"]["files"] = "*"
    with pytest.raises(ManifestError, match="not a .safetensors file"):
        mlxlis.load(renamed, "float32", bindings=m)


def test_bindings_refused_for_gguf(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(errors.BindingError, match="safetensors folders"):
        mlxlis.load(p, "float32", bindings={"a": "b"})


# ---------------------------------------------------------------- bounded JSON of the folder


def test_huge_config_refused_by_size(llama, tmp_path):
    dst = tmp_path / "huge"
    shutil.copytree(llama, dst)
    with open(dst / "config.json", "r+b") as f:  # sparse: 1 GiB that costs no disk
        f.truncate(1 << 30)
    with memory_bound(PARSE_MEMORY, "config"), pytest.raises(errors.ConfigError, match="limit"):
        mlxlis.load(dst, "float32")  # read whole, the sparse 1 GiB file would cross the bound


def test_deep_tokenizer_config_refused(llama, tmp_path):
    dst = tmp_path / "deep"
    shutil.copytree(llama, dst)
    (dst / "tokenizer_config.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(errors.TokenizerError, match="nested deeper"):
        mlxlis.load(dst, "float32")


# ---------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxlis", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_bindings_strict_and_lenient(llama, tmp_path):
    dst = write_renamed(
        llama, tmp_path / "cli", {"transformer.h.0.attn.masked_bias": np.zeros(4, np.float32)}
    )
    (dst / "b.yaml").write_text(YAML_MANIFEST)
    base = ["-m", str(dst), "--bindings", str(dst / "b.yaml"), "--no-chat", "--max-tokens", "4"]
    res = run_cli(*base, "Hello")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "masked_bias" in lines[0] and "b.yaml" in lines[0]
    res = run_cli(*base, "--lenient", "--verbose", "Hello")
    assert res.returncode == 0, res.stderr
    assert "transformer.h.0.attn.masked_bias (gpt)" in res.stderr and res.stdout.strip()
