"""How many bytes a model's KV cache takes for a number of tokens: its layout, read from the
caches `mlx_lm` makes for it, so every cache kind is measured the same way.

A probe feeds one token through a fresh `make_prompt_cache(model)` and reads each layer's
cache: one that grows with the context (`KVCache`, `QuantizedKVCache`, a sliding window's
`RotatingKVCache`) gives its bytes per allocated position and its allocation step; one of
constant size (`ArraysCache`: an SSM's state) gives its bytes per row. A `CacheList` is read
layer by layer inside. A window grows no further than its batch cache keeps
(`WindowKVCache`: the window, its slack and what waits to be compacted; with attention
sinks, the whole context). The scheduler prices batches with it (`memory_gate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from server.engine.kv.window_cache import COMPACT_EVERY, DEFAULT_SLACK

NO_END = 1 << 40  # more positions than any context holds


@dataclass(frozen=True)
class LayerSize:
    bytes_per_token: float = 0.0  # per allocated position (0: a cache of constant size)
    fixed_bytes: int = 0  # per row, whatever the context
    step: int = 1  # positions are allocated this many at a time
    max_tokens: int | None = None  # a window (RotatingKVCache): it grows no further

    def bytes(self, tokens: int) -> int:
        """At most the bytes of one row holding `tokens` positions (a window: at most
        `max_tokens` of them): a cache grows a step at a time from wherever it stands, so it
        has allocated fewer than `step` more."""
        if self.max_tokens is not None:
            tokens = min(tokens, self.max_tokens)
        allocated = tokens + self.step - 1 if tokens > 0 else 0
        return self.fixed_bytes + int(allocated * self.bytes_per_token)


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerSize, ...]

    def bytes(self, tokens: int, rows: int = 1) -> int:
        """The bytes of `rows` rows of `tokens` positions each (a batch's cache is one
        rectangle: every row as wide as its widest)."""
        return rows * sum(layer.bytes(tokens) for layer in self.layers) if rows else 0

    def max_tokens(self, budget: int) -> int:
        """The most positions one row may hold within `budget` bytes (0: not even one;
        `NO_END` when it never outgrows it: windows and states only)."""
        if self.bytes(NO_END) <= budget:
            return NO_END
        if self.bytes(1) > budget:
            return 0
        low, high = 1, NO_END  # bytes(low) fits, bytes(high) does not
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.bytes(mid) <= budget else (low, mid)
        return low


def kv_layout(model: nn.Module) -> KVLayout:
    """`model`'s layout, probed with one token through a fresh cache (on the MLX thread)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]], mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    return KVLayout(tuple(size for c in cache for size in _layer_sizes(c)))


def _layer_sizes(cache) -> list[LayerSize]:
    inner = getattr(cache, "caches", None)
    if isinstance(inner, (list, tuple)):  # CacheList: several caches in one layer
        return [size for c in inner for size in _layer_sizes(c)]
    keys = getattr(cache, "keys", None)
    if keys is None:  # no positions: a state of constant size
        return [LayerSize(fixed_bytes=_nbytes(cache))]
    first = keys[0] if isinstance(keys, (list, tuple)) else keys  # quantized: (data, scales, ...)
    allocated = first.shape[2]
    return [LayerSize(bytes_per_token=_nbytes(cache) / allocated,
                      step=getattr(cache, "step", 1) or 1, max_tokens=_window(cache))]


def _window(cache) -> int | None:
    """The most positions a window layer's batch cache holds; None: no bound."""
    window = getattr(cache, "max_size", None)
    if window is None or getattr(cache, "keep", 0):  # sinks: never compacted
        return None
    return window + DEFAULT_SLACK + COMPACT_EVERY


def _nbytes(cache) -> int:
    try:
        return int(cache.nbytes)
    except (AttributeError, NotImplementedError):
        return sum(a.nbytes for _, a in tree_flatten(cache.state) if isinstance(a, mx.array))
