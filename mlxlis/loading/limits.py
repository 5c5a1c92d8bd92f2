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
"""

from __future__ import annotations

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
