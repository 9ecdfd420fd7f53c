"""The prefix cache on disk: KV states that survive a restart.

Each entry is one file in `mlx_lm`'s prompt-cache format (`prompt_cache_file`: what
`save_prompt_cache` writes and `load_prompt_cache` reads). An entry holds the target's
cache, then the draft's when a drafting request made it, over exactly its tokens. Its key is
the fingerprint of each model it holds (`model_kit.model_fingerprint`: path, config, weight
files, dtype, device, MLX versions); its file name is a hash of that key and the token ids,
then a CRC-32 of the whole file; the header holds the key and the token ids again, and both
are checked when the entry is read. A corrupt, truncated or mismatched file is logged,
deleted and counted as a miss: the request is prefilled cold.

Writes happen off the hot path: the MLX thread copies an entry's (already evaluated) arrays to
numpy - a memcpy, ~25 ms for 94 MB on this project's CPU - and a writer thread, which never
touches MLX, builds the file and writes it. Saving with `save_prompt_cache` on the MLX thread
instead would stall every decoding stream for the whole write, and writing only while the
scheduler is idle would never write under steady load. Reads happen on the MLX thread at a
request's first prefill step, only when the disk holds a longer prefix than memory does.

Bounded by `max_bytes` with LRU eviction; a file's modification time is its last use (set
again on every hit), so the order survives restarts. Files of other models may share the
folder: they count towards the budget and age out.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

from server.engine.kv.prompt_cache_file import (
    FORMAT,
    NAME,
    DiskEntry,
    entry_name,
    load_checked,
    prompt_cache_layout,
    read_entry,
    write_temp_file,
)

log = logging.getLogger(__name__)

DEFAULT_DISK_MAX_GB = 10.0
# Shorter prefixes are not written nor read: prefilling them costs less than a file.
MIN_TOKENS = 32
# An entry is read only for a prefix of at least this fraction of its tokens: reading a whole
# long file to reuse its first few tokens can cost more than prefilling them (on a GPU).
MIN_USED_FRACTION = 0.25
# Copies waiting for the writer; beyond it new entries are skipped (one is always accepted).
MAX_PENDING_BYTES = 2 * 2**30


@dataclass
class _Job:
    name: str
    key: str
    tokens: np.ndarray
    arrays: list[tuple[str, str, tuple[int, ...], np.ndarray]]
    metadata: dict[str, str]
    paths: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for *_, a in self.arrays)


def key_string(key: tuple[str, ...]) -> str:
    return "+".join(key)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if same.all() else int(np.argmin(same))


class DiskPromptCache:
    def __init__(self, directory: str | Path, max_bytes: int):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hit_tokens = 0
        self._paths: dict[str, str] = {}  # fingerprint -> model path, for the headers
        self._entries: dict[str, DiskEntry] = {}
        self._lock = threading.Lock()
        self._pending: deque[_Job] = deque()
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        self._generation = 0  # bumped by clear(): a write that began before is dropped
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-cache-writer",
                                        daemon=True)
        self._writer.start()

    # -- start-up --------------------------------------------------------------------------
    def _scan(self) -> None:
        for f in self.directory.glob(".tmp-*"):  # a write cut short by a crash
            f.unlink(missing_ok=True)
        for f in self.directory.iterdir():
            if not NAME.match(f.name):
                continue
            try:
                entry = read_entry(f)
            except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
                log.warning("prefix cache on disk: %s is unreadable (%s): deleted", f.name, e)
                f.unlink(missing_ok=True)
                continue
            if entry is not None:
                self._entries[NAME.match(f.name).group(1)] = entry
        log.info("prefix cache on disk: %d entries, %.2f GB in %s", len(self._entries),
                 self._total() / 1e9, self.directory)

    def register_model(self, path: str, fingerprint: str) -> None:
        """Name a model's fingerprint in the entries it makes; warn when entries of the same
        path were made by another version of it (weights, config, dtype or MLX changed)."""
        self._paths[fingerprint] = path
        with self._lock:
            stale = [e for e in self._entries.values()
                     if any(p == path and fp != fingerprint for fp, p in e.paths.items())]
        if stale:
            log.warning("prefix cache on disk: %d entries were made by another version of %s"
                        " (its weights, config, dtype or MLX changed); they will not be used",
                        len(stale), path)

    # -- the MLX thread ------------------------------------------------------------------------
    def best(self, key: tuple[str, ...], tokens: list[int],
             limit: int | None = None) -> tuple[DiskEntry | None, int]:
        """The entry sharing the longest prefix with `tokens`, at most `limit` of them (the
        shortest such file), and the length of that prefix. An entry that cannot be cut
        (`DiskEntry.trimmable`) counts only when all its tokens are that prefix."""
        key, wanted = key_string(key), np.asarray(tokens, dtype=np.int64)
        limit = len(tokens) if limit is None else limit
        best, length = None, MIN_TOKENS - 1
        with self._lock:
            for entry in self._entries.values():
                if entry.key != key:
                    continue
                n = min(common_prefix(entry.tokens, wanted), limit)
                if not entry.trimmable and n < len(entry.tokens):
                    continue
                if n < MIN_USED_FRACTION * len(entry.tokens):
                    continue
                if n > length or (n == length and best and len(entry.tokens) < len(best.tokens)):
                    best, length = entry, n
        return (best, length) if best is not None else (None, 0)

    def load(self, entry: DiskEntry, length: int) -> list[KVCache] | None:
        """The entry's caches cut to its first `length` tokens; None (logged, file deleted)
        when the file is corrupt, truncated or not what the index says."""
        try:
            cache = load_checked(entry)
        except Exception as e:  # noqa: BLE001 - any damage means a cold prefill
            log.warning("prefix cache on disk: %s is damaged (%s: %s): deleted, prefilling"
                        " cold", entry.path.name, type(e).__name__, e)
            self._discard(entry)
            return None
        now = time.time()
        try:
            os.utime(entry.path, (now, now))
        except OSError:
            pass
        entry.used = now
        excess = len(entry.tokens) - length
        if excess > 0:
            trim_prompt_cache(cache, excess)
        self.hit_tokens += length
        return cache

    def store(self, key: tuple[str, ...], tokens: list[int], caches: list[KVCache]) -> None:
        """Queue `caches` (covering exactly `tokens`) for the writer: numpy copies of their
        states, made here, on the MLX thread."""
        if len(tokens) < MIN_TOKENS or sum(c.nbytes for c in caches) > self.max_bytes:
            return
        key_s, ids = key_string(key), np.asarray(tokens, dtype=np.int64)
        name = entry_name(key_s, ids)
        trimmable = can_trim_prompt_cache(caches)
        with self._lock:
            if any(j.name == name for j in self._pending) or any(
                    e.key == key_s and common_prefix(e.tokens, ids) == len(ids)
                    and (e.trimmable or len(e.tokens) == len(ids))
                    for e in self._entries.values()):
                return  # already on disk, or a prefix of an entry that serves it too
            pending = sum(j.nbytes for j in self._pending)
        if pending and pending + sum(c.nbytes for c in caches) > MAX_PENDING_BYTES:
            log.debug("prefix cache on disk: writer behind, entry skipped")
            return
        paths = {fp: self._paths.get(fp, "") for fp in key}
        meta = {"format": FORMAT, "key": key_s, "paths": json.dumps(paths),
                "tokens": ",".join(map(str, tokens))}
        arrays, metadata = prompt_cache_layout(caches, meta)
        job = _Job(name, key_s, ids, arrays, metadata, paths)
        with self._wake:
            # An entry extending a queued one of the same key makes that one useless (unless
            # they cannot be cut: then each serves its own prefix).
            for old in [j for j in self._pending if j.key == key_s and trimmable and
                        common_prefix(j.tokens, ids) == len(j.tokens)]:
                self._pending.remove(old)
            self._pending.append(job)
            self._wake.notify()

    # -- any thread ------------------------------------------------------------------------
    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued entry is written; False if `timeout` ran out."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.1))
        return True

    def close(self, timeout: float = 60.0) -> None:
        self.flush(timeout)
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def clear(self) -> int:
        """Delete every entry (queued ones too); the number of files deleted."""
        with self._lock:
            self._pending.clear()
            self._generation += 1
            entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            e.path.unlink(missing_ok=True)
        return len(entries)

    def info(self) -> dict:
        with self._lock:
            return {"disk_entries": len(self._entries), "disk_bytes": self._total(),
                    "disk_max_bytes": self.max_bytes}

    # -- the writer thread (no MLX here) ------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed and not self._pending:
                    return
                job = self._pending.popleft()
                self._busy = True
                generation = self._generation
            try:
                self._write(job, generation)
            except Exception:  # noqa: BLE001 - a full disk must not stop the server
                log.exception("prefix cache on disk: writing an entry failed")
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _write(self, job: _Job, generation: int) -> None:
        tmp, final = write_temp_file(self.directory, job.name, job.arrays, job.metadata)
        trimmable = job.metadata.get("0.trimmable", "1") == "1"
        entry = DiskEntry(final, job.key, job.tokens, tmp.stat().st_size, time.time(),
                          job.paths, trimmable)
        with self._lock:
            if generation != self._generation:  # cleared while it was being written
                tmp.unlink(missing_ok=True)
                return
            os.replace(tmp, final)
            self._entries[job.name] = entry
            superseded = [n for n, e in self._entries.items() if e.key == job.key
                          and trimmable and e.trimmable and len(e.tokens) < len(job.tokens)
                          and common_prefix(e.tokens, job.tokens) == len(e.tokens)]
            doomed = [self._entries.pop(n) for n in superseded]
            while self._total() > self.max_bytes and self._entries:
                oldest = min(self._entries, key=lambda n: self._entries[n].used)
                doomed.append(self._entries.pop(oldest))
        for e in doomed:
            e.path.unlink(missing_ok=True)

    def _discard(self, entry: DiskEntry) -> None:
        with self._lock:
            for name, e in list(self._entries.items()):
                if e is entry:
                    del self._entries[name]
        entry.path.unlink(missing_ok=True)

    def _total(self) -> int:
        return sum(e.nbytes for e in self._entries.values())
