"""How much memory this process may really use, and the share of it left for KV caches.

The limit is the device's when the models run on a GPU (Metal's recommended working set on
Apple Silicon, the device's memory on CUDA), else the lowest of the memory cgroup's limit
(v1 or v2, the process's own cgroup and its ancestors) and the machine's physical memory on
Linux. The KV budget (`MemoryBudget.kv_bytes`) is that limit less what the process holds once
its models are loaded (the weights, and on a CPU the interpreter and libraries too) and less
a margin for what a forward allocates for a moment (activations, attention scores). The
scheduler admits and preempts requests so that their KV caches and the prefix cache stay
within it (`server.engine.scheduling.memory_gate`).

This module is the one place that reads the machine's memory: whatever else needs a figure
(how much is free before a load) should ask it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

# A cgroup v1 "no limit" is PAGE_COUNTER_MAX rounded to pages (9223372036854771712 on x86-64):
# anything this large is no limit.
UNLIMITED = 1 << 62
# What a forward allocates for a moment beside the caches (activations, attention scores,
# the copy a growing cache makes), and what the allocators keep: a share of the limit.
DEFAULT_MARGIN_SHARE = 0.1


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str  # where it comes from: "cgroup v2 (/sys/fs/cgroup/...)", "physical", ...


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes the KV caches (running requests' and the prefix cache's) may hold together,
    and how they were arrived at (shown in /health)."""

    kv_bytes: int
    limit: MemoryLimit | None  # None: the budget was configured, not derived
    reserved_bytes: int = 0  # what the process held once its models were loaded
    margin_bytes: int = 0

    def as_dict(self) -> dict:
        return {"budget_bytes": self.kv_bytes,
                "limit_bytes": self.limit.bytes if self.limit is not None else None,
                "limit_source": self.limit.source if self.limit is not None else "configured",
                "reserved_bytes": self.reserved_bytes, "margin_bytes": self.margin_bytes}


def memory_budget(*, configured_bytes: int | None = None, margin_bytes: int | None = None,
                  held_bytes: int = 0) -> MemoryBudget:
    """The KV budget: `configured_bytes` when given; else the memory limit less what the
    process holds now (less `held_bytes` of it that are KV caches already, counted in the
    budget) and less `margin_bytes` (default: `DEFAULT_MARGIN_SHARE` of the limit). Call it
    once the models are loaded, on the MLX thread."""
    if configured_bytes is not None:
        return MemoryBudget(max(0, configured_bytes), None)
    limit = memory_limit()
    reserved = max(0, resident_bytes() - held_bytes)
    margin = int(limit.bytes * DEFAULT_MARGIN_SHARE) if margin_bytes is None else margin_bytes
    return MemoryBudget(max(0, limit.bytes - reserved - margin), limit, reserved, margin)


# -- what a step allocates for a moment --------------------------------------------------------
_peak_before_reset = 0  # the process's peak before `step_transient` last reset MLX's


def step_transient() -> int:
    """The bytes the work since the last call allocated for a moment above what it left
    allocated (its activations and attention scores: MLX's peak less its active memory), and
    a fresh peak for the next. The process's own peak stays in `peak_bytes`."""
    global _peak_before_reset
    peak, active = mx.get_peak_memory(), mx.get_active_memory()
    _peak_before_reset = max(_peak_before_reset, peak)
    mx.reset_peak_memory()
    return max(0, peak - active)


def peak_bytes() -> int:
    """MLX's peak memory since the process started (or `reset_peak`)."""
    return max(_peak_before_reset, mx.get_peak_memory())


def reset_peak() -> None:
    global _peak_before_reset
    _peak_before_reset = 0
    mx.reset_peak_memory()


# -- the limit -------------------------------------------------------------------------------
def memory_limit() -> MemoryLimit:
    """What this process may use: the GPU's memory where the models run on one, else the
    lowest of the cgroup's limit and physical memory."""
    device = gpu_memory()
    if device is not None:
        return device
    physical = MemoryLimit(physical_memory(), "physical memory")
    cgroup = cgroup_limit()
    return cgroup if cgroup is not None and cgroup.bytes < physical.bytes else physical


def gpu_memory() -> MemoryLimit | None:
    """Metal's recommended working set, or a CUDA device's memory; None on a CPU."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - a backend without device info: treated as a CPU
        return None
    if "max_recommended_working_set_size" in info:
        return MemoryLimit(int(info["max_recommended_working_set_size"]),
                           "Metal recommended working set")
    for key in ("total_memory", "memory_size"):
        if key in info:
            return MemoryLimit(int(info[key]), "GPU device memory")
    return None


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        return 8 * 2**30


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's cgroup in a hierarchy that can limit memory: `mount / path`."""

    version: int  # 1: v1's memory controller; 2: the unified hierarchy
    mount: Path
    path: str  # as /proc/self/cgroup names it, under the mount

    @property
    def folder(self) -> Path:
        return self.mount / self.path.strip("/")

    @property
    def limit_file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"


def memory_cgroups(proc_cgroup: str | Path = "/proc/self/cgroup",
                   root: str | Path = "/sys/fs/cgroup") -> list[MemoryCgroup]:
    """This process's cgroups that can hold a memory limit: v1's memory controller, and v2's
    unified hierarchy (alone at `root`, or beside v1 at `root/unified`: a hybrid)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    root, found = Path(root), []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            found += [MemoryCgroup(2, mount, path) for mount in (root, root / "unified")
                      if (mount / "cgroup.controllers").exists()]
        elif "memory" in controllers.split(","):
            found.append(MemoryCgroup(1, root / "memory", path))
    return found


def cgroup_limit(proc_cgroup: str | Path = "/proc/self/cgroup",
                 root: str | Path = "/sys/fs/cgroup") -> MemoryLimit | None:
    """The lowest memory limit of this process's cgroup and its ancestors (cgroup v2's
    `memory.max`, v1's `memory.limit_in_bytes`); None when there is none or no cgroup."""
    found = [limit for group in memory_cgroups(proc_cgroup, root)
             for limit in _lowest(group.mount, group.path, group.limit_file,
                                  f"cgroup v{group.version}")]
    return min(found, key=lambda limit: limit.bytes, default=None)


def _lowest(mount: Path, path: str, name: str, kind: str) -> list[MemoryLimit]:
    """The lowest limit in file `name` of the cgroup at `path` under `mount` and of its
    ancestors up to the mount (a container sees its own cgroup as the mount's root)."""
    limits = []
    folder = mount / path.strip("/")
    while True:
        value = _read_limit(folder / name)
        if value is not None:
            limits.append(MemoryLimit(value, f"{kind} ({folder / name})"))
        if folder == mount or mount not in folder.parents:
            break
        folder = folder.parent
    return [min(limits, key=lambda limit: limit.bytes)] if limits else []


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # v2's "max"
        return None
    value = int(text)
    return value if value < UNLIMITED else None


# -- what the process holds ------------------------------------------------------------------
def resident_bytes() -> int:
    """What this process holds now: on a GPU, MLX's allocations (the weights, the caches);
    on a CPU, the process's resident set (the interpreter and libraries too)."""
    if gpu_memory() is None:
        rss = _resident_set()
        if rss is not None:
            return rss
    return mx.get_active_memory()


def _resident_set() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):  # not Linux
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")
