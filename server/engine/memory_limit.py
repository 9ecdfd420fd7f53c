"""How much memory this process may use: the one figure that sizing decisions read
(`models.dequantize: auto`).

On Apple Silicon, Metal's recommended working set (what the GPU may keep resident); elsewhere
the memory cgroup's limit when the process runs in one (Docker, systemd, Kubernetes: v2's
`memory.max`, v1's `memory.limit_in_bytes`), else the machine's physical memory. A cgroup
without a limit reports "max" (v2) or a number near 2**63 (v1): no limit.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this large is
# not a real limit.
UNLIMITED_BYTES = 1 << 60


def process_memory_bytes(cgroup_root: Path = CGROUP_ROOT) -> int:
    """Bytes this process may use (see the module's docstring)."""
    metal = _metal_working_set()
    if metal:
        return metal
    physical = _physical_bytes()
    limit = cgroup_limit_bytes(cgroup_root)
    return min(limit, physical) if limit is not None else physical


def cgroup_limit_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit of the cgroup this process runs in (v2, else v1), or None for none."""
    for relative in _own_cgroup_paths():
        for file in (root / relative.lstrip("/") / "memory.max",
                     root / "memory" / relative.lstrip("/") / "memory.limit_in_bytes"):
            limit = _read_limit(file)
            if limit is not None:
                return limit
    return None


def _own_cgroup_paths() -> list[str]:
    """This process's cgroup paths (from /proc/self/cgroup), then the root: inside a
    container the own path is usually mounted as the root."""
    paths = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in ("", "memory") or "memory" in controllers.split(","):
                paths.append(path)
    except (OSError, ValueError):
        pass
    return [p for p in paths if p not in ("", "/")] + ["/"]


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < UNLIMITED_BYTES else None


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _metal_working_set() -> int | None:
    if not mx.metal.is_available():
        return None
    size = mx.device_info().get("max_recommended_working_set_size")
    return int(size) if size else None
