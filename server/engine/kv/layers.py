"""The cache kinds a model's layers use, and the batch cache each kind becomes.

`mlx_lm` gives each layer the cache its attention needs (`make_prompt_cache`): `KVCache` for
full attention, `RotatingKVCache` for a sliding window, `ArraysCache` for a recurrent state
(Gated DeltaNet, Mamba, short convolutions), `CacheList` for a layer that has several. A
request holds those while it prefills alone; in the decoding batch each layer's rows become
one batch cache of the matching kind: `RaggedKVCache`, `WindowKVCache`, `StateCache`,
`BatchCacheList`. Any other kind (a chunked or quantized KV cache) is refused at load, with
the reason (`check_cache_kinds`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from server.engine.errors import UnsupportedCache
from server.engine.kv.ragged_cache import RaggedKVCache
from server.engine.kv.state_cache import StateCache
from server.engine.kv.window_cache import WindowKVCache

SUPPORTED = (KVCache, RotatingKVCache, ArraysCache, CacheList)


def new_cache(model: nn.Module) -> list:
    """A request's own cache: one per layer, of the kinds the model asks for."""
    return make_prompt_cache(model)


def check_cache_kinds(model: nn.Module) -> list[str]:
    """The model's cache kinds, by layer; UnsupportedCache (one line: the kinds and why) for
    a model whose caches this server cannot batch and roll back."""
    cache = make_prompt_cache(model)
    bad = sorted({type(c).__name__ for c in _flat(cache) if not isinstance(c, SUPPORTED)})
    if bad:
        raise UnsupportedCache(
            f"its layers use {', '.join(bad)}, which this server cannot batch and roll back"
            " after a rejected draft (it serves KVCache, RotatingKVCache, ArraysCache and"
            " CacheList)")
    return [type(c).__name__ for c in cache]


def _flat(cache: list) -> list:
    return [leaf for c in cache for leaf in (c.caches if isinstance(c, CacheList) else [c])]


def batch_layer(rows: list):
    """One layer's per-request caches (`KVCache`s, `RotatingKVCache`s, `ArraysCache`s or
    `CacheList`s, one per row) as that layer's batch cache."""
    first = rows[0]
    if isinstance(first, CacheList):
        return BatchCacheList(*(batch_layer([r.caches[i] for r in rows])
                                for i in range(len(first.caches))))
    if isinstance(first, RotatingKVCache):
        return WindowKVCache.merge(rows, first.max_size, first.keep)
    if isinstance(first, ArraysCache):
        return StateCache.merge(rows)
    return RaggedKVCache.merge(rows)


class BatchCacheList(CacheList):
    """A layer with several caches (a Mamba state beside a KV cache, ...), batched."""

    def extract(self, idx: int) -> CacheList:
        return CacheList(*(c.extract(idx) for c in self.caches))


def leaves(cache: list) -> list:
    """Every batch cache of a model's batch, `BatchCacheList`s opened."""
    return _flat(cache)


def kv_leaves(cache: list) -> list[RaggedKVCache]:
    return [c for c in leaves(cache) if isinstance(c, RaggedKVCache)]


def state_leaves(cache: list) -> list[StateCache]:
    return [c for c in leaves(cache) if isinstance(c, StateCache)]


def covered(cache: list, default: int) -> int:
    """How many tokens a request's cache holds: a KV layer's offset; `default` for a model
    of recurrent layers only (a state does not count its tokens)."""
    return next((c.offset for c in leaves(cache) if isinstance(c, (KVCache, RotatingKVCache))),
                default)


def arrays_of(cache: list) -> list[mx.array]:
    """The arrays a batch (or a request's) cache holds, to evaluate them."""
    out = []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            out += [a for a in c.cache if a is not None]
        elif c.keys is not None:
            out += [c.keys, c.values]
    return out
