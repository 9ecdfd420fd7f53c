"""Rank 0's target caches, mirrored on every other rank of a sharded target.

A tensor-parallel rank holds every row of every cache but only its own heads, so each rank's
forward must see the same inputs and the same cache layout. Rank 0 decides everything; it
records each operation on a target cache (create, merge, pad, filter, extend, trim, drop a
tail, extract a row, copy, free) as a small tuple naming the caches by handle, and sends the
recorded operations in one message right before the next target forward, together with that
forward's inputs. The followers (`server.engine.distributed.follower`) apply them in order to their
own
caches and run the same forward; the `all_sum`s inside the sharded layers keep every rank in
step. The caches themselves are `MirroredKVCache` / `MirroredRaggedKVCache`: the engine's own
cache classes that also record what is done to them, so the scheduler, the batch and the
prefix cache run unchanged. A cache that rank 0 drops (a finished row, an evicted prefix-cache
entry) is freed on the followers through a finalizer.

Messages travel over the same `mlx.core.distributed` group: an `all_sum` of a byte buffer only
rank 0 fills (one frame of `FRAME_BYTES`, a second collective only for a longer message).
"""

from __future__ import annotations

import copy
import itertools
import pickle
import threading
import weakref
from collections import deque
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from server.engine.kv.ragged_cache import RaggedKVCache

FRAME_BYTES = 4096
_LENGTH_BYTES = 8


class OpChannel:
    """Rank 0 broadcasts op lists to every rank: `send` on rank 0, `receive` elsewhere."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank = group.rank()

    def _all_sum(self, buffer: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(buffer), group=self.group, stream=mx.cpu)
        return np.array(out, copy=False)

    def send(self, ops: list) -> None:
        payload = pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL)
        frame = np.zeros(FRAME_BYTES, np.uint8)
        frame[:_LENGTH_BYTES] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
        head = payload[: FRAME_BYTES - _LENGTH_BYTES]
        frame[_LENGTH_BYTES: _LENGTH_BYTES + len(head)] = np.frombuffer(head, np.uint8)
        self._all_sum(frame)
        rest = payload[len(head):]
        if rest:
            self._all_sum(np.frombuffer(rest, np.uint8).copy())

    def receive(self) -> list:
        frame = self._all_sum(np.zeros(FRAME_BYTES, np.uint8))
        length = int(np.frombuffer(frame[:_LENGTH_BYTES].tobytes(), np.int64)[0])
        payload = frame[_LENGTH_BYTES: _LENGTH_BYTES + length].tobytes()
        missing = length - len(payload)
        if missing > 0:
            payload += self._all_sum(np.zeros(missing, np.uint8)).tobytes()
        return pickle.loads(payload)

    def gather(self, value: float) -> list[float]:
        """Every rank's `value`, in rank order (every rank calls it)."""
        slots = np.zeros(self.group.size(), np.float64)
        slots[self.rank] = value
        out = mx.distributed.all_sum(mx.array(slots.astype(np.float32)), group=self.group,
                                     stream=mx.cpu)
        return [float(v) for v in np.array(out)]


class Mirror:
    """Rank 0's record of target-cache operations, sent before each target forward."""

    def __init__(self, channel: OpChannel, guard: Callable):
        self.channel = channel
        self.guard = guard  # a context manager factory: the watchdog's bound on a collective
        self._pending: list[tuple] = []
        self._freed: deque[int] = deque()  # handles of caches rank 0 dropped (any thread)
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self.messages = 0

    def adopt(self, cache):
        """Give `cache` a handle; the followers free theirs when rank 0's is collected."""
        cache.handle = next(self._handles)
        weakref.finalize(cache, self._freed.append, cache.handle)
        return cache

    def record(self, op: tuple) -> None:
        self._pending.append(op)

    def send(self, *last: tuple) -> None:
        """Send what was recorded, the handles freed since, and `last` (a forward, a stop)."""
        with self._lock:
            ops, self._pending = self._pending, []
            freed = []
            while self._freed:
                freed.append(self._freed.popleft())
            if freed:
                ops.append(("free", freed))
            ops.extend(last)
            with self.guard("sending the step's plan"):
                self.channel.send(ops)
            self.messages += 1


class MirroredKVCache(KVCache):
    """A row's `KVCache` whose trims and copies are mirrored (see the module docstring)."""

    mirror: Mirror | None = None  # set once on rank 0

    @classmethod
    def create(cls, count: int) -> list[MirroredKVCache]:
        caches = [cls.mirror.adopt(cls()) for _ in range(count)]
        cls.mirror.record(("new", [c.handle for c in caches]))
        return caches

    @classmethod
    def adopt_plain(cls, plain: KVCache, op: tuple) -> MirroredKVCache:
        cache = cls.__new__(cls)
        cache.__dict__.update(plain.__dict__)
        cls.mirror.adopt(cache)
        cls.mirror.record((op[0], cache.handle, *op[1:]))
        return cache

    def ragged_merge(self, caches: list) -> MirroredRaggedKVCache:
        return MirroredRaggedKVCache.merge(caches)

    def trim(self, n: int) -> int:
        self.mirror.record(("trim", self.handle, int(n)))
        return super().trim(n)

    def __deepcopy__(self, memo) -> MirroredKVCache:
        plain = KVCache()
        plain.keys, plain.values = copy.deepcopy(self.keys, memo), copy.deepcopy(self.values, memo)
        plain.offset = self.offset
        return self.adopt_plain(plain, ("copy", self.handle))


class MirroredRaggedKVCache(RaggedKVCache):
    """A batch's cache whose every layout change is mirrored."""

    @property
    def mirror(self) -> Mirror:
        return MirroredKVCache.mirror

    @classmethod
    def merge(cls, caches) -> MirroredRaggedKVCache:
        merged = super().merge(caches)
        MirroredKVCache.mirror.adopt(merged)
        MirroredKVCache.mirror.record(("merge", merged.handle, [c.handle for c in caches]))
        return merged

    def pad_left(self, left: list[int]) -> None:
        self.mirror.record(("pad_left", self.handle, [int(v) for v in left]))
        super().pad_left(left)

    def filter(self, batch_indices) -> None:
        rows = [int(v) for v in (batch_indices.tolist() if hasattr(batch_indices, "tolist")
                                 else batch_indices)]
        self.mirror.record(("filter", self.handle, rows))
        super().filter(mx.array(rows))

    def extend(self, other) -> None:
        self.mirror.record(("extend", self.handle, other.handle))
        super().extend(other)

    def drop_tail(self, counts: list[int]) -> None:
        if max(counts, default=0) == 0:
            return
        self.mirror.record(("drop_tail", self.handle, [int(v) for v in counts]))
        super().drop_tail(counts)

    def trim(self, n: int) -> int:
        self.mirror.record(("trim", self.handle, int(n)))
        return super().trim(n)

    def extract(self, idx: int) -> MirroredKVCache:
        return MirroredKVCache.adopt_plain(super().extract(idx), ("extract", self.handle, idx))


def apply_op(op: tuple, caches: dict, new_row_caches: Callable[[], list]) -> None:
    """Apply one of rank 0's cache operations to a follower's own caches (`caches`: handle ->
    cache); `new_row_caches()` makes one empty cache per layer, as `make_prompt_cache` does."""
    kind = op[0]
    if kind == "new":
        for handle, cache in zip(op[1], new_row_caches(), strict=True):
            caches[handle] = cache
    elif kind == "merge":
        caches[op[1]] = RaggedKVCache.merge([caches[h] for h in op[2]])
    elif kind == "pad_left":
        caches[op[1]].pad_left(op[2])
    elif kind == "filter":
        caches[op[1]].filter(mx.array(op[2]))
    elif kind == "extend":
        caches[op[1]].extend(caches[op[2]])
    elif kind == "drop_tail":
        caches[op[1]].drop_tail(op[2])
    elif kind == "trim":
        caches[op[1]].trim(op[2])
    elif kind == "extract":
        caches[op[1]] = caches[op[2]].extract(op[3])
    elif kind == "copy":
        caches[op[1]] = copy.deepcopy(caches[op[2]])
    elif kind == "free":
        for handle in op[1]:
            caches.pop(handle, None)
    else:
        raise ValueError(f"unknown cache operation {kind!r}")
