"""llama.cpp's GGUF LoRA adapters (mlxlis/loading/lora_gguf.py, models/lora.py `naming`) and
adapters by Hugging Face repo name, against `peft`.

Each adapter is made by `peft` (random A and B, rank 4, alpha 8, attention and MLP targets)
and written as a GGUF here the way llama.cpp's convert_lora_to_gguf.py writes it: its
`get_tensors` pairs PEFT's lora_A / lora_B by base tensor name, the base model class's
`modify_tensors` acts on the pair as one tensor (LoraTorchTensor: Llama's q/k `permute`
moves B's rows, A stays), the name goes through gguf-py's tensor-name map, and the file says
general.type "adapter", adapter.type "lora", adapter.lora.alpha (float32). mlxlis applying
it to a tiny base (llama.cpp's GGUF of it, or its safetensors folder) gives PEFT's float32
logits within test_lora.py's bound: that proves the names, A/B orientation, alpha / r and
the un-permute of B. Bad files are refused by name. An adapter by repo name opens from the
Hugging Face cache offline, and online (tests/hub_server.py's stand-in Hub) only its own
files are downloaded.
"""

from __future__ import annotations

import copy
import hashlib
import math

import mlxlis
from mlxlis.errors import AdapterError
from mlxlis.loading.adapters import read_adapter
from mlxlis.loading.hub.refs import parse_ref
from mlxlis.loading.hub.select import select
from mlxlis.models import family
from mlxlis.models.lora import LoRALinear, adapt, naming

import gguf
import mlx.core as mx
import numpy as np
import peft
import pytest
import torch
from conftest import TINY, tiny_models, trajectory
from hub_server import HubServer
from huggingface_hub import constants
from safetensors.numpy import load_file
from test_conventions import llama_cpp_permute, write_llama_gguf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
BOUND = 1e-5  # test_lora.py's, where the base matches transformers to ~2e-6


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return tiny_models(tmp_path_factory, {k: TINY[k] for k in ARCHS})


@pytest.fixture(scope="module")
def adapters(bases, tmp_path_factory):
    """Per base: (PEFT's folder, PEFT's model), made once."""
    out = {}
    for kind in ARCHS:
        _, ref = bases(kind)
        folder = tmp_path_factory.mktemp(f"peft-{kind}")
        torch.manual_seed(7)
        cfg = peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False
        )
        model = peft.get_peft_model(copy.deepcopy(ref), cfg).eval()
        model.save_pretrained(folder)
        out[kind] = (folder, model)
    return out


def converted(folder, cfg, kind: str) -> dict[str, np.ndarray]:
    """The tensors convert_lora_to_gguf.py writes for PEFT's adapter in `folder`."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in load_file(folder / "adapter_model.safetensors").items():
        # get_base_tensor_name: PEFT's wrapper prefix off, lora_A / lora_B -> the base weight
        base = key.replace("base_model.model.", "")
        part = "A" if ".lora_A.weight" in base else "B"
        base = base.replace(f".lora_{part}.weight", ".weight")
        pairs.setdefault(base, {})[part] = value.astype(np.float32)
    names = gguf.get_tensor_name_map(ARCHS[kind], cfg.num_hidden_layers)
    out = {}
    for base, ab in pairs.items():
        a, b = ab["A"], ab["B"]  # (r, in), (out, r)
        if kind == "llama":  # LlamaModel.modify_tensors: permute q / k; on a LoraTorchTensor
            # the reshape / swapaxes move B's rows (its last axis is r) and leave A as it is
            heads = cfg.num_attention_heads
            if base.endswith("q_proj.weight"):
                b = llama_cpp_permute(b, heads, heads)
            elif base.endswith("k_proj.weight"):
                b = llama_cpp_permute(b, heads, cfg.num_key_value_heads)
        name = names.get_name(base, try_suffixes=(".weight",))
        assert name is not None, base
        out[name + ".lora_a"], out[name + ".lora_b"] = a, b
    return out


def write_lora(path, tensors: dict, arch: str = "llama", **meta) -> None:
    """A GGUF adapter as LoraModel.set_type / set_gguf_parameters write it; `meta` overrides
    (None: the key left out)."""
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": ALPHA}
    for key, value in {**keys, **meta}.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, value)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def peft_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize(
    "kind,base_format", [("llama", "gguf"), ("llama", "safetensors"), ("qwen2", "safetensors")]
)
def test_gguf_adapter_gives_peft_logits(bases, adapters, tmp_path, kind, base_format):
    """Reference parity: the converter's GGUF of PEFT's adapter, applied by mlxlis to the base
    (llama.cpp's GGUF of it, or its safetensors folder), gives PEFT's float32 logits over 40
    tokens within 1e-5; without the adapter they differ by far more, so its B rows (the
    un-permute), orientation and scale alpha / r are what passes."""
    folder, ref = bases(kind)
    peft_folder, pm = adapters[kind]
    lora = tmp_path / "adapter.gguf"
    write_lora(lora, converted(peft_folder, ref.config, kind), arch=kind)
    base = folder
    if base_format == "gguf":
        base = tmp_path / "base.gguf"
        write_llama_gguf(base, ref, folder)
    model = mlxlis.load(base, "float32", adapters=[lora])
    ids = trajectory(40, seed=3, vocab=model.config.vocab_size)
    ours, theirs = np.array(model.logits(ids)), peft_logits(pm, ids)
    assert np.abs(ours - theirs).max() < BOUND
    assert np.abs(peft_logits(ref, ids) - theirs).max() > 1e-3
    wrapped = [m for _, m in model.net.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == ref.config.num_hidden_layers * len(TARGETS)
    assert {m.scale for m in wrapped} == {ALPHA / RANK}
    assert model.adapters[0].naming == "gguf"
    assert model.cache_key() != mlxlis.load(base, "float32").cache_key()


def test_f16_and_q8_0_adapters_read_as_their_values(bases, adapters, tmp_path):
    """The converter's --outtype f16 and q8_0: each tensor reads as gguf-py's own dequantized
    values of it (so the logits equal those of an F32 file of those values)."""
    folder, ref = bases("llama")
    good = converted(adapters["llama"][0], ref.config, "llama")
    ids = trajectory(12, seed=9, vocab=ref.config.vocab_size)
    for qtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0):
        w = gguf.GGUFWriter(str(tmp_path / f"{qtype.name}.gguf"), "llama")
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", ALPHA)
        held = {}
        for name, t in good.items():
            kind = qtype
            try:
                data = gguf.quants.quantize(t, kind)
            except gguf.quants.QuantError:  # ModelBase.prepare_tensors: rows Q8_0 cannot
                kind = gguf.GGMLQuantizationType.F16  # block (lora_b's r) fall back to F16
                data = gguf.quants.quantize(t, kind)
            held[name] = gguf.quants.dequantize(data, kind).astype(np.float32)
            w.add_tensor(name, data, raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        write_lora(tmp_path / "held.gguf", held)
        got, want = (
            np.array(mlxlis.load(folder, "float32", adapters=[p]).logits(ids))
            for p in (tmp_path / f"{qtype.name}.gguf", tmp_path / "held.gguf")
        )
        assert np.abs(got - want).max() < 1e-6, qtype.name


def test_bad_gguf_adapters_are_refused_by_name_and_nothing_applies(bases, adapters, tmp_path):
    """Another adapter.type, alpha missing / NaN / 0, a truncated file, a module the model
    lacks, an A that does not fit the base, an integer tensor, a tensor that is no LoRA, a
    lone lora_a, another architecture: one AdapterError each, naming the file and the field
    or tensor; an adapter whose last module fails leaves the network as it was."""
    folder, ref = bases("llama")
    good = converted(adapters["llama"][0], ref.config, "llama")
    a = good["blk.0.attn_q.weight.lora_a"]

    def refused(name: str, tensors: dict, field: str, says: str, **meta) -> None:
        path = tmp_path / f"{name}.gguf"
        write_lora(path, tensors, **meta)
        with pytest.raises(AdapterError) as e:
            mlxlis.load(folder, "float32", adapters=[path])
        assert e.value.path == str(path), e.value
        assert e.value.field == field and says in e.value.message, e.value

    refused("type", good, "adapter.type", "expected 'lora'", **{"adapter.type": "control"})
    refused("general", good, "general.type", "'adapter'", **{"general.type": "model"})
    refused("no-alpha", good, "adapter.lora.alpha", "missing", **{"adapter.lora.alpha": None})
    refused("nan", good, "adapter.lora.alpha", "finite", **{"adapter.lora.alpha": math.nan})
    refused("zero", good, "adapter.lora.alpha", "above 0", **{"adapter.lora.alpha": 0.0})
    extra = {"blk.9.attn_q.weight.lora_a": a, "blk.9.attn_q.weight.lora_b": a.T.copy()}
    refused("absent", {**good, **extra}, "blk.9.attn_q", "no such module")
    wide = {**good, "blk.1.attn_v.weight.lora_a": np.zeros((RANK, 72), np.float32)}
    refused("wide", wide, "blk.1.attn_v", "do not fit")
    rows = {**good, "blk.0.attn_k.weight.lora_b": np.zeros((30, RANK), np.float32)}
    refused("rows", rows, "blk.0.attn_k", "heads")  # 30 rows: no whole heads to un-permute
    tall = {**good, "blk.0.attn_k.weight.lora_b": np.zeros((64, RANK), np.float32)}
    refused("tall", tall, "blk.0.attn_k", "do not fit")  # whole heads, but q's rows, not k's
    ints = {**good, "blk.0.attn_q.weight.lora_a": a.astype(np.int32)}
    refused("ints", ints, "blk.0.attn_q.weight.lora_a", "float")
    norm = {**good, "blk.0.attn_norm.weight": np.ones(64, np.float32)}  # mergekit's norms
    refused("norm", norm, "blk.0.attn_norm.weight", "not a LoRA tensor")
    half = {k: v for k, v in good.items() if k != "blk.2.ffn_up.weight.lora_b"}
    refused("half", half, "blk.2.ffn_up", "lora_B is missing")
    refused("arch", good, "general.architecture", "qwen2", arch="qwen2")
    cut = tmp_path / "cut.gguf"
    write_lora(cut, good)
    data = cut.read_bytes()
    for size, field in ((len(data) // 2, ".lora_"), (100, "general.type"), (10, "header")):
        cut.write_bytes(data[:size])  # in the tensor data, the metadata, the header
        with pytest.raises(AdapterError) as e:
            read_adapter(cut)
        assert e.value.path == str(cut) and field in e.value.field, e.value
        assert "truncated" in e.value.message or "past the end" in e.value.message

    last = sorted(k for k in good if k.endswith("lora_a"))[-1]  # checked in name order
    bad = {**good, last: np.zeros((RANK, 72), np.float32)}
    write_lora(tmp_path / "last.gguf", bad)
    model = mlxlis.load(folder, "float32")
    adapter = read_adapter(tmp_path / "last.gguf")
    names, undo = naming(adapter, family(model.config.family), model.config)
    with pytest.raises(AdapterError):
        adapt(model.net, adapter, names, mx.float32, undo)
    assert not [m for _, m in model.net.named_modules() if isinstance(m, LoRALinear)]


def test_repo_selection_takes_adapter_files_only():
    """By repo name an adapter repo gives its config and weights (PEFT's or mlx-lm's), never a
    model's weights, README or pickles beside them; a GGUF repo its one adapter, or the one
    named; two unnamed are refused with the choices."""
    listing = dict.fromkeys(
        [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
            "model.safetensors",
            "config.json",
            "training_args.bin",
            "tokenizer.json",
        ],
        10,
    )
    sel = select(parse_ref("org/lora"), listing, adapter=True)
    assert sel.files == ("adapter_config.json", "adapter_model.safetensors") and sel.target == ""
    ggufs = {"README.md": 1, "lora-f16.gguf": 1, "lora-q8_0.gguf": 1}
    one = select(parse_ref("org/lora-GGUF/lora-f16.gguf"), ggufs, adapter=True)
    assert one.files == ("lora-f16.gguf",) and one.target == "lora-f16.gguf"
    with pytest.raises(mlxlis.errors.AmbiguousModelError, match="org/lora-GGUF/lora-q8_0.gguf"):
        select(parse_ref("org/lora-GGUF"), ggufs, adapter=True)


def cached(root, repo: str, files: dict[str, bytes]) -> None:
    """`files` as a snapshot of `repo` in the Hugging Face cache, laid out as huggingface_hub
    lays it out (blobs, snapshots/COMMIT links, refs/main)."""
    storage = root / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snap = storage / "snapshots" / commit
    snap.mkdir(parents=True)
    (storage / "blobs").mkdir()
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{blob}")


def test_adapters_by_repo_name_from_the_cache_offline(bases, adapters, tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE, an adapter named by repo id (PEFT's folder; a GGUF adapter by
    ORG/NAME and by ORG/NAME/FILE.gguf) opens from the Hub cache and gives the logits the
    same adapter gives by path; a repo the cache lacks is an error saying so."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder, ref = bases("llama")
    peft_folder, _ = adapters["llama"]
    cached(tmp_path / "hub", "org/lora", {p.name: p.read_bytes() for p in peft_folder.iterdir()})
    lora = tmp_path / "a.gguf"
    write_lora(lora, converted(peft_folder, ref.config, "llama"))
    cached(tmp_path / "hub", "org/lora-GGUF", {"README.md": b"#", "a-F32.gguf": lora.read_bytes()})
    ids = trajectory(12, seed=5, vocab=ref.config.vocab_size)
    by_path = np.array(mlxlis.load(folder, "float32", adapters=[peft_folder]).logits(ids))
    for name in ("org/lora", "org/lora-GGUF", "org/lora-GGUF/a-F32.gguf"):
        model = mlxlis.load(folder, "float32", adapters=[name])
        assert np.abs(np.array(model.logits(ids)) - by_path).max() < BOUND, name
        assert "snapshots" in str(model.adapters[0].path)
    with pytest.raises(mlxlis.errors.NotCachedError, match="HF_HUB_OFFLINE"):
        read_adapter("org/absent")


def test_adapter_by_repo_name_downloads_its_files_only(bases, adapters, tmp_path, monkeypatch):
    """Online (a stand-in Hub, tests/hub_server.py): an adapter repo that also holds a model's
    weights and config gives only adapter_config.json and the adapter weights to the cache;
    ORG/NAME/FILE.gguf only that GGUF of two."""
    hub = HubServer()
    try:
        url = hub.endpoint
        template = url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        _, ref = bases("llama")
        peft_folder, _ = adapters["llama"]
        model_files = {"model.safetensors": b"\0" * 64, "config.json": b"{}", "README.md": b"#"}
        hub.add_folder("org/lora", peft_folder, model_files)
        adapter = read_adapter("org/lora")
        assert sorted(p.name for p in adapter.path.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert len(adapter.layers) == len(TARGETS) * ref.config.num_hidden_layers
        lora = tmp_path / "a.gguf"
        write_lora(lora, converted(peft_folder, ref.config, "llama"))
        hub.add("org/lora-GGUF", {"a-F32.gguf": lora, "b-F32.gguf": lora, "README.md": b"#"})
        adapter = read_adapter("org/lora-GGUF/b-F32.gguf")
        assert adapter.naming == "gguf" and adapter.path.name == "b-F32.gguf"
        assert [p.name for p in adapter.path.parent.iterdir()] == ["b-F32.gguf"]
    finally:
        hub.close()
