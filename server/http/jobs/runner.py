"""Work a server does in the background, through its own app (`httpx.ASGITransport`, on the
event loop), so each request is an ordinary one to the engine, beside those clients send:
batches, and the Responses API's background responses (`background_responses.py`).

`server.batch_concurrency` requests of all batches together are in flight; a full queue is
waited out (`batch_lines.send`). A job that is cancelled starts no more of its requests; those
in flight finish. OpenAI's Batch API (`openai_batches.py`) and Anthropic's Message Batches
(`message_batches.py`) each keep their jobs and their shapes. Stopping the server cancels
whatever still runs; with `server.state_dir` each result is kept as it comes, and the next
start runs the requests that have none (`resume`). So does it after the engine died (the
process exits): what failed then keeps no result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from server.http.jobs.lines import send
from server.http.jobs.state_db import StateDB

log = logging.getLogger(__name__)

BATCH_PRIORITY = 1  # after the requests clients send themselves (0 unless they say)
COMPLETION_WINDOW_S = 24 * 3600  # both APIs' window: a batch "expires" 24 h after creation


@dataclass
class Job:
    """One batch's requests (`{"custom_id", "url", "body"}`) and, by index, their result lines.
    `cancelling` stops it from starting more; `record` and `end` are each API's bookkeeping."""

    requests: list[dict]
    results: list[dict | None] = field(init=False)
    cancelling: bool = False

    def __post_init__(self):
        self.results = [None] * len(self.requests)

    def record(self, i: int, result: dict) -> None:
        self.results[i] = result

    def end(self) -> None:
        """Every request started has finished (after a cancel, not every one started)."""

    def fail(self, error: Exception) -> None:
        """The run itself failed (a bug): the job must still end."""


class BatchRunner:
    def __init__(self, app, concurrency: int, api_key: str | None):
        self._app = app
        self._limit = asyncio.Semaphore(concurrency)
        self._headers = {"Authorization": f"Bearer {api_key or 'unused'}"}
        self._tasks: set[asyncio.Task] = set()
        self._client: httpx.AsyncClient | None = None
        self.pending = 0  # requests of running jobs not done yet (GET /metrics)

    def start(self, job: Job) -> None:
        """Run the job's requests that have no result yet (all of a new job's)."""
        todo = [i for i, result in enumerate(job.results) if result is None]
        self.pending += len(todo)
        self.spawn(self._run(job, todo))

    def spawn(self, work) -> asyncio.Task:
        """Run the coroutine `work` until it ends or the server stops."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Stop everything still running (the server is stopping)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    @property
    def engine_failed(self) -> bool:
        """The engine died: what ran then has no result to keep; the server exits, and with
        `server.state_dir` its next start runs those requests again (`resume`)."""
        return self._app.state.engine.failed is not None

    async def _run(self, job: Job, todo: list[int]) -> None:
        try:
            await asyncio.gather(*(self._one(job, i) for i in todo))
            if not self.engine_failed:
                job.end()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a batch must end, whatever went wrong
            log.exception("a batch failed")
            job.fail(e)

    async def _one(self, job: Job, i: int) -> None:
        try:
            async with self._limit:
                if job.cancelling:
                    return
                result = await send(self.http(), _after_others(job.requests[i]),
                                    lambda: self.engine_failed)
            if not self.engine_failed:
                job.record(i, result)
        finally:
            self.pending -= 1

    def http(self) -> httpx.AsyncClient:
        """A client of the app itself, with the server's key."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=self._app), base_url="http://batch",
                headers=self._headers, timeout=None)
        return self._client


class KeptResults:
    """A batch API's results, each written to the StateDB as it comes (`server.state_dir`) so
    that a restart loses none: records `batch_id/index` of one kind. Without a StateDB, none."""

    def __init__(self, db: StateDB | None, kind: str):
        self._db, self._kind = db, kind

    def put(self, batch_id: str, i: int, result: dict) -> None:
        if self._db is not None:
            self._db.put(self._kind, f"{batch_id}/{i}", result)

    def drop(self, batch_id: str) -> None:
        if self._db is not None:
            self._db.delete_prefix(self._kind, f"{batch_id}/")

    def by_batch(self) -> dict[str, dict[int, dict]]:
        kept: dict[str, dict[int, dict]] = {}
        for key, result in self._db.load(self._kind) if self._db is not None else ():
            batch_id, _, index = key.rpartition("/")
            kept.setdefault(batch_id, {})[int(index)] = result
        return kept


def _after_others(request: dict) -> dict:
    """A batch's request waits behind the other clients' for a slot (`priority` 1), unless its
    body sets its own."""
    body = request.get("body")
    if isinstance(body, dict) and "priority" not in body:
        request = {**request, "body": {**body, "priority": BATCH_PRIORITY}}
    return request


def now() -> int:
    return int(time.time())
