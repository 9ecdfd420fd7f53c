"""The server is ready, and serves, before any forward-time measurement completes: readiness
never waits for the cost model (issue 67). Checked on states, not timings: the measurement is
held back until the test lets it go."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from support.http import chat_body
from support.servers import served

from server.engine.scheduling.scheduler import Scheduler
from server.engine.speculation.forward_source import CostSource

pytestmark = pytest.mark.anyio


@pytest.fixture()
def held_measurement(monkeypatch, tmp_path) -> threading.Event:
    """Forward-time measurements make no progress until the returned event is set (as on a
    machine that never has an idle moment); tables go to a folder of the test's own."""
    release = threading.Event()
    step = CostSource.step

    def held(self) -> bool:
        if not release.wait(0.005):
            return False
        return step(self)

    monkeypatch.setattr(CostSource, "step", held)
    use = Scheduler.use_cost_model
    monkeypatch.setattr(Scheduler, "use_cost_model",
                        lambda self, cache_dir=None, budget_s=None: use(self, tmp_path, budget_s))
    return release


async def test_the_server_is_ready_and_serves_before_any_measurement_completes(
        tiny_pair, held_measurement, caplog):
    caplog.set_level(logging.INFO, logger="server.engine.speculation.forward_source")
    body = chat_body(max_tokens=12, temperature=0)
    async with served(*tiny_pair, engine={"cost_model": True}) as (client, _):
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["cost_model"] == {"target": "formula", "draft": "formula",
                                               "measuring": True, "measured_s": 0.0,
                                               "budget_s": 10.0}
        before = await client.post("/v1/chat/completions", json=body)
        assert before.status_code == 200
        assert (await client.get("/health")).json()["cost_model"]["measuring"]
        held_measurement.set()
        for _ in range(1200):
            status = (await client.get("/health")).json()["cost_model"]
            if not status["measuring"]:
                break
            await asyncio.sleep(0.05)
        assert (status["target"], status["draft"], status["measuring"]) == \
            ("measured", "measured", False)
        assert 0 < status["measured_s"] <= 10.0
        after = await client.post("/v1/chat/completions", json=body)
    assert after.json()["choices"][0]["message"]["content"] == \
        before.json()["choices"][0]["message"]["content"]
    logged = caplog.text
    assert "target" in logged and "serving with formula forward times" in logged
    assert "measuring forward times of 1-32 rows x 1-5 tokens in idle moments" in logged
    assert "target: forward times measured in" in logged
    assert "draft: forward times measured in" in logged
