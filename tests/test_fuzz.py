"""Fuzzing the untrusted-input parsers: any input gives a result or an MlxlisError, never another
exception, a hang or a crash, and each example stays within a memory (work) bound.

Targets: safetensors headers (read_header / load_tensors), GGUF headers and metadata
(read_gguf), binding manifests (JSON, YAML, and their validation against a tiny model), chat
templates (ChatTemplate.render) and config.json dicts (config_from_hf).

`MLXLIS_FUZZ_EXAMPLES` sets the examples per target (default 100, so `make test` stays well under
a minute; `make fuzz` runs 5000, randomised). Inputs that once failed live in
`tests/fuzz_corpus/<target>/` and are replayed by `test_fuzz_corpus`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from mlxlis.errors import MlxlisError
from mlxlis.models import HF_MODEL_TYPES

import mlx.core as mx
import numpy as np
import pytest
from conftest import memory_bound
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

EXAMPLES = int(os.environ.get("MLXLIS_FUZZ_EXAMPLES", "100"))
LONG_RUN = "MLXLIS_FUZZ_EXAMPLES" in os.environ
# Python memory one example may allocate: the inputs are a few KB and the largest peak measured
# over the derandomised examples was under 2 MiB; a parser that trusted a size field would
# allocate far more (sizes up to 2**64 are drawn).
MEMORY_BUDGET = 32 << 20
HANG_S = 60.0  # a safety net, not a speed check: a runaway example fails instead of hanging
CORPUS = Path(__file__).parent / "fuzz_corpus"

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG_RUN,  # `make test`: the same examples every run
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)


class Hang(Exception):
    pass


@contextlib.contextmanager
def hang_guard(seconds: float = HANG_S) -> Iterator[None]:
    """Turn a runaway example into a failure instead of a stuck test run (main thread only)."""

    def fire(signum, frame):
        raise Hang(f"example still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def survives(fn: Callable[[], object], what: str = "") -> object:
    """Run `fn`: a result or an MlxlisError is fine; anything else fails the test, and so does
    allocating more than MEMORY_BUDGET."""
    result: object = None
    with hang_guard(), memory_bound(MEMORY_BUDGET, what):
        try:
            result = fn()
        except MlxlisError as e:
            result = e
            str(e)  # the message itself must build
    return result


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="mlxlis-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mutate(data: bytes, ops: list[tuple[int, int, int, bytes]]) -> bytes:
    """Apply (kind, position, length, payload) mutations: overwrite, insert, delete, truncate,
    splice (copy a slice elsewhere), an interesting 64-bit value."""
    b = bytearray(data)
    interesting = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
    for kind, pos, length, payload in ops:
        if not b:
            b = bytearray(payload)
            continue
        pos %= len(b) + 1
        if kind == 0:
            b[pos : pos + len(payload)] = payload
        elif kind == 1:
            b[pos:pos] = payload
        elif kind == 2:
            del b[pos : pos + length]
        elif kind == 3:
            del b[pos:]
        elif kind == 4:
            src = length % len(b)
            b[pos:pos] = b[src : src + 1 + length % 64]
        else:
            v = interesting[length % len(interesting)] if kind == 5 else len(b) + length % 64 - 32
            b[pos : pos + 8] = struct.pack("<Q", v % 2**64)
    return bytes(b)


MUTATIONS = st.lists(
    st.tuples(
        st.integers(0, 6), st.integers(0, 1 << 16), st.integers(0, 1 << 10), st.binary(max_size=16)
    ),
    min_size=1,
    max_size=6,
)

# ---------------------------------------------------------------- JSON-like values

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2, 3, 4, 8, 64, 2**31, 2**63, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSONISH = st.recursive(
    SCALARS,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)

# ---------------------------------------------------------------- 1. safetensors


def check_safetensors(folder: Path, data: bytes) -> None:
    from mlxlis.loading.safetensors import load_tensors, read_header

    for p in folder.glob("*"):
        p.unlink()
    path = folder / "model.safetensors"
    path.write_bytes(data)

    def run() -> None:
        header = read_header(path)
        tensors = load_tensors(folder)
        assert set(tensors) == set(header)
        for name, arr in tensors.items():  # what passed validation must be readable
            mx.eval(arr)
            assert tuple(arr.shape) == tuple(header[name]["shape"])

    survives(run, "safetensors")


DTYPES = ["F32", "F16", "BF16", "U32", "I32", "U8", "I64", "F64", "BOOL", "F8_E4M3", "X", ""]


@st.composite
def safetensors_files(draw) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:  # a valid file from the reference writer, mutated
        n = draw(st.integers(0, 3))
        arrays = {}
        for i in range(n):
            shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
            dt = draw(st.sampled_from([np.float32, np.float16, np.int32, np.uint8, np.uint32]))
            arrays[f"t{i}"] = np.ones(shape, dt)
        with tempfile.TemporaryDirectory() as d:
            save_file(
                arrays,
                f"{d}/x.safetensors",
                metadata=draw(
                    st.none()
                    | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)
                ),
            )
            data = Path(f"{d}/x.safetensors").read_bytes()
        return mutate(data, draw(MUTATIONS)) if draw(st.booleans()) else data
    if kind == 1:  # a structured header with random fields
        entries = draw(
            st.dictionaries(
                st.text(max_size=6),
                st.fixed_dictionaries(
                    {},
                    optional={
                        "dtype": st.sampled_from(DTYPES) | JSONISH,
                        "shape": st.lists(st.integers(-2, 2**33), max_size=9) | JSONISH,
                        "data_offsets": st.lists(st.integers(-4, 2**65), max_size=3) | JSONISH,
                    },
                )
                | JSONISH,
                max_size=4,
            )
        )
        if draw(st.booleans()):
            entries["__metadata__"] = draw(JSONISH)
        blob = json.dumps(entries).encode()
        n = len(blob) if draw(st.booleans()) else draw(st.integers(0, 2**64 - 1))
        return struct.pack("<Q", n) + blob + draw(st.binary(max_size=64))
    if kind == 2:  # a header of any JSON value
        blob = json.dumps(draw(JSONISH)).encode()
        return struct.pack("<Q", len(blob)) + blob + draw(st.binary(max_size=16))
    return draw(st.binary(max_size=128))


@FUZZ
@given(data=safetensors_files())
def test_fuzz_safetensors(work, data):
    check_safetensors(work, data)


# ---------------------------------------------------------------- 2. GGUF


def check_gguf(folder: Path, data: bytes) -> None:
    from mlxlis.loading.gguf_split import read_gguf

    path = folder / "fuzz.gguf"
    path.write_bytes(data)

    def run() -> None:
        with read_gguf(path) as f:
            for key, value in f.metadata.items():
                repr(key), repr(value)[:100], f.metadata_types[key]
            for name, t in f.tensors.items():
                assert t.offset + t.nbytes <= len(data)
                try:
                    raw = f.raw(name)
                except MlxlisError:
                    continue
                assert raw.nbytes == t.nbytes
                int(raw[:16].sum())
                del raw
            repr(f)

    survives(run, "gguf")


@pytest.fixture(scope="module")
def gguf_seed(work) -> bytes:
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    path = work / "seed.gguf"
    w = GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_key_value("test.i8", -3, GGUFValueType.INT8)
    w.add_key_value("test.u64", 2**40, GGUFValueType.UINT64)
    w.add_key_value("test.f64", 0.5, GGUFValueType.FLOAT64)
    w.add_bool("test.bool", True)
    w.add_string("tokenizer.chat_template", "{{ messages[0].content }}")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ü", ""])
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.flags", [True, False])
    w.add_tensor("t.f32", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.add_tensor("t.f16", np.ones(4, np.float16))
    w.add_tensor("t.q8", np.zeros((1, 34), np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    check_gguf(work, data)  # the seed itself reads
    return data


@FUZZ
@given(ops=MUTATIONS)
def test_fuzz_gguf(work, gguf_seed, ops):
    check_gguf(work, mutate(gguf_seed, ops))


@FUZZ
@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=8))
def test_fuzz_gguf_truncated(work, gguf_seed, cut, junk):
    check_gguf(work, gguf_seed[: cut % (len(gguf_seed) + 1)] + junk)


# ---------------------------------------------------------------- 3. binding manifests


def check_manifest_text(folder: Path, text: str, suffix: str) -> None:
    from mlxlis.loading import manifest

    path = folder / f"fuzz{suffix}"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    survives(lambda: manifest.read_manifest(path), "manifest text")


YAML_FRAGMENTS = [
    "a",
    "b: ",
    "- ",
    "  ",
    "\n",
    ": ",
    "? ",
    "{",
    "}",
    "[",
    "]",
    ", ",
    "'q'",
    '"d\\x41"',
    "&x ",
    "*x",
    "!!python/object/apply:os.system ",
    "!foo ",
    "!!str ",
    "!!int ",
    "! ",
    "<<: ",
    "%TAG ! tag:x,2000:\n",
    "%YAML 1.1\n",
    "---\n",
    "...\n",
    "|\n  ",
    ">\n  ",
    "#c",
    "sources:",
    "bindings:",
    "type: safetensors",
    "files: '*.safetensors'",
    "key: ",
    "source: ",
    "model.layers.{i}.mlp.up_proj.weight",
    "{i}",
    "{i+1}",
    "0x1F",
    "1:2:3",
    ".inf",
    "~",
    "null",
    "yes",
    "2001-12-14",
    "\t",
    "\x00",
    "\ufeff",
    "é",
    "\\",
]


@FUZZ
@given(parts=st.lists(st.sampled_from(YAML_FRAGMENTS) | st.text(max_size=4), max_size=30))
@example(parts=["a: &a [x, x]\n", "b: &b [*a, *a]\n", "c: [*b, *b]\n"])
@example(parts=["!!python/object/apply:os.system ", "['true']"])
def test_fuzz_manifest_yaml(work, parts):
    check_manifest_text(work, "".join(parts), ".yaml")


@FUZZ
@given(value=JSONISH, raw=st.text(max_size=40), use_raw=st.booleans())
def test_fuzz_manifest_json(work, value, raw, use_raw):
    text = raw if use_raw else json.dumps(value)
    check_manifest_text(work, text, ".json")


@pytest.fixture(scope="module")
def tiny_model(work) -> tuple[Path, dict]:
    """A 2-layer model folder (config.json + model.safetensors, names as the family's)."""
    from mlxlis.models import build_model, config_from_hf

    from mlx.utils import tree_flatten

    folder = work / "tiny"
    folder.mkdir()
    cfg = dict(
        model_type="llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    net = build_model(config_from_hf(cfg))
    tensors = {k: np.array(v) for k, v in tree_flatten(net.parameters())}
    tensors["extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, folder / "model.safetensors")
    save_file(
        {
            "x.weight": np.zeros((8, 8), np.float16),
            "x.int": np.zeros(8, np.int32),
            "q.scales": np.ones((16, 1), np.float32),
            "q.packed": np.zeros((16, 1), np.uint32),
        },
        folder / "other.safetensors",
    )
    return folder, cfg


PARAMS = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.up_proj.scales",
    "model.layers.{i}.mlp.up_proj.biases",
    "model.layers.0.input_layernorm.weight",
    "model.layers.9.self_attn.q_proj.weight",
    "nope",
    "model.layers.{i}.{i}",
    "{j}",
    "",
]
KEYS = PARAMS + [
    "extra.weight",
    "x.weight",
    "x.int",
    "q.scales",
    "q.packed",
    "model.layers.{i}.self_attn.v_proj.weight",
]
QUANT_BLOCKS = (
    st.none()
    | JSONISH
    | st.sampled_from(
        [
            {"group_size": 0, "bits": 4},
            {"group_size": 32, "bits": 0},
            {"group_size": "x"},
            {"group_size": 32, "bits": 4, "mode": "mxfp4"},
            {"group_size": 8, "bits": 4},
            {"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": False},
            {"group_size": 32, "bits": 4, "model.layers.0.mlp.up_proj": {"group_size": 0}},
        ]
    )
)
SOURCE_NAMES = ["model", "other", "s", "bad name", ""]


@st.composite
def manifests(draw) -> object:
    value = (
        st.sampled_from(KEYS)
        | st.fixed_dictionaries(
            {"key": st.sampled_from(KEYS)},
            optional={"source": st.sampled_from(SOURCE_NAMES), "extra": JSONISH},
        )
        | JSONISH
    )
    bindings = draw(
        st.dictionaries(st.sampled_from(PARAMS) | st.text(max_size=6), value, max_size=6)
    )
    if draw(st.booleans()):
        return bindings  # the flat form (or garbage in it)
    sources = draw(
        st.none()
        | st.dictionaries(
            st.sampled_from(SOURCE_NAMES),
            st.fixed_dictionaries(
                {"type": st.sampled_from(["safetensors", "gguf"]) | JSONISH},
                optional={
                    "files": st.sampled_from(
                        [
                            "*.safetensors",
                            "other.safetensors",
                            "model.safetensors",
                            "*",
                            "../*",
                            "/etc/passwd",
                            "**/*.safetensors",
                            "nothing*",
                            ".",
                            "./",
                            "***",
                            "[",
                            "x/**/",
                        ]
                    )
                    | st.text(max_size=8)
                    | st.lists(st.sampled_from(["*.safetensors", "x"]), max_size=2)
                    | JSONISH
                },
            )
            | JSONISH,
            max_size=3,
        )
    )
    out: dict = {"bindings": bindings}
    if sources is not None:
        out["sources"] = sources
    if draw(st.booleans()):
        out[draw(st.sampled_from(["version", "transform", "sources"]))] = draw(JSONISH)
    return out


def check_plan(
    folder: Path, cfg_dict: dict, data: object, strict: bool, quant: object = None
) -> None:
    import warnings

    from mlxlis.loading.manifest import as_manifest
    from mlxlis.loading.plan import plan_bindings
    from mlxlis.models import build_model, config_from_hf

    def run() -> None:
        cfg = config_from_hf(dict(cfg_dict, quantization=quant))
        net = build_model(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_bindings(net, cfg, as_manifest(data), folder, strict=strict)
        weights = plan.load()
        assert set(weights) == set(plan.bindings)

    survives(run, "manifest plan")


@FUZZ
@given(data=manifests(), strict=st.booleans(), quant=QUANT_BLOCKS)
@example(data={"lm_head.weight": "model.embed_tokens.weight"}, strict=False, quant=None)
@example(
    data={
        "bindings": {"model.layers.{i}.mlp.up_proj.scales": {"source": "other", "key": "q.scales"}},
        "sources": {
            "model": {"type": "safetensors"},
            "other": {"type": "safetensors", "files": "other.safetensors"},
        },
    },
    strict=False,
    quant={"group_size": 0, "bits": 4},
)
def test_fuzz_manifest_plan(tiny_model, data, strict, quant):
    folder, cfg = tiny_model
    check_plan(folder, cfg, data, strict, quant)


# ---------------------------------------------------------------- 4. chat templates

TEMPLATE_FRAGMENTS = [
    "{{",
    "}}",
    "{%",
    "%}",
    "{#",
    "#}",
    "{%-",
    "-%}",
    " ",
    "\n",
    "x",
    "messages",
    "message",
    "for m in messages",
    "endfor",
    "if",
    "elif",
    "else",
    "endif",
    "set",
    "ns",
    "=",
    "namespace(",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ".",
    "|",
    ":",
    "~",
    "+",
    "-",
    "*",
    "**",
    "/",
    "//",
    "%",
    "'a'",
    '"b"',
    "0",
    "1",
    "7",
    "99999999",
    "10**9",
    "9**9**9",
    "range(",
    "loop",
    "loop.index",
    "recursive",
    "macro m()",
    "endmacro",
    "m()",
    "call",
    "endcall",
    "caller()",
    "raw",
    "endraw",
    "filter upper",
    "endfilter",
    "include 'x'",
    "import 'os' as os",
    "extends 'b'",
    "block b",
    "endblock",
    "self",
    "__class__",
    "__mro__",
    "__subclasses__()",
    "__globals__",
    "__init__",
    "__builtins__",
    "cycler",
    "joiner",
    "lipsum",
    "dict",
    "raise_exception('no')",
    "strftime_now('%Y')",
    "tojson",
    "tojson(indent=99999)",
    "join",
    "center(99999999)",
    "format",
    "replace('', 'xx')",
    "batch(9999999)",
    "items()",
    "append(1)",
    "pop()",
    "'%s' % ",
    "'{}'.format",
    "format_map",
    "content",
    "role",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
    "is defined",
    "is none",
    "not",
    "and",
    "or",
    "in",
    "generation",
    "endgeneration",
    "break",
    "continue",
    "do",
    "with",
    "endwith",
    "true",
    "none",
]

DANGEROUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch /tmp/mlxlis-fuzz-pwned').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__init__.__globals__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = messages.append(1) %}{{ messages }}",
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "{{ 'a' * 1000000000 }}",
    "{{ 9 ** 9 ** 9 }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ range(10**9) | list }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% for a in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "{% include 'other' %}",
    "{% import 'os' as os %}",
    "{% extends 'base' %}",
    "{% for a in b %}" * 25 + "{% endfor %}" * 25,
    "{% if a %}" * 120 + "{% endif %}" * 120,
    "{{ a" + ".b" * 5000 + " }}",
    "{{ " + "-" * 3000 + "1 }}",
    "{{ 1" + " + 1" * 3000 + " }}",
    "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}",
    "{{ " + "[" * 3000 + "]" * 3000 + " }}",
    "{{ x | " + " | ".join(["upper"] * 3000) + " }}",
    "{% set s = 'ab' %}{% for i in range(40) %}{% set s = s ~ s %}{% endfor %}{{ s | length }}",
    "{{ strftime_now('%' * 100000) }}",
    "{{ messages | tojson(indent='\\n' * 10000) }}",
]


def check_template(text: str) -> None:
    from mlxlis.prompt.template import ChatTemplate

    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi {{ 7*7 }}"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm"},
    ]

    def run() -> str:
        t = ChatTemplate(source="fuzz", text=text)
        out = t.render(messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
        assert isinstance(out, str)
        return out

    survives(run, "chat template")


@FUZZ
@given(parts=st.lists(st.sampled_from(TEMPLATE_FRAGMENTS) | st.text(max_size=3), max_size=40))
def test_fuzz_chat_template(parts):
    check_template("".join(parts))


@pytest.mark.parametrize("i", range(len(DANGEROUS)))
def test_fuzz_dangerous_templates(i):
    pwned = Path("/tmp/mlxlis-fuzz-pwned")
    pwned.unlink(missing_ok=True)
    check_template(DANGEROUS[i])
    assert not pwned.exists()


# ---------------------------------------------------------------- 5. config.json

CONFIG_KEYS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "hidden_activation",
    "bos_token_id",
    "eos_token_id",
    "text_config",
    "quantization",
    "quantization_config",
    "layer_types",
    "sliding_window",
    "sliding_window_pattern",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_local_base_freq",
    "use_bidirectional_attention",
    # experts and hybrid layers (Qwen3-MoE, Qwen3.5)
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "use_sliding_window",
    "full_attention_interval",
    "partial_rotary_factor",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
]
MODEL_TYPES = sorted(HF_MODEL_TYPES)  # every registered family
BASE_CONFIG = dict(
    model_type="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_theta=10000.0,
)
CONFIG_VALUES = (
    JSONISH
    | st.sampled_from(MODEL_TYPES)
    | st.sampled_from(
        [
            "false",
            [0, 1, 99],
            ["linear_attention", "full_attention"],
            0.25,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": [],
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": float("inf"),
            },
            {"rope_type": "linear", "factor": float("nan")},
            {"rope_type": "yarn"},
            {"full_attention": {"rope_theta": 1e6}, "sliding_attention": 5},
            ["full_attention", "sliding_attention"],
            "gelu_pytorch_tanh",
            2**20 + 1,
            1025,
            0,
            -1,
        ]
    )
)


@st.composite
def configs(draw) -> tuple[object, object]:
    if draw(st.integers(0, 4)) == 0:
        cfg: object = draw(JSONISH)
    else:
        cfg = dict(BASE_CONFIG)
        cfg["model_type"] = draw(st.sampled_from(MODEL_TYPES))
        for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=5)):
            if draw(st.integers(0, 5)) == 0:
                cfg.pop(key, None)
            else:
                cfg[key] = draw(CONFIG_VALUES)
        if draw(st.integers(0, 5)) == 0:
            cfg = {"model_type": "gemma3", "text_config": cfg}
    generation = draw(
        st.none()
        | st.dictionaries(st.sampled_from(["eos_token_id", "bos_token_id"]), JSONISH, max_size=2)
    )
    return cfg, generation


def check_config(cfg: object, generation: object) -> None:
    from mlxlis.models import config_from_hf

    survives(lambda: config_from_hf(cfg, "config.json", generation), "config")  # type: ignore[arg-type]


@FUZZ
@given(pair=configs())
def test_fuzz_config(pair):
    check_config(*pair)


# ---------------------------------------------------------------- the corpus


def corpus_cases() -> list[Path]:
    if not CORPUS.is_dir():
        return []
    return sorted(p for p in CORPUS.glob("*/*") if p.is_file() and not p.name.startswith("."))


@pytest.mark.parametrize("case", corpus_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fuzz_corpus(case, work, tiny_model):
    """Inputs that once escaped as a non-MlxlisError (or hung) replayed as regressions."""
    target = case.parent.name
    raw = case.read_bytes()
    if target == "safetensors":
        folder = work / "corpus_st"
        folder.mkdir(exist_ok=True)
        check_safetensors(folder, raw)
    elif target == "gguf":
        check_gguf(work, raw)
    elif target == "manifest":
        check_manifest_text(work, raw.decode("utf-8", "surrogateescape"), case.suffix)
    elif target == "manifest_plan":  # {"manifest": ..., "quantization": ...}
        folder, cfg = tiny_model
        spec = json.loads(raw)
        check_plan(folder, cfg, spec["manifest"], False, spec.get("quantization"))
    elif target == "chat_template":
        check_template(raw.decode("utf-8"))
    elif target == "config":
        spec = json.loads(raw)  # {"config": ..., "generation": ...}
        check_config(spec["config"], spec.get("generation"))
    elif target == "safetensors_index":
        folder = work / "corpus_index"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / "model.safetensors.index.json").write_bytes(raw)
        from mlxlis.loading.safetensors import weight_files

        survives(lambda: weight_files(folder), "index")
    else:
        pytest.fail(f"unknown corpus target {target!r}")


def test_fuzz_corpus_exists():
    """The corpus is kept (each target that ever failed has its inputs)."""
    assert corpus_cases(), "tests/fuzz_corpus/ is empty"
