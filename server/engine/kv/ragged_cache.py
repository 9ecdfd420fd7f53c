"""A `BatchKVCache` whose rows can drop their last entries without moving the rest.

After a batched speculative round every row was fed the same number of tokens but keeps a
different number. `mlx_lm`'s way to drop a row's rejected tail is to roll the row right into
its left padding (`prepare(right_padding=...)` + `finalize`): a gather over every layer's whole
key and value buffers, every round. Measured on the generated pair at 8 rows and k = 1, those
rolls took a third of the round (37 of 116 ms).

`RaggedKVCache.drop_tail` moves nothing instead: the dropped entries become *holes*, positions
the attention mask hides, and the row's RoPE offset steps back so its next token takes the
position the first dropped one had. The row's keys and values, and so its attention output,
are those of the rolled cache; only unused slots differ. Holes are kept on the host (a small
bool array) and cost one extra mask term per forward. `extract` gathers a row's entries
without its holes, so the prefix cache stores a plain, contiguous `KVCache`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache


class RaggedKVCache(BatchKVCache):
    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.holes = np.zeros((len(left_padding), 0), dtype=bool)  # (B, <= _idx); True: hidden

    @classmethod
    def merge(cls, caches) -> RaggedKVCache:
        own = getattr(caches[0], "ragged_merge", None)
        # mirrored rows (`server.engine.distributed.mirror`)
        if cls is RaggedKVCache and own is not None:
            return own(caches)
        merged = super().merge(caches)
        if type(merged) is not cls:  # mlx_lm returns a plain BatchKVCache when all are empty
            ragged = cls([0] * len(caches))
            ragged.__dict__.update(merged.__dict__)
            ragged.holes = np.zeros((len(caches), 0), dtype=bool)
            merged = ragged
        return merged

    def _holes(self, width: int) -> np.ndarray:
        """The hole flags over positions [0, width) (positions never punched are not holes)."""
        have = self.holes.shape[1]
        if have >= width:
            return self.holes[:, :width]
        return np.pad(self.holes, ((0, 0), (0, width - have)))

    def pad_left(self, left: list[int]) -> None:
        """Add `left[i]` padding slots before row i (an empty or prefix-restored row that is
        about to be fed left-padded)."""
        left = mx.array(left)
        self.left_padding = self.left_padding + left
        self.offset = self.offset - left

    def drop_tail(self, counts: list[int]) -> None:
        """Drop the last `counts[i]` entries of row i: they become holes."""
        if max(counts, default=0) == 0:
            return
        holes = self._holes(self._idx).copy()
        for row, n in enumerate(counts):
            if n:
                holes[row, self._idx - n: self._idx] = True
        self.holes = holes
        self.offset = self.offset - mx.array(counts)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        self.holes = self.holes[:, : self._idx]
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        if self.holes.any():
            visible = mx.array(~self._holes(self._idx + N))
            mask = mask & visible[:, None, None, :]
        return mask

    def filter(self, batch_indices) -> None:
        rows = np.array(batch_indices.tolist(), dtype=np.int64)
        holes = self._holes(self._idx)[rows]
        shift = int(np.min(np.array(self.left_padding.tolist())[rows])) if len(rows) else 0
        super().filter(batch_indices)
        self.holes = holes[:, shift:]

    def extend(self, other: BatchKVCache) -> None:
        width = max(self._idx, other._idx)
        mine = self._holes(self._idx)
        theirs = (other._holes(other._idx) if isinstance(other, RaggedKVCache)
                  else np.zeros((other.offset.shape[0], other._idx), dtype=bool))
        super().extend(other)
        # extend right-justifies both parts to the longer one: holes move with their entries.
        self.holes = np.concatenate([np.pad(mine, ((0, 0), (width - mine.shape[1], 0))),
                                     np.pad(theirs, ((0, 0), (width - theirs.shape[1], 0)))])

    def extract(self, idx: int) -> KVCache:
        holes = self._holes(self._idx)[idx]
        if not holes.any():
            return super().extract(idx)
        padding = self.left_padding.tolist()[idx]
        keep = np.flatnonzero(~holes[padding:]) + padding
        positions = mx.array(keep)
        cache = KVCache()
        cache.keys = mx.contiguous(mx.take(self.keys[idx: idx + 1], positions, axis=2))
        cache.values = mx.contiguous(mx.take(self.values[idx: idx + 1], positions, axis=2))
        cache.offset = cache.keys.shape[2]
        return cache
