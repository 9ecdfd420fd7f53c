"""A flood: many ~2k-token prompts at once, their KV twice what the memory budget allows. Every
request is answered (200), the server still answers afterwards, and each text is the one the
request gets alone. In a real memory cgroup where the machine allows it (root, cgroup v1 or a
delegated v2: `python -m server` derives its budget from the cgroup's limit), and in process
against a configured budget everywhere."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest
from support.servers import served

from server.bench.flood import (
    Cgroup,
    CgroupUnavailable,
    alive,
    flood_prompts,
    free_port,
    kv_need,
    metric,
    send_all,
    start_in,
    unique_name,
)

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 2000
MAX_TOKENS = 16
# What a prefill forward of the tiny pair allocates for a moment on a CPU (its attention scores
# over a 2k context: 1,024 x 2,048 x 4 heads in fp32, twice) dwarfs its KV (1.5 KiB a token):
# the margin the budget leaves for it.
MARGIN_GB = 0.2


def flood_need(tiny_pair, tokenizer, prompts: list[str]) -> int:
    """The bytes of every request's KV (target and draft) at its end."""
    return kv_need(str(tiny_pair[0]), str(tiny_pair[1]), tokenizer, prompts, MAX_TOKENS)


def assert_equal_alone(url: str, prompts: list[str], answers) -> None:
    for prompt, answer in zip(prompts, answers, strict=True):
        [single] = asyncio.run(send_all(url, [prompt], MAX_TOKENS))
        assert single.status == 200 and single.text == answer.text


@pytest.mark.anyio
async def test_a_flood_against_a_configured_budget(tiny_pair, loaded_pair):
    """12 requests whose KV is twice the budget (`engine.memory_budget_gb`), in process: the
    caches (running and prefix) never outgrow it."""
    prompts = flood_prompts(loaded_pair[1], 12, PROMPT_TOKENS)
    budget = flood_need(tiny_pair, loaded_pair[1], prompts) // 2
    async with served(*tiny_pair, engine={"memory_budget_gb": budget / 1e9}) as (client, engine):
        scheduler, peak = engine.scheduler, []
        step = scheduler.step

        def measured_step():  # on the MLX thread: what the caches hold after each step
            busy = step()
            cache = scheduler.prefix_cache.info()["bytes"] if scheduler.prefix_cache else 0
            peak.append(scheduler.kv_bytes() + cache)
            return busy

        scheduler.step = measured_step
        answers = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}) for p in prompts))
        assert [a.status_code for a in answers] == [200] * len(prompts)
        assert max(peak) <= budget < flood_need(tiny_pair, loaded_pair[1], prompts)
        assert (await client.get("/health")).status_code == 200
        for prompt, answer in zip(prompts, answers, strict=True):
            single = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert single.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]


@pytest.fixture()
def cgroup():
    try:
        group = Cgroup.create(unique_name("mlx-spec-flood-test"))
    except CgroupUnavailable as e:
        pytest.skip(f"no memory cgroup here ({e}): the configured budget's flood runs instead")
    yield group
    group.remove()


def test_a_flood_in_a_memory_cgroup(tiny_pair, loaded_pair, cgroup, tmp_path):
    """32 requests whose KV is about twice the budget the server derives from its cgroup's
    limit: the limit is set to what the server holds once loaded, the margin, and half the
    flood's KV."""
    prompts = flood_prompts(loaded_pair[1], 32, PROMPT_TOKENS)
    need = flood_need(tiny_pair, loaded_pair[1], prompts)
    env = {**os.environ, "MLX_SPEC_ENGINE__COST_MODEL": "false"}

    def start(log: Path):
        port = free_port()
        argv = [sys.executable, "-m", "server", "--model", str(tiny_pair[0]),
                "--draft-model", str(tiny_pair[1]), "--port", str(port),
                "--memory-margin-gb", str(MARGIN_GB)]
        return start_in(cgroup, argv, log, port, timeout=300, env=env)

    proc, url = start(tmp_path / "probe.log")  # no limit yet: what does it hold once loaded?
    reserved = httpx.get(f"{url}/health").json()["memory"]["reserved_bytes"]
    proc.terminate()
    proc.wait(timeout=60)
    cgroup.limit = reserved + int(MARGIN_GB * 1e9) + need // 2

    proc, url = start(tmp_path / "server.log")
    try:
        memory = httpx.get(f"{url}/health").json()["memory"]
        assert memory["limit_source"].startswith("cgroup v") and \
            memory["limit_bytes"] == cgroup.limit
        assert memory["budget_bytes"] < 0.75 * need  # about half of what the flood needs
        answers = asyncio.run(send_all(url, prompts, MAX_TOKENS))
        assert [a.status for a in answers] == [200] * 32, {a.error for a in answers}
        assert alive(proc, url) and cgroup.oom_kills == 0
        assert cgroup.peak_bytes is None or cgroup.peak_bytes <= cgroup.limit
        health = httpx.get(f"{url}/health").json()["memory"]
        assert metric(url, "mlx_spec_num_preemptions_total") == health["preemptions"]
        assert_equal_alone(url, prompts, answers)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
