"""`mlxlis serve --adapter`: LoRA adapters on a real model (SmolLM2-135M, GGUF) served by name
(BASE:NAME and NAME) and by llama.cpp's per-request `lora` field, driven by the official
openai, anthropic and ollama clients against a real server process.

The reference for each reply is the same greedy request run alone in this process on the
model with that adapter applied (`mlxlis.load(base, adapters=[folder])`, the path
tests/test_lora.py proves equal to PEFT's logits): requests on two adapters, on one at half
scale (PEFT's config with lora_alpha halved) and on none, sent at once so that they share the
server's batches, each give their lone run's text. Refusals (an adapter id the model lacks,
two adapters at once, a name not served, an adapter of another base at start) are each one
clear error naming the field or file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import mlxlis

import numpy as np
import ollama
import openai
import pytest
from conftest import need_pulled
from safetensors.numpy import save_file
from serve_process import ServeProcess

pytestmark = pytest.mark.real

SMOL = "smollm2-135m"
PROMPT = "The capital of France is"
N = 10
# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers
DIMS = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576)}
DIMS |= {"gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
LAYERS = 30


def peft_folder(folder, seed: int, rank: int, alpha: float, targets: list[str], hidden=576):
    """A PEFT adapter folder as `save_pretrained` writes it (its config's fields and tensor
    names), with random A and B large enough to change greedy tokens."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for t in targets:
            n_in, out = DIMS[t]
            n_in = hidden if n_in == 576 else n_in
            part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.05, (rank, n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.05, (out, rank)).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": peft_folder(root / "a", 1, 8, 16, ["q_proj", "v_proj", "down_proj"]),
        "b": peft_folder(root / "b", 2, 4, 48, ["o_proj", "up_proj"]),
        "b-half": peft_folder(root / "b-half", 2, 4, 24, ["o_proj", "up_proj"]),  # b at scale 0.5
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory, adapters):
    need_pulled(SMOL)
    tmp = tmp_path_factory.mktemp("serve")
    server = ServeProcess(
        tmp,
        "-m",
        f"smol={SMOL}",
        "--dtype",
        "float32",
        "--temp",
        "0",  # greedy for every API (Anthropic's client no longer sends a temperature)
        "--adapter",
        f"a={adapters['a']}",
        "--adapter",
        f"smol:b={adapters['b']}",
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def lone(adapters):
    """adapter name (None: the base) -> the greedy text of PROMPT alone in this process."""
    path = need_pulled(SMOL)
    out = {}
    for name in (None, "a", "b", "b-half"):
        model = mlxlis.load(path, "float32", adapters=[adapters[name]] if name else [])
        ids = model.tokenizer.encode(PROMPT)
        tokens = [e.token for e in mlxlis.generate(model, ids, max_tokens=N, stop_ids=set())]
        out[name] = model.tokenizer.decode([t for t in tokens if t is not None])
    assert len(set(out.values())) == 4  # each adapter changes the reply
    return out


def complete(client: openai.OpenAI, model: str, **extra) -> str:
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        extra_body=extra | {"ignore_eos": True},
    )
    return r.choices[0].text


def test_adapters_by_name_and_by_lora_field_share_batches(srv, lone):
    """Eight requests at once: smol:a, a, smol:b, smol (the base), and smol with `lora`
    choosing b at scale 0.5, a at 1, none ([]) and b with a's scale 0 — each the text its lone
    run gives."""
    client = srv.client()
    asks = [
        ("smol:a", {}, "a"),
        ("a", {}, "a"),
        ("smol:b", {}, "b"),
        ("smol", {}, None),
        ("smol", {"lora": [{"id": 1, "scale": 0.5}]}, "b-half"),
        ("smol", {"lora": [{"id": 0, "scale": 1.0}]}, "a"),
        ("smol:a", {"lora": []}, None),
        ("smol", {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}, "b"),
    ]
    got: list[str | None] = [None] * len(asks)

    def ask(i: int) -> None:
        model, extra, _ = asks[i]
        got[i] = complete(client, model, **extra)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [lone[want] for _, _, want in asks]


def test_adapters_are_listed_and_other_apis_name_them(srv, lone):
    """/v1/models and Ollama's /api/tags list each adapter as a model of its own with its
    base as parent (its short name is another name of it); GET /lora-adapters gives the ids
    the `lora` field uses; the Anthropic and Ollama clients reach an adapter by its name
    (their replies equal the OpenAI chat reply of the same name, and differ from the
    base's)."""
    client = srv.client()
    cards = {m.id: m for m in client.models.list().data}
    assert {"smol", "smol:a", "smol:b"} <= cards.keys()
    assert cards["smol:a"].model_extra["parent"] == "smol"
    assert client.models.retrieve("a").id == "smol:a"  # the short name: another name of it
    status, body = srv.request("GET", "/lora-adapters?model=smol")
    assert status == 200 and [(x["id"], x["name"]) for x in body] == [(0, "a"), (1, "b")]
    tags = {m.model: m for m in ollama.Client(host=f"http://127.0.0.1:{srv.port}").list().models}
    assert tags["smol:a"].details.parent_model == "smol:latest"
    messages = [{"role": "user", "content": "Name a colour."}]

    def chat(model: str) -> str:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        return r.choices[0].message.content

    ours = chat("smol:b")
    assert ours != chat("smol")
    reply = srv.anthropic_client().messages.create(model="smol:b", max_tokens=8, messages=messages)
    assert reply.content[0].text == ours
    olm = ollama.Client(host=f"http://127.0.0.1:{srv.port}")
    r = olm.chat(model="smol:b", messages=messages, options={"num_predict": 8, "temperature": 0})
    assert r.message.content == ours


def test_bad_adapter_requests_are_4xx_naming_the_field(srv):
    """An adapter id the model lacks, two adapters at once, a negative scale: 400 naming
    `lora`; an adapter name not served: 404; the server goes on serving."""
    client = srv.client()
    for lora in ([{"id": 7}], [{"id": 0}, {"id": 1}], [{"id": 0, "scale": -1}]):
        with pytest.raises(openai.BadRequestError) as e:
            complete(client, "smol", lora=lora)
        assert e.value.body["param"] == "lora", e.value.body
    with pytest.raises(openai.NotFoundError):
        complete(client, "smol:nope")
    assert complete(client, "smol")


def test_an_adapter_of_another_base_stops_the_server_at_start(tmp_path, adapters):
    """An adapter whose shapes fit another model (hidden size 960, not 576): `mlxlis serve`
    exits 2 with one line naming the adapter's file and the module, before it listens."""
    path = need_pulled(SMOL)
    bad = peft_folder(tmp_path / "other", 3, 4, 8, ["q_proj"], hidden=960)
    r = subprocess.run(
        [sys.executable, "-m", "mlxlis", "serve", "-m", str(path), "--adapter", f"x={bad}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert str(bad) in r.stderr and "q_proj" in r.stderr and "Traceback" not in r.stderr


def test_structured_output_holds_on_an_adapter(srv):
    """A JSON-schema response_format on an adapter's model: the reply parses as JSON of that
    schema (the grammar engine's mask applies on top of the adapter's logits)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = srv.client().chat.completions.create(
        model="smol:a",
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    got = json.loads(r.choices[0].message.content)
    assert list(got) == ["city"] and isinstance(got["city"], str) and len(got["city"]) <= 12
