"""The Responses API's background mode (`"background": true`): the request is answered at once
with a `queued` response, kept in the response store, and run through the server's own app
(`BatchRunner`); when it ends, the stored response becomes the finished one, under the same id
(`completed`, `incomplete`, or `failed` with the error a request would have got).
`POST /v1/responses/{id}/cancel` stops it: `cancelled`. With `stream: true` the request is answered
with its events instead, kept for `GET /v1/responses/{id}?stream=true&starting_after=N`
(`background_streams.py`); the run goes on if the client goes away. With `server.state_dir` the
request is kept until it ends, and one a restart interrupted runs again when the server starts
(without its events)."""

from __future__ import annotations

import asyncio
import json

from api_schemas.responses import ResponseObject, ResponsesRequest
from server.http.common.errors import APIError
from server.http.common.streaming import json_dict
from server.http.jobs.runner import BatchRunner
from server.http.jobs.state_db import StateDB
from server.http.openai.responses.background_streams import EventLog, EventLogs, owned, relay
from server.http.openai.responses.mapping import response_skeleton
from server.http.openai.responses.store import ResponseStore

ACTIVE = ("queued", "in_progress")
KIND = "background_requests"  # the StateDB's records: the requests of unfinished responses


class BackgroundResponses:
    def __init__(self, runner: BatchRunner, store: ResponseStore, db: StateDB | None = None):
        self._runner, self._store, self._db = runner, store, db
        self._tasks: dict[str, asyncio.Task] = {}
        self._streams = EventLogs()

    def resume(self) -> None:
        """Run again the responses a restart interrupted (on the server's loop, at start)."""
        if self._db is None:
            return
        for response_id, inner in self._db.load(KIND):
            try:
                response = self._store.get(response_id).response
            except APIError:  # deleted, or out of the store
                response = None
            if response is None or response.status not in ACTIVE:
                self._db.delete(KIND, response_id)
                continue
            inner = {**inner, "stream": False}  # the events before the restart are gone
            self._tasks[response_id] = self._runner.spawn(self._run(response, inner))

    def start(self, body: ResponsesRequest, raw: dict, model: str) -> ResponseObject:
        """The `queued` response; `raw` is the request's JSON, run as it is but in the
        foreground."""
        if self._store.max_entries <= 0:
            raise APIError(400, "background responses are read from the response store, which"
                           " keeps none here (server.responses_store_size: 0)",
                           param="background", code="invalid_value", redact=False)
        response = response_skeleton(body, model).model_copy(
            update={"status": "queued", "background": True})
        self._store.put(response, [])
        inner = {**raw, "background": False, "stream": bool(body.stream), "store": True}
        if self._db is not None:
            self._db.put(KIND, response.id, inner)
        if body.stream:
            self._streams.open(response)
        self._tasks[response.id] = self._runner.spawn(self._run(response, inner))
        return response

    def follow(self, response_id: str, starting_after: int | None):
        """The events of a background response created with `stream: true`, after
        `starting_after`, as they come; a 400 for another response."""
        log = self._streams.get(response_id)
        if log is None:
            self._store.get(response_id)  # a 404 for no such response
            raise APIError(400, f"response {response_id!r} has no events to stream: only a"
                           " background response created with stream: true has (the last"
                           " ones, until a restart)", param="stream", code="invalid_value",
                           redact=False)
        return log.follow(-1 if starting_after is None else starting_after)

    def cancel(self, response_id: str) -> ResponseObject:
        """A running background response is `cancelled`; a finished one is left as it is; a
        foreground one is a 400."""
        response = self._store.get(response_id).response
        if not response.background:
            raise APIError(400, f"response {response_id!r} did not run in the background: only"
                           " background responses can be cancelled", param="response_id",
                           code="not_background", redact=False)
        task = self._tasks.pop(response_id, None)
        if task is not None and response.status in ACTIVE:
            task.cancel()
            self._finish(response, response.model_copy(update={"status": "cancelled"}))
        return self._store.get(response_id).response

    def drop(self, response_id: str) -> None:
        """The response was deleted: stop it if it runs."""
        task = self._tasks.pop(response_id, None)
        if task is not None:
            task.cancel()
        self._forget(response_id)
        self._streams.drop(response_id)

    def _forget(self, response_id: str) -> None:
        if self._db is not None:
            self._db.delete(KIND, response_id)

    async def _run(self, queued: ResponseObject, inner: dict) -> None:
        self._finish(queued, queued.model_copy(update={"status": "in_progress"}))
        log = self._streams.get(queued.id) if inner["stream"] else None
        try:
            if log is not None:
                run_id, error = await self._streamed(queued, inner, log)
            else:
                run_id, error = await self._collected(inner)
            if self._runner.engine_failed:
                return  # in_progress: the server exits, and its next start runs it again
            if run_id is not None:
                stored = self._store.get(run_id)  # what the request's own run stored
                self._store.delete(run_id)
                self._finish(queued, stored.response.model_copy(update=owned(queued)),
                             stored.items)
            else:
                self._failed(queued, error.get("code") or error.get("type"),
                             error.get("message"))
        except Exception as e:  # noqa: BLE001 - a background response must end
            self._failed(queued, "server_error", str(e))
        finally:
            self._tasks.pop(queued.id, None)
            if log is not None:
                log.close()

    async def _collected(self, inner: dict) -> tuple[str | None, dict]:
        """(the run's response id, or None and its error)."""
        r = await self._runner.http().post("/v1/responses", json=inner)
        if r.status_code == 200:
            return r.json()["id"], {}
        return None, r.json().get("error") or {}

    async def _streamed(self, queued: ResponseObject, inner: dict, log: EventLog
                        ) -> tuple[str | None, dict]:
        async with self._runner.http().stream("POST", "/v1/responses", json=inner) as r:
            if r.status_code != 200:
                return None, json.loads(await r.aread()).get("error") or {}
            run_id, error = await relay(r.aiter_lines(), queued, log)
        return (None, error) if error is not None else (run_id, {})

    def _failed(self, queued: ResponseObject, code: str | None, message: str | None) -> None:
        failed = queued.model_copy(update={"status": "failed", "error": {
            "code": code or "server_error", "message": message or "the response failed"}})
        self._finish(queued, failed)
        log = self._streams.get(queued.id)
        if log is not None and not log.done:
            log.add({"type": "response.failed", "response": json_dict(failed)})

    def _finish(self, queued: ResponseObject, response: ResponseObject, items=None) -> None:
        """Store `response` under the background response's id, unless it was deleted."""
        if response.status not in ACTIVE:
            self._forget(queued.id)
        try:
            stored = self._store.get(queued.id)
        except APIError:
            return
        self._store.put(response, stored.items if items is None else items)
