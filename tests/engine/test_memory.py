"""The memory limit and budget (`server.engine.memory`): cgroups v1 and v2 read from a fake
tree, the budget's arithmetic, and this machine's figures."""

from __future__ import annotations

import pytest

from server.engine import memory
from server.engine.memory import MemoryLimit, cgroup_limit, memory_budget

V1_UNLIMITED = "9223372036854771712"


def tree(tmp_path, files: dict[str, str], proc: str):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    (tmp_path / "proc").write_text(proc)
    return tmp_path / "proc", root


def test_cgroup_v2_takes_the_lowest_limit_up_the_tree(tmp_path):
    proc, root = tree(tmp_path, {"memory.max": "max", "cgroup.controllers": "cpu memory",
                                 "app.slice/memory.max": "3000000000",
                                 "app.slice/server/memory.max": "max"},
                      "0::/app.slice/server\n")
    limit = cgroup_limit(proc, root)
    assert limit.bytes == 3_000_000_000
    assert limit.source == f"cgroup v2 ({root}/app.slice/memory.max)"


def test_cgroup_v2_in_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    proc, root = tree(tmp_path, {"memory.max": "2147483648", "cgroup.controllers": "memory"},
                      "0::/\n")
    assert cgroup_limit(proc, root).bytes == 2147483648


def test_cgroup_v2_without_a_limit_is_none(tmp_path):
    proc, root = tree(tmp_path, {"memory.max": "max", "a/memory.max": "max",
                                 "cgroup.controllers": "memory"}, "0::/a\n")
    assert cgroup_limit(proc, root) is None


def test_cgroup_v1_and_a_hybrid_hierarchy(tmp_path):
    """v1's memory controller beside an empty unified hierarchy (this machine's layout)."""
    proc, root = tree(tmp_path, {"memory/memory.limit_in_bytes": V1_UNLIMITED,
                                 "memory/jobs/memory.limit_in_bytes": V1_UNLIMITED,
                                 "memory/jobs/one/memory.limit_in_bytes": "1500000000",
                                 "unified/cgroup.procs": ""},
                      "5:cpu,cpuacct:/\n4:memory:/jobs/one\n0::/\n")
    limit = cgroup_limit(proc, root)
    assert limit.bytes == 1_500_000_000 and limit.source.startswith("cgroup v1")


def test_no_cgroup_file_is_no_limit(tmp_path):
    assert cgroup_limit(tmp_path / "missing", tmp_path) is None


def test_the_budget_is_the_limit_less_what_the_process_holds_and_the_margin(monkeypatch):
    monkeypatch.setattr(memory, "memory_limit", lambda: MemoryLimit(10_000, "test"))
    monkeypatch.setattr(memory, "resident_bytes", lambda: 3_000)
    budget = memory_budget()
    assert (budget.kv_bytes, budget.reserved_bytes, budget.margin_bytes) == (6_000, 3_000, 1_000)
    # KV caches already held (a model change while requests run) are part of the budget
    assert memory_budget(held_bytes=500, margin_bytes=0).kv_bytes == 7_500
    assert memory_budget(margin_bytes=8_000).kv_bytes == 0
    configured = memory_budget(configured_bytes=1234)
    assert configured.kv_bytes == 1234 and configured.as_dict()["limit_source"] == "configured"


def test_this_machine():
    """On this CPU: the lowest of the process's cgroup limit and physical memory; what it
    holds is its resident set (the kernel's VmRSS)."""
    limit = memory.memory_limit()
    assert 0 < limit.bytes <= memory.physical_memory()
    cgroup = cgroup_limit()
    if cgroup is not None:
        assert limit.bytes == min(cgroup.bytes, memory.physical_memory())
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    rss = int(status["VmRSS"].split()[0]) * 1024
    assert abs(memory.resident_bytes() - rss) < 16 * 2**20


@pytest.mark.parametrize("info,expected", [
    ({"max_recommended_working_set_size": 11_453_251_584, "memory_size": 17_179_869_184},
     MemoryLimit(11_453_251_584, "Metal recommended working set")),
    ({"total_memory": 85_000_000_000, "device_name": "H100"},
     MemoryLimit(85_000_000_000, "GPU device memory")),
])
def test_a_gpu_limit_is_the_devices(monkeypatch, info, expected):
    import mlx.core as mx

    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu))
    monkeypatch.setattr(mx, "device_info", lambda: info)
    assert memory.gpu_memory() == expected == memory.memory_limit()
