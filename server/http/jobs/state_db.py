"""What the server keeps across restarts (`server.state_dir`): stored responses, conversations,
files, batches and their results, in one SQLite database (`state.sqlite3`, write-ahead log),
with the files' bytes beside it (`files/`).

The in-memory stores stay what the server reads; each change is written through here, and a
start reads everything back (`load`). Records are JSON, by kind and key, in the order they
were first written (or last written, with `touch`: the order a least-recently-used store
restores). One server per folder: a second one is refused while the first holds its lock.
A write that fails (a full disk) is logged and the request goes on: what is in memory is
served until the restart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (kind, key));
CREATE INDEX IF NOT EXISTS records_order ON records (kind, seq);
"""


class StateError(RuntimeError):
    """The state folder cannot be used (another server holds it, or it is not ours)."""


class StateDB:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        try:
            (self.folder / "files").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StateError(f"server.state_dir: cannot create {self.folder}: {e}") from e
        self._lock_file = _lock(self.folder / "lock")
        self._mutex = threading.Lock()
        try:
            self._db = sqlite3.connect(self.folder / "state.sqlite3", isolation_level=None,
                                       check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_TABLES)
            self._check_version()
            self._seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM records"
                                         ).fetchone()[0]
        except sqlite3.DatabaseError as e:
            self._lock_file.close()
            raise StateError(f"server.state_dir: {self.folder / 'state.sqlite3'} cannot be"
                             f" read ({e}): move it away or choose another folder") from e

    def _check_version(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif row[0] != str(SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"written by another version (schema {row[0]},"
                                        f" this server reads {SCHEMA_VERSION})")

    # -- records -----------------------------------------------------------------------------

    def put(self, kind: str, key: str, value: Any, *, touch: bool = False) -> None:
        """Write `value` (JSON) under (kind, key); `touch` moves it to the end of `load`'s
        order, else it keeps the place it was first written at."""
        with self._writing(f"{kind} {key}"):
            self._seq += 1
            self._db.execute(
                "INSERT INTO records VALUES (?, ?, ?, ?) ON CONFLICT (kind, key) DO UPDATE SET"
                " value = excluded.value" + (", seq = excluded.seq" if touch else ""),
                (kind, key, self._seq, json.dumps(value, ensure_ascii=False)))

    def delete(self, kind: str, key: str) -> None:
        with self._writing(f"{kind} {key}"):
            self._db.execute("DELETE FROM records WHERE kind = ? AND key = ?", (kind, key))

    def delete_prefix(self, kind: str, prefix: str) -> None:
        """Every record of `kind` whose key starts with `prefix`."""
        with self._writing(f"{kind} {prefix}*"):
            self._db.execute("DELETE FROM records WHERE kind = ? AND substr(key, 1, ?) = ?",
                             (kind, len(prefix), prefix))

    def load(self, kind: str) -> list[tuple[str, Any]]:
        """(key, value) of every record of `kind`, in order."""
        with self._mutex:
            rows = self._db.execute("SELECT key, value FROM records WHERE kind = ? ORDER BY seq",
                                    (kind,)).fetchall()
        return [(key, json.loads(value)) for key, value in rows]

    # -- file bytes --------------------------------------------------------------------------

    def write_blob(self, name: str, data: bytes) -> None:
        """`files/name`, whole or not at all (written aside, then renamed)."""
        path = self.folder / "files" / name
        with self._writing(f"file {name}"):
            partial = path.with_suffix(".partial")
            partial.write_bytes(data)
            os.replace(partial, path)

    def read_blob(self, name: str) -> bytes | None:
        try:
            return (self.folder / "files" / name).read_bytes()
        except OSError:
            return None

    def delete_blob(self, name: str) -> None:
        with self._writing(f"file {name}"):
            (self.folder / "files" / name).unlink(missing_ok=True)

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        self._lock_file.close()

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        with self._mutex:
            try:
                yield
            except (OSError, sqlite3.Error) as e:
                log.error("server.state_dir: could not write %s (%s); it is kept in memory"
                          " until a restart", what, e)


def _lock(path: Path):
    """The folder's lock, held while the server runs; a second server is refused."""
    handle = open(path, "a")  # noqa: SIM115 - held open until close()
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        handle.close()
        raise StateError(f"server.state_dir: {path.parent} is in use by another server"
                         " (each server needs its own state folder)") from e
    return handle
