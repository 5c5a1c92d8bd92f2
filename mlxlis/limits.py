"""Bounds on every size read from an untrusted model file, in one place.

A size read from a file is checked against its bound *and* against the bytes actually left in
the file before anything is allocated, so a corrupt count fails with a named error instead of
a MemoryError or a hang.

| constant                   | value       | bounds                       | why this value        |
|----------------------------|-------------|------------------------------|-----------------------|
| GGUF_MAX_TENSORS           | 2**20       | GGUF tensor count            | real: a few 1000      |
| GGUF_MAX_KV                | 2**16       | GGUF key/value count         | real: 20–60 keys      |
| GGUF_MAX_KEY_BYTES         | 2**16       | length of a metadata key     | dotted names, ~40 B   |
| GGUF_MAX_STRING_BYTES      | 2**26       | one string value (64 MiB)    | templates ≤ 100 KB    |
| GGUF_MAX_ARRAY_LEN         | 2**26       | elements in a metadata array | vocab, merges ≤ 10**6 |
| GGUF_MAX_ARRAY_DEPTH       | 4           | arrays nested in arrays      | real files never nest |
| GGUF_MAX_TENSOR_NAME_BYTES | 2**10       | length of a tensor name      | ggml's cap is 64 B    |
| GGUF_MAX_DIMS              | 4           | n_dims of a tensor           | GGML_MAX_DIMS         |
| GGUF_MAX_DIM               | 2**31 - 1   | each dimension of a tensor   | MLX shapes are int32  |
| GGUF_MAX_ELEMENTS          | 2**40       | elements in one tensor       | real ≤ 2**32          |
| GGUF_MAX_ALIGNMENT         | 2**20       | `general.alignment` (2**k)   | the default is 32     |
| SAFETENSORS_MAX_HEADER     | 100_000_000 | safetensors header bytes     | safetensors' own cap  |
| SAFETENSORS_MAX_TENSORS    | 2**20       | entries in one header        | real: a few 1000      |
| SAFETENSORS_MAX_DIMS       | 8           | rank of a safetensors tensor | decoders use ≤ 4      |
| SAFETENSORS_MAX_ELEMENTS   | 2**40       | elements in one tensor       | real ≤ 2**32          |
| SAFETENSORS_MAX_FILES      | 4096        | shards of one folder/source  | real ≤ 200            |
| JSON_MAX_DEPTH             | 64          | nesting of any JSON we parse | real files: ≤ 6       |
| CONFIG_JSON_MAX_BYTES      | 2**24       | config.json, generation_ and | real ≤ 100 KB         |
|                            |             | special_tokens_map.json      |                       |
| INDEX_JSON_MAX_BYTES       | 2**26       | model.safetensors.index.json | real ≤ 10 MB (MoE)    |
| TOKENIZER_CONFIG_MAX_BYTES | 2**26       | tokenizer_config.json        | ≤ 5 MB (added tokens) |
| TOKENIZER_JSON_MAX_BYTES   | 2**28       | tokenizer.json (size only)   | real ≤ 35 MB          |
| CONFIG_MAX_LAYERS          | 1024        | num_hidden_layers            | real ≤ 126            |
| CONFIG_MAX_DIM             | 2**20       | hidden/intermediate sizes,   | real ≤ 53248          |
|                            |             | heads, head_dim              |                       |
| CONFIG_MAX_VOCAB           | 2**22       | vocab_size                   | real ≤ 262144         |
| CONFIG_MAX_EXPERTS         | 2**14       | experts, experts per token   | real ≤ 512            |
| CONFIG_MAX_CONTEXT         | 2**26       | context length, sliding      | real ≤ 10**7          |
|                            |             | window                       |                       |
| CHAT_TEMPLATE_MAX_CHARS    | 2**20       | a chat template's text (its  | real ≤ 50 KB          |
|                            |             | file: 4 bytes a character)   |                       |
| MANIFEST_MAX_BYTES         | 2**23       | a binding manifest file      | flat JSON, 10k params |
|                            |             |                              | ≈ 1 MB                |
| MANIFEST_MAX_DEPTH         | 16          | manifest nesting             | the format needs 4    |
| MANIFEST_MAX_NODES         | 2**20       | YAML events / JSON values    | ≈ 3 per binding       |
| MANIFEST_MAX_STRING        | 4096        | a path, key, name or glob    | tensor names ≤ 200 B  |
| MANIFEST_MAX_BINDINGS      | 2**20       | bindings after `{i}`         | ≤ parameters of the   |
|                            |             | expansion                    | model                 |
| MANIFEST_MAX_SOURCES       | 64          | named sources                | real: 1–3             |

The CONFIG_* bounds apply to config.json and GGUF metadata alike, through `check_sizes`, which
both config readers call before anything is built from the sizes.

Timing: every check above is made before the data it bounds is allocated or parsed, so the work
a hostile file causes is linear in the bytes actually read, which are themselves bounded here.
"""

from __future__ import annotations

from collections.abc import Mapping

GGUF_MAX_TENSORS = 1 << 20
GGUF_MAX_KV = 1 << 16
GGUF_MAX_KEY_BYTES = 1 << 16
GGUF_MAX_STRING_BYTES = 1 << 26
GGUF_MAX_ARRAY_LEN = 1 << 26
GGUF_MAX_ARRAY_DEPTH = 4
GGUF_MAX_TENSOR_NAME_BYTES = 1 << 10
GGUF_MAX_DIMS = 4
GGUF_MAX_DIM = (1 << 31) - 1
GGUF_MAX_ELEMENTS = 1 << 40
GGUF_MAX_ALIGNMENT = 1 << 20
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_MAX_TENSORS = 1 << 20
SAFETENSORS_MAX_DIMS = 8
SAFETENSORS_MAX_ELEMENTS = 1 << 40
SAFETENSORS_MAX_FILES = 4096
JSON_MAX_DEPTH = 64
CONFIG_JSON_MAX_BYTES = 1 << 24
INDEX_JSON_MAX_BYTES = 1 << 26
TOKENIZER_CONFIG_MAX_BYTES = 1 << 26
TOKENIZER_JSON_MAX_BYTES = 1 << 28
CONFIG_MAX_LAYERS = 1024
CONFIG_MAX_DIM = 1 << 20
CONFIG_MAX_VOCAB = 1 << 22
CONFIG_MAX_EXPERTS = 1 << 14
CONFIG_MAX_CONTEXT = 1 << 26
CHAT_TEMPLATE_MAX_CHARS = 1 << 20
MANIFEST_MAX_BYTES = 1 << 23
MANIFEST_MAX_DEPTH = 16
MANIFEST_MAX_NODES = 1 << 20
MANIFEST_MAX_STRING = 4096
MANIFEST_MAX_BINDINGS = 1 << 20
MANIFEST_MAX_SOURCES = 64

# ModelConfig field -> its bound, for the sizes the shared blocks read; a family bounds its
# own keys (its module's BOUNDS, passed to check_sizes)
SIZE_BOUNDS = {
    "num_hidden_layers": CONFIG_MAX_LAYERS,
    "hidden_size": CONFIG_MAX_DIM,
    "intermediate_size": CONFIG_MAX_DIM,
    "num_attention_heads": CONFIG_MAX_DIM,
    "num_key_value_heads": CONFIG_MAX_DIM,
    "head_dim": CONFIG_MAX_DIM,
    "vocab_size": CONFIG_MAX_VOCAB,
    "max_position_embeddings": CONFIG_MAX_CONTEXT,
    "sliding_window": CONFIG_MAX_CONTEXT,
    "num_experts": CONFIG_MAX_EXPERTS,
    "num_experts_per_tok": CONFIG_MAX_EXPERTS,
    "moe_intermediate_size": CONFIG_MAX_DIM,
    "decoder_sparse_step": CONFIG_MAX_LAYERS,
    "no_rope_layer_interval": CONFIG_MAX_LAYERS,
    "attention_chunk_size": CONFIG_MAX_CONTEXT,
    "shared_expert_intermediate_size": CONFIG_MAX_DIM,
    "linear_num_key_heads": CONFIG_MAX_DIM,
    "linear_num_value_heads": CONFIG_MAX_DIM,
    "linear_key_head_dim": CONFIG_MAX_DIM,
    "linear_value_head_dim": CONFIG_MAX_DIM,
    "linear_conv_kernel_dim": CONFIG_MAX_DIM,
    "rotary_dim": CONFIG_MAX_DIM,
}


def check_sizes(
    sizes: dict[str, tuple[str, object]], path: str, bounds: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Each `field: (key in the file, value)` must be an integer in 1..its bound (SIZE_BOUNDS,
    or the family's own `bounds`; a float with an integral value counts); returns
    `field: int`, else raises a ConfigError naming the file and the key as the file spells it."""
    from mlxlis.errors import ConfigError

    out: dict[str, int] = {}
    for name, (key, value) in sizes.items():
        bound = bounds[name] if bounds is not None and name in bounds else SIZE_BOUNDS[name]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= bound:
            raise ConfigError(
                f"must be an integer from 1 to {bound}, got {value!r}"[:200], path=path, field=key
            )
        out[name] = value
    return out
