"""The Responses API's background mode (`"background": true`): the request is answered at once
with a `queued` response, kept in the response store, and run through the server's own app
(`BatchRunner`); when it ends, the stored response becomes the finished one, under the same id
(`completed`, `incomplete`, or `failed` with the error a request would have got).
`POST /v1/responses/{id}/cancel` stops it: `cancelled`. With `server.state_dir` the request is
kept until it ends, and one a restart interrupted runs again when the server starts."""

from __future__ import annotations

import asyncio

from api_schemas.responses import ResponseObject, ResponsesRequest
from server.http.batch_jobs import BatchRunner
from server.http.errors import APIError
from server.http.response_store import ResponseStore
from server.http.responses_mapping import response_skeleton
from server.http.state_db import StateDB

ACTIVE = ("queued", "in_progress")
KIND = "background_requests"  # the StateDB's records: the requests of unfinished responses


class BackgroundResponses:
    def __init__(self, runner: BatchRunner, store: ResponseStore, db: StateDB | None = None):
        self._runner, self._store, self._db = runner, store, db
        self._tasks: dict[str, asyncio.Task] = {}

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
        inner = {**raw, "background": False, "stream": False, "store": True}
        if self._db is not None:
            self._db.put(KIND, response.id, inner)
        self._tasks[response.id] = self._runner.spawn(self._run(response, inner))
        return response

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

    def _forget(self, response_id: str) -> None:
        if self._db is not None:
            self._db.delete(KIND, response_id)

    async def _run(self, queued: ResponseObject, inner: dict) -> None:
        self._finish(queued, queued.model_copy(update={"status": "in_progress"}))
        try:
            r = await self._runner.http().post("/v1/responses", json=inner)
            if r.status_code == 200:
                answer = ResponseObject.model_validate(r.json())
                items = self._store.get(answer.id).items  # what the request's own run stored
                self._store.delete(answer.id)
                self._finish(queued, answer.model_copy(update={
                    "id": queued.id, "created_at": queued.created_at, "background": True}), items)
            else:
                error = r.json().get("error") or {}
                self._failed(queued, error.get("code") or error.get("type"), error.get("message"))
        except Exception as e:  # noqa: BLE001 - a background response must end
            self._failed(queued, "server_error", str(e))
        finally:
            self._tasks.pop(queued.id, None)

    def _failed(self, queued: ResponseObject, code: str | None, message: str | None) -> None:
        self._finish(queued, queued.model_copy(update={"status": "failed", "error": {
            "code": code or "server_error", "message": message or "the response failed"}}))

    def _finish(self, queued: ResponseObject, response: ResponseObject, items=None) -> None:
        """Store `response` under the background response's id, unless it was deleted."""
        if response.status not in ACTIVE:
            self._forget(queued.id)
        try:
            stored = self._store.get(queued.id)
        except APIError:
            return
        self._store.put(response, stored.items if items is None else items)
