"""The prefix cache: KV states of finished prompts and conversations, reused by longest prefix.

Built on `mlx_lm`'s `LRUPromptCache` (a token trie, LRU order, a byte budget, trimming a
longer entry down to the shared prefix). An entry holds the target's cache followed by the
draft's, both covering exactly the entry's tokens, so a drafting request resumes both models.
Entries are made when a prompt's prefill completes (so concurrent requests that share a system
prompt hit as soon as the first is prefilled) and when a request finishes (so the next turn of
a chat hits its whole history). What is stored never holds rejected draft tokens: the batch
trims them before a row can leave. Entries are dropped when the draft changes. The byte budget
is shared with the running requests' KV (`give_way`): the cache holds at most what they leave.

With a `DiskPromptCache` (`cache.disk_dir`), every entry is also written to disk, and a lookup
that finds a longer prefix on disk than in memory loads it (into memory too): after a restart
the first request that shares a long prefix is served from disk. Keys are the fingerprints of
the models an entry holds (`model_kit.model_fingerprint`), on disk as in memory.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from server.engine.kv.disk_cache import DiskPromptCache
from server.engine.kv.layers import arrays_of

# The default budget: this share of the engine's memory budget for KV caches (the running
# requests' KV takes precedence: `give_way`). An eighth, as the machine's eighth it was before
# the budget: about the same cache on a machine with memory to spare.
DEFAULT_PREFIX_CACHE_SHARE = 0.125


def cache_budget_bytes(max_gb: float | None) -> int | None:
    """The configured budget in bytes; None (unset): a share of the memory budget."""
    return None if max_gb is None else int(max_gb * 1e9)


class PrefixCache:
    def __init__(self, max_bytes: int, disk: DiskPromptCache | None = None):
        self.max_bytes = max_bytes
        self.disk = disk
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=max_bytes)
        self.queried_tokens = 0
        self.hit_tokens = 0

    def lookup(self, keys: list[tuple[str, ...]], tokens: list[int]
               ) -> tuple[list | None, int, tuple[str, ...] | None]:
        """A private copy of the cache of the longest stored prefix of `tokens` under any of
        `keys` (the first of them on a tie), its length, and the key it was stored under.
        Copies are lazy: the candidates that lose cost nothing."""
        self.queried_tokens += len(tokens)
        best: tuple[list | None, int, tuple[str, ...] | None] = (None, 0, None)
        for key in keys:
            cache, hit = self._lookup(key, tokens)
            if cache is not None and hit > best[1]:
                best = (cache, hit, key)
        self.hit_tokens += best[1]
        return best

    def _lookup(self, key: tuple[str, ...], tokens: list[int]) -> tuple[list | None, int]:
        if not tokens:
            return None, 0
        cache, rest = self._lru.fetch_nearest_cache(key, tokens)
        if cache is not None and not rest and not can_trim_prompt_cache(cache):
            # A recurrent state (or a full window) covers exactly its tokens: the request
            # needs one token to prefill, so it takes an entry one token shorter or less.
            cache, rest = self._lru.fetch_nearest_cache(key, tokens[:-1])
            rest = rest + tokens[-1:]
        hit = len(tokens) - len(rest) if cache is not None else 0
        if self.disk is not None:
            # as memory: one token left to prefill
            entry, length = self.disk.best(key, tokens, len(tokens) - 1)
            if entry is not None and length > hit:
                loaded = self.disk.load(entry, length)
                if loaded is not None:
                    if sum(c.nbytes for c in loaded) <= self.max_bytes:
                        self._lru.insert_cache(key, list(tokens[:length]), copy.deepcopy(loaded))
                    cache, hit = loaded, length
        if cache is None:
            return None, 0
        return cache, hit

    def store(self, key: tuple[str, ...], tokens: list[int], caches: list[list],
              lengths: list[int] | None = None) -> None:
        """Store `caches` (target's, then draft's, covering the first `lengths[i]` of
        `tokens`; default: all of them) cut to a common length. A part that cannot be cut (a
        recurrent state, a full window) is not: the target's part is then stored alone, at its
        own length, under the target's key (`key[:1]`)."""
        parts = [(list(c), n) for c, n in zip(caches, lengths or [len(tokens)] * len(caches),
                                               strict=True) if c]
        if not parts:
            return
        length = min([len(tokens)] + [n for _, n in parts])
        if any(n > length and not can_trim_prompt_cache(c) for c, n in parts):
            parts, key = parts[:1], key[:1]
            length = min(parts[0][1], len(tokens))
        entry = []
        for part, n in parts:
            if n > length:
                part = copy.deepcopy(part)
                trim_prompt_cache(part, n - length)
            entry.extend(part)
        if length <= 0:
            return
        # The extracted rows are lazy slices of the batch's whole buffers: evaluated now, they
        # become copies of their own and the batch's buffers can be freed (unevaluated, each
        # entry kept a batch's worth of KV alive: 6x mlx_lm.server's peak memory at 32 streams).
        mx.eval(arrays_of(entry))
        if self.disk is not None:
            self.disk.store(key, tokens[:length], entry)
        if sum(c.nbytes for c in entry) > self.max_bytes:
            return
        self._lru.insert_cache(key, list(tokens[:length]), entry)

    def resize(self, max_bytes: int) -> None:
        """A new byte budget (the memory budget changed with the models); entries beyond it
        are evicted, least recently used first."""
        self.max_bytes = self._lru.max_bytes = max_bytes
        self._lru.trim_to(n_bytes=max_bytes)

    def give_way(self, running_bytes: int, memory_budget: int | None = None) -> None:
        """Evict least recently used entries until what they hold and `running_bytes` (the KV
        of the requests running now) fit the budget together, as `mlx_lm.server` trims its
        prompt cache to its byte budget less its batch's: under load the cache makes room for
        the batch instead of adding to it. With a `memory_budget` (the engine's budget for
        every KV cache) the cache also keeps at most what the running requests leave of it:
        it gives way before any request is paused."""
        limit = self.max_bytes if memory_budget is None else min(self.max_bytes, memory_budget)
        self._lru.trim_to(n_bytes=limit - running_bytes)  # at least 0; fits: no-op

    def clear(self) -> int:
        """Drop every entry in memory (the disk's: `clear_disk`); the number dropped."""
        entries = len(self._lru)
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=self.max_bytes)
        return entries

    def clear_disk(self) -> int:
        return self.disk.clear() if self.disk is not None else 0

    def info(self) -> dict:
        disk = self.disk.info() if self.disk is not None else \
            {"disk_entries": 0, "disk_bytes": 0, "disk_max_bytes": 0}
        return {"entries": len(self._lru), "bytes": self._lru.nbytes,
                "max_bytes": self.max_bytes, **disk}
