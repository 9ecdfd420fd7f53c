"""The memory this process may use: a cgroup's limit (v2, v1) over the machine's memory."""

from __future__ import annotations

import os

from server.engine import memory_limit
from server.engine.memory_limit import cgroup_limit_bytes, process_memory_bytes

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_cgroup_v2_limit(tmp_path):
    (tmp_path / "memory.max").write_text("3221225472\n")
    assert cgroup_limit_bytes(tmp_path) == 3 * 2**30
    assert process_memory_bytes(tmp_path) == min(3 * 2**30, PHYSICAL)


def test_a_cgroup_v1_limit(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("1073741824\n")
    assert cgroup_limit_bytes(tmp_path) == 2**30


def test_no_limit_is_the_machines_memory(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_limit_bytes(tmp_path) is None
    assert process_memory_bytes(tmp_path) == PHYSICAL
    assert process_memory_bytes(tmp_path / "missing") == PHYSICAL


def test_the_process_own_cgroup_is_read_before_the_root(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_limit, "_own_cgroup_paths", lambda: ["/app.slice", "/"])
    (tmp_path / "app.slice").mkdir()
    (tmp_path / "app.slice" / "memory.max").write_text("2147483648\n")
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_limit_bytes(tmp_path) == 2 * 2**30
