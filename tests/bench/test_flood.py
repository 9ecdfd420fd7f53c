"""`mlx-spec-bench flood` (and the memory cgroups it starts servers in): a short run of both
servers on the tiny pair, where this machine can make a memory cgroup."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.bench.flood import (
    Cgroup,
    CgroupUnavailable,
    flood_prompts,
    main,
    send,
    table,
    unique_name,
)

pytestmark = pytest.mark.slow


@pytest.fixture()
def cgroups():
    try:
        Cgroup.create(unique_name("mlx-spec-bench-probe")).remove()
    except CgroupUnavailable as e:
        pytest.skip(f"no memory cgroup can be made here: {e}")


def test_a_cgroup_limits_and_measures_what_runs_in_it(cgroups, tmp_path):
    import subprocess

    group = Cgroup.create(unique_name("mlx-spec-bench-test"), 64 * 2**20)
    try:
        assert group.limit == 64 * 2**20
        fits = subprocess.run(group.command(["python3", "-c", "b = bytearray(16 << 20)"]))
        assert fits.returncode == 0 and group.oom_kills == 0
        assert group.peak_bytes is None or group.peak_bytes >= 16 << 20
        killed = subprocess.run(group.command(
            ["python3", "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * (64 << 10)"]))
        assert killed.returncode != 0 and group.oom_kills == 1
    finally:
        group.remove()
    assert not group.folder.exists()


def test_the_prompts_are_distinct_and_as_long_as_asked(loaded_pair):
    tokenizer = loaded_pair[1]
    prompts = flood_prompts(tokenizer, 5, 300)
    assert len(set(prompts)) == 5
    assert all(abs(len(tokenizer.encode(p)) - 300) <= 3 for p in prompts)


def test_flood_runs_both_servers_on_the_tiny_pair(cgroups, tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_ENGINE__COST_MODEL", "false")
    status = main(["--target-model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]),
                   "--limit-gb", "4", "--requests", "3", "--prompt-tokens", "64",
                   "--max-tokens", "4", "--check-alone", "--results-dir", str(tmp_path)])
    assert status == 0
    (path,) = tmp_path.glob("flood-*.json")
    doc = json.loads(path.read_text())
    assert doc["command"].startswith("mlx-spec-bench flood ")
    ours, theirs = doc["rows"]
    assert (ours["server"], theirs["server"]) == ("ours", "mlx_lm")
    for row in (ours, theirs):
        assert (row["answered"], row["alive"], row["oom_kills"], row["equal_alone"]) == \
            (3, True, 0, 3), row
        assert 0 < row["peak_gb"] <= 4 and row["wall_s"] > 0
    assert ours["preemptions"] == 0 and theirs["preemptions"] is None  # no such metric
    assert ours["budget_gb"] > 0 and "budget_gb" not in theirs
    # 3 prompts of 64 tokens and 4 more: (68 + 255) positions of 1 KiB (target) and 0.5 KiB
    assert ours["kv_need_gb"] == theirs["kv_need_gb"] == round(3 * 323 * 1536 / 1e9, 3)
    assert table(doc["rows"])[1][:6] == ["ours", "4", "0.001", f"{ours['budget_gb']:.3f}",
                                         "3", "3"]


@pytest.mark.parametrize(("failures", "status"), [(2, 200), (3, 0)])
def test_a_reset_connection_is_retried_twice_as_the_openai_sdk_does(failures, status):
    calls, waits = [], []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= failures:
            raise httpx.ReadError("connection reset", request=request)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    async def run():
        async def sleep(seconds):
            waits.append(seconds)

        async with httpx.AsyncClient(transport=httpx.MockTransport(answer),
                                     base_url="http://x") as client:
            return await send(client, "a prompt", 4, sleep=sleep)

    got = asyncio.run(run())
    assert got.status == status and len(calls) == min(failures + 1, 3) and len(waits) == 2
    assert (got.text == "ok") if status == 200 else got.error.startswith("ReadError")
