"""Per-layer caches and going back in them: KV caches (plain, and rings over a sliding window
or an attention chunk; their keys and values dense or quantized), the recurrent state of
linear-attention layers, the position count of a layer that keeps nothing, several sequences'
caches batched for one decoding step, rewinding every kind to a position it can return to
exactly, and the prefix cache that keeps finished requests' caches for later prompts sharing
their start; a layer with several kinds of state keeps them as one (joint.py). Imports only the
runtime and the errors: the networks build these, the generation core moves them."""

from mlxlis.cache.base import Cache
from mlxlis.cache.batch import CacheBatch, KVBatch
from mlxlis.cache.joint import JointCache
from mlxlis.cache.kv import ChunkedKVCache, KVCache, RotatingKVCache, window_mask
from mlxlis.cache.recurrent import RecurrentCache
from mlxlis.cache.rewind import common_prefix, reachable, rewind, snapshot, trimmable
from mlxlis.cache.stateless import StatelessCache
from mlxlis.cache.store import KVFormat, QArray

__all__ = [
    "Cache",
    "CacheBatch",
    "ChunkedKVCache",
    "KVBatch",
    "KVCache",
    "JointCache",
    "KVFormat",
    "QArray",
    "RecurrentCache",
    "RotatingKVCache",
    "StatelessCache",
    "common_prefix",
    "reachable",
    "rewind",
    "snapshot",
    "trimmable",
    "window_mask",
]
