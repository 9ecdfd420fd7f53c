"""A memory cgroup for a server under test: a child of this process's own cgroup (v1's memory
controller, or v2 where the memory controller is delegated), with a limit; what ran in it
peaked at, and how many times the kernel's OOM killer struck there. Needs root (or a
delegated cgroup); `Cgroup.create` raises `CgroupUnavailable` saying why not."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from server.engine.memory import MemoryCgroup, memory_cgroups


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here."""


@dataclass
class Cgroup:
    folder: Path
    version: int

    @classmethod
    def create(cls, name: str, limit_bytes: int | None = None) -> Cgroup:
        """A new child cgroup `name` of this process's, limited to `limit_bytes` (None: no
        limit of its own)."""
        errors = []
        for parent in memory_cgroups():
            try:
                group = cls._make(parent, name)
            except OSError as e:
                errors.append(f"{parent.folder}: {e}")
                continue
            if limit_bytes is not None:
                group.limit = limit_bytes
            return group
        raise CgroupUnavailable("; ".join(errors) or "no memory cgroup hierarchy is mounted")

    @classmethod
    def _make(cls, parent: MemoryCgroup, name: str) -> Cgroup:
        if parent.version == 2 and "memory" not in \
                (parent.folder / "cgroup.controllers").read_text().split():
            raise OSError("the memory controller is not delegated here")
        folder = parent.folder / name
        folder.mkdir(exist_ok=True)
        group = cls(folder, parent.version)
        if not (folder / group._file("limit")).exists():
            folder.rmdir()
            raise OSError("a cgroup without memory files")
        return group

    def _file(self, what: str) -> str:
        return {1: {"limit": "memory.limit_in_bytes", "peak": "memory.max_usage_in_bytes",
                    "usage": "memory.usage_in_bytes", "events": "memory.oom_control"},
                2: {"limit": "memory.max", "peak": "memory.peak", "usage": "memory.current",
                    "events": "memory.events"}}[self.version][what]

    def _read(self, what: str) -> str:
        return (self.folder / self._file(what)).read_text()

    @property
    def limit(self) -> int | None:
        text = self._read("limit").strip()
        return int(text) if text.isdigit() and int(text) < 1 << 62 else None

    @limit.setter
    def limit(self, value: int | None) -> None:
        text = str(value) if value is not None else ("max" if self.version == 2 else "-1")
        (self.folder / self._file("limit")).write_text(text)

    @property
    def usage_bytes(self) -> int:
        return int(self._read("usage"))

    @property
    def peak_bytes(self) -> int | None:
        """The most the cgroup's processes held at once (None: v2 before Linux 5.19)."""
        try:
            return int(self._read("peak"))
        except FileNotFoundError:
            return None

    def reset_peak(self) -> None:
        if self.version == 1:
            (self.folder / "memory.max_usage_in_bytes").write_text("0")

    @property
    def oom_kills(self) -> int:
        """Processes the OOM killer killed in the cgroup."""
        for line in self._read("events").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the cgroup: a shell that moves itself in, then becomes it."""
        procs = self.folder / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        """Remove the (empty) cgroup; what it still charged goes to its parent."""
        try:
            self.folder.rmdir()
        except OSError:
            pass


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{os.urandom(3).hex()}"
