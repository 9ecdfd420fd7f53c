"""The events of background responses created with `stream: true`, kept so that a client can
follow them as they come and resume after a dropped connection
(`GET /v1/responses/{id}?stream=true&starting_after=N`), as at OpenAI.

A response's events are numbered from 0 (`sequence_number`): `response.created` (queued), then
the events of its run (`response.in_progress` onwards, their response snapshots under the
background response's id), ending with `response.completed`, `response.incomplete` or
`response.failed`. The events of the last `KEPT` finished streams are kept, in memory.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator

from api_schemas.responses import ResponseObject
from server.http.common.streaming import json_dict

KEPT = 64  # finished streams whose events are kept for resuming
ENDS = ("response.completed", "response.incomplete", "response.failed")


class EventLog:
    def __init__(self):
        self.events: list[dict] = []
        self.done = False
        self._changed = asyncio.Event()

    def add(self, event: dict) -> None:
        self.events.append({**event, "sequence_number": len(self.events)})
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, starting_after: int) -> AsyncIterator[dict]:
        """The events after `starting_after`, as they come, until the run has ended."""
        i = max(starting_after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._changed.wait()


class EventLogs:
    def __init__(self):
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def open(self, queued: ResponseObject) -> EventLog:
        log = self._logs[queued.id] = EventLog()
        log.add({"type": "response.created", "response": json_dict(queued)})
        finished = [key for key, kept in self._logs.items() if kept.done]
        for key in finished[:max(len(finished) - KEPT, 0)]:
            del self._logs[key]
        return log

    def get(self, response_id: str) -> EventLog | None:
        return self._logs.get(response_id)

    def drop(self, response_id: str) -> None:
        self._logs.pop(response_id, None)


def owned(queued: ResponseObject) -> dict:
    """What a run's response takes from the background response it runs for."""
    return {"id": queued.id, "created_at": queued.created_at, "background": True}


async def relay(lines: AsyncIterator[str], queued: ResponseObject, log: EventLog
                ) -> tuple[str | None, dict | None]:
    """Add the events of the run's SSE `lines` to `log`, their response snapshots rewritten to
    the background response's (the `response.created` the run starts with is the background
    response's own, already in the log): the run's own response id, and its `error` event if
    it failed after it started."""
    run_id = error = None
    async for line in lines:
        if not line.startswith("data:"):
            continue
        event = json.loads(line[len("data:"):])
        snapshot = event.get("response")
        if snapshot is not None:
            run_id = run_id or snapshot["id"]
            event["response"] = {**snapshot, **owned(queued)}
        if event["type"] == "error":
            error = event
        elif event["type"] != "response.created":
            log.add(event)
    return run_id, error
