"""`priority` (vLLM's): requests that wait for a batch slot are admitted lowest priority first,
then oldest; a batch's requests wait behind the other clients' (priority 1). A server with one
batch slot makes the admission order the order the answers end in."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.http import chat_body
from support.servers import served

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

BLOCKER = chat_body("Write a long story", max_tokens=120, ignore_eos=True, temperature=0)


async def until(check, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def ended_in_order(client, engine, bodies: dict[str, dict], url="/v1/chat/completions"
                         ) -> list[str]:
    """Send a request that takes the one slot, then `bodies` one after another (each waiting
    before the next is sent): the names in the order their answers ended."""
    order: list[str] = []

    async def send(name, body):
        r = await client.post(url, json=body)
        assert r.status_code == 200, r.text
        order.append(name)

    blocker = asyncio.create_task(send("blocker", BLOCKER))
    await until(lambda: engine.batch_size == 1)
    tasks = []
    for i, (name, body) in enumerate(bodies.items()):
        tasks.append(asyncio.create_task(send(name, body)))
        await until(lambda i=i: engine.queue_depth == i + 1)
    await asyncio.gather(blocker, *tasks)
    return order[1:]


async def test_waiting_requests_go_lowest_priority_first_then_oldest(tiny_pair):
    async with served(*tiny_pair, engine={"max_batch_size": 1}) as (client, engine):
        short = dict(max_tokens=4, temperature=0)
        order = await ended_in_order(client, engine, {
            "first": chat_body("a", **short),
            "later": chat_body("b", priority=5, **short),
            "urgent": chat_body("c", priority=-1, **short),
            "also later": chat_body("d", priority=5, **short),
            "second": chat_body("e", priority=0, **short),
        })
        assert order == ["urgent", "first", "second", "later", "also later"]
        r = await client.post("/v1/chat/completions", json=chat_body(priority="high"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


async def test_a_batch_waits_behind_other_clients(tiny_pair):
    """Queued: the batch's two requests (one of them urgent), then a client's. Admitted: the
    urgent one, the client's, the other: when the client's answer ends, one batch request has
    (FIFO would have ended both first)."""
    long = dict(max_tokens=40, ignore_eos=True, temperature=0)
    async with served(*tiny_pair, engine={"max_batch_size": 1},
                      batch_concurrency=2) as (client, engine):
        lines = "".join(json.dumps({"custom_id": c, "method": "POST",
                                    "url": "/v1/chat/completions",
                                    "body": chat_body(c, **long, **extra)}) + "\n"
                        for c, extra in (("plain", {}), ("urgent", {"priority": -1})))
        r = await client.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("b.jsonl", lines.encode())})
        blocker = asyncio.create_task(client.post("/v1/chat/completions", json=BLOCKER))
        await until(lambda: engine.batch_size == 1)
        r = await client.post("/v1/batches", json={"input_file_id": r.json()["id"],
                                                    "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"})
        batch_id = r.json()["id"]
        await until(lambda: engine.queue_depth == 2)
        interactive = asyncio.create_task(client.post("/v1/chat/completions",
                                                      json=chat_body("x", max_tokens=2)))
        await until(lambda: engine.queue_depth == 3)
        await blocker
        assert (await interactive).status_code == 200
        batch = (await client.get(f"/v1/batches/{batch_id}")).json()
        assert batch["request_counts"]["completed"] == 1
        await until(lambda: engine.batch_size == 0 and engine.queue_depth == 0)
