"""A sliding-window layer's batch cache: a `RaggedKVCache` that attends to the last `window`
tokens, and forgets the older ones a little later.

`mlx_lm`'s `RotatingKVCache` keeps exactly the window in a ring buffer: a token written over
cannot be brought back, so a rejected draft cannot be dropped once the window is full
(`is_trimmable` is then False). Here the buffer is the ragged cache's linear one, holes and
all: rejected tokens become holes as in every other layer, and the window is a mask over
*token* positions (holes and padding are not tokens). Tokens older than the window plus
`slack` are cut off the front now and then (`compact`), all rows at once, so the buffer stays
about `window + slack + COMPACT_EVERY` long whatever the context: a round can always drop up to
`slack` tokens and still see a whole window.

With `keep` (attention sinks, `RotatingKVCache(keep=...)`) the first `keep` tokens stay visible
to every later one, beside the last `window - keep` (what `mlx_lm`'s rotating buffer of `window`
slots holds); such a cache is never compacted.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from server.engine.kv.ragged_cache import RaggedKVCache

# Tokens a window keeps beyond its own size: what one round may drop (drafts of at most this
# many tokens, plus the verified one), and what a restored prefix may give up.
DEFAULT_SLACK = 64
# Compacting copies every window layer's buffer: done once the front holds this many tokens
# no row can see any more, not every round.
COMPACT_EVERY = 256


class WindowKVCache(RaggedKVCache):
    def __init__(self, left_padding: list[int], window: int, keep: int = 0,
                 slack: int = DEFAULT_SLACK):
        super().__init__(left_padding)
        self.window, self.keep, self.slack = window, keep, slack

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches, window: int | None = None, keep: int = 0,
              slack: int = DEFAULT_SLACK) -> WindowKVCache:
        """One batch cache of per-request caches (`RotatingKVCache`s, or `KVCache`s holding a
        request's whole context), each right-aligned: a row keeps the tokens it has, and its
        RoPE offset stays its true position."""
        window = window or next(c.max_size for c in caches if isinstance(c, RotatingKVCache))
        kept = [_ordered(c) for c in caches]
        width = max((k.shape[2] for k, _ in kept if k is not None), default=0)
        cache = cls([width - (0 if k is None else k.shape[2]) for k, _ in kept], window, keep,
                    slack)
        if width:
            some = next(pair for pair in kept if pair[0] is not None)
            cache.keys, cache.values = (_stack([p[i] for p in kept], width, some[i])
                                        for i in (0, 1))
            cache._idx = width
        cache.offset = mx.array([c.offset for c in caches])
        cache.holes = np.zeros((len(caches), width), dtype=bool)
        return cache

    def extend(self, other: WindowKVCache) -> None:
        super().extend(other)

    def extract(self, idx: int) -> RotatingKVCache:
        """Row `idx` as `mlx_lm`'s `RotatingKVCache` (the prefix cache's entry): its last
        tokens in order, its true offset."""
        plain = super().extract(idx)
        cache = RotatingKVCache(max_size=self.window, keep=self.keep)
        cache.keys, cache.values = plain.keys, plain.values
        cache.offset = int(self.offset[idx].item())
        cache._idx = plain.keys.shape[2]
        return cache

    # -- attention -----------------------------------------------------------------------------
    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs):
        """Causal, padding and holes as every ragged cache, and the window over tokens (the
        model passes its own `window_size`, which is this cache's)."""
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding)
        valid = self._valid(N)
        count = np.cumsum(valid, axis=1)  # tokens up to each slot, itself included
        query = count[:, self._idx:]  # (B, N)
        distance = query[:, :, None] - count[:, None, :]  # tokens from each key to each query
        # With sinks, `mlx_lm`'s buffer of `window` slots holds the `keep` first tokens and the
        # `window - keep` last ones.
        recent = (window_size or self.window) - self.keep
        visible = valid[:, None, :] & (distance < recent)
        if self.keep:
            visible |= valid[:, None, :] & (count[:, None, :] <= self.keep)
        return mask & mx.array(visible)[:, None]

    def _valid(self, N: int) -> np.ndarray:
        """(B, _idx + N): which slots hold tokens (not padding, not holes); the N new ones do."""
        padding = np.asarray(self.left_padding.tolist())[:, None]
        slots = np.arange(self._idx + N)[None]
        return (slots >= padding) & ~self._holes(self._idx + N)

    # -- forgetting ----------------------------------------------------------------------------
    def compact(self) -> None:
        """Cut off the front what no row can see any more (beyond `window + slack` of its
        tokens), once it is `COMPACT_EVERY` slots."""
        if self.keep or self.keys is None:
            return
        drop = self._forgettable()
        if drop < COMPACT_EVERY:
            return
        self.keys = self.keys[..., drop:, :]
        self.values = self.values[..., drop:, :]
        self.holes = self._holes(self._idx)[:, drop:]
        self.left_padding = mx.maximum(self.left_padding - drop, 0)
        self._idx -= drop

    def _forgettable(self) -> int:
        """The slots at the front every row is done with: a row needs its last
        `window + slack` tokens (its padding before them is no token at all)."""
        valid = self._valid(0)
        need = self.window + self.slack
        count = valid.sum(axis=1)
        from_end = np.cumsum(valid[:, ::-1], axis=1)[:, ::-1]  # tokens from each slot on
        first = np.where(count >= need, (from_end >= need).sum(axis=1) - 1,
                         np.argmax(valid, axis=1) if valid.size else 0)
        first = np.where(count == 0, self._idx, first)
        return int(first.min()) if len(first) else 0


def _ordered(cache) -> tuple[mx.array | None, mx.array | None]:
    """A per-request cache's keys and values in token order, as many as it holds."""
    if cache.keys is None:
        return None, None
    if isinstance(cache, RotatingKVCache):
        keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        held = min(cache.offset, keys.shape[2])
        return keys[..., keys.shape[2] - held:, :], values[..., values.shape[2] - held:, :]
    if isinstance(cache, KVCache):
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    raise TypeError(f"a window layer cannot take a {type(cache).__name__}")


def _stack(parts: list[mx.array | None], width: int, like: mx.array) -> mx.array:
    """Rows right-aligned in one (B, H, width, D) array."""
    rows = []
    for part in parts:
        if part is None:
            rows.append(mx.zeros((1, like.shape[1], width, like.shape[3]), like.dtype))
        else:
            pad = width - part.shape[2]
            rows.append(mx.pad(part, [(0, 0), (0, 0), (pad, 0), (0, 0)]) if pad else part)
    return mx.concatenate(rows)
