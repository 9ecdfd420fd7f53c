"""Anthropic's Message Batches: a batch's requests (`{"custom_id", "params"}`, each a
`POST /v1/messages` body) run through the server's own app (`batch_jobs.BatchRunner`); once it
has ended, its results are one JSON line per request, in request order:
`{"custom_id", "result": {"type": "succeeded", "message"}}`, or `errored` with the error body,
or `canceled` for a request a cancel kept from starting. As at Anthropic, `request_counts`
are all `processing` until the batch ends. Batches are kept in memory until a restart, or with
`server.state_dir` across restarts: each result is kept as it comes, and a batch a restart
interrupted runs the requests without one when the server starts again."""

from __future__ import annotations

import json
import uuid

from api_schemas.anthropic import MessageBatch, MessageBatchCreate, MessageBatchRequestCounts
from server.http.common.errors import APIError
from server.http.common.timestamps import rfc3339
from server.http.jobs.lines import request_problem
from server.http.jobs.runner import COMPLETION_WINDOW_S, BatchRunner, Job, KeptResults, now
from server.http.jobs.state_db import StateDB

URL = "/v1/messages"
KIND, RESULTS = "message_batches", "message_batch_results"  # the StateDB's records
_FIELDS = ("id", "custom_ids", "requests", "created_at", "ended_at", "cancel_initiated_at",
           "cancelling")


class _MessageJob(Job):
    def __init__(self, batch_id: str, custom_ids: list[str], requests: list[dict],
                 db: StateDB | None = None):
        super().__init__(requests)
        self.id, self.custom_ids, self.db = batch_id, custom_ids, db
        self.kept = KeptResults(db, RESULTS)
        self.created_at, self.ended_at = now(), None
        self.cancel_initiated_at: int | None = None

    @classmethod
    def restored(cls, value: dict, results: dict[int, dict], db: StateDB) -> _MessageJob:
        """A batch as `saved` wrote it, with the results kept so far."""
        count = len(value["custom_ids"])
        job = cls(value["id"], value["custom_ids"], value["requests"] or [None] * count, db)
        job.created_at, job.ended_at = value["created_at"], value["ended_at"]
        job.cancel_initiated_at, job.cancelling = (value["cancel_initiated_at"],
                                                   value["cancelling"])
        for i, result in results.items():
            job.results[i] = result
        if job.ended_at is not None:
            job.requests = []
        return job

    def record(self, i: int, result: dict) -> None:
        super().record(i, result)
        self.kept.put(self.id, i, result)

    def saved(self) -> None:
        if self.db is not None:
            self.db.put(KIND, self.id, {name: getattr(self, name) for name in _FIELDS})

    def end(self) -> None:
        self.ended_at = now()
        self.requests = []  # the bodies; the results stay until the batch is deleted
        self.saved()

    def fail(self, error: Exception) -> None:
        self.end()  # the requests without a result are errored

    def result_lines(self) -> list[dict]:
        return [{"custom_id": custom_id, "result": _result(result, self.cancelling)}
                for custom_id, result in zip(self.custom_ids, self.results, strict=True)]

    def view(self, base_url: str) -> MessageBatch:
        status = ("ended" if self.ended_at is not None
                  else "canceling" if self.cancelling else "in_progress")
        return MessageBatch(
            id=self.id, processing_status=status, request_counts=self._counts(),
            created_at=rfc3339(self.created_at),
            expires_at=rfc3339(self.created_at + COMPLETION_WINDOW_S),
            ended_at=_time(self.ended_at), cancel_initiated_at=_time(self.cancel_initiated_at),
            results_url=(f"{base_url.rstrip('/')}{URL}/batches/{self.id}/results"
                         if self.ended_at is not None else None))

    def _counts(self) -> MessageBatchRequestCounts:
        if self.ended_at is None:
            return MessageBatchRequestCounts(processing=len(self.requests))
        counts = MessageBatchRequestCounts()
        for line in self.result_lines():
            kind = line["result"]["type"]
            setattr(counts, kind, getattr(counts, kind) + 1)
        return counts


class MessageBatches:
    def __init__(self, runner: BatchRunner, db: StateDB | None = None):
        self._runner, self._db = runner, db
        self._jobs: dict[str, _MessageJob] = {}
        if db is not None:
            kept = KeptResults(db, RESULTS).by_batch()
            for key, value in db.load(KIND):
                self._jobs[key] = _MessageJob.restored(value, kept.get(key, {}), db)

    def resume(self) -> None:
        """Run again the batches a restart interrupted (on the server's loop, at start): the
        requests without a kept result (none of a canceling one's)."""
        for job in self._jobs.values():
            if job.ended_at is None:
                self._runner.start(job)

    def create(self, body: MessageBatchCreate) -> _MessageJob:
        custom_ids = [r.custom_id for r in body.requests]
        seen: set[str] = set()
        for i, request in enumerate(body.requests):
            problem = request_problem({"url": URL, "body": request.params})
            if request.custom_id in seen:
                problem = f"custom_id {request.custom_id!r} is used by an earlier request"
            if problem is not None:
                raise APIError(400, f"requests.{i}: {problem}", param=f"requests.{i}",
                               redact=False)
            seen.add(request.custom_id)
        job = _MessageJob(f"msgbatch_{uuid.uuid4().hex[:24]}", custom_ids,
                          [{"custom_id": r.custom_id, "url": URL, "body": r.params}
                           for r in body.requests], self._db)
        self._jobs[job.id] = job
        job.saved()
        self._runner.start(job)
        return job

    def get(self, batch_id: str) -> _MessageJob:
        job = self._jobs.get(batch_id)
        if job is None:
            kept = "" if self._db is not None else " (batches are kept in memory until a restart)"
            raise APIError(404, f"No message batch with id {batch_id!r}{kept}", redact=False)
        return job

    def listed(self) -> list[_MessageJob]:
        """Every batch, newest first."""
        return list(reversed(self._jobs.values()))

    def cancel(self, batch_id: str) -> _MessageJob:
        """An unfinished batch is `canceling` until its requests in flight are done; an ended
        one is a 400."""
        job = self.get(batch_id)
        if job.ended_at is not None:
            raise APIError(400, f"message batch {batch_id!r} has ended: nothing to cancel",
                           redact=False)
        if not job.cancelling:
            job.cancelling, job.cancel_initiated_at = True, now()
            job.saved()
        return job

    def results(self, batch_id: str) -> bytes:
        job = self.get(batch_id)
        if job.ended_at is None:
            raise APIError(400, f"message batch {batch_id!r} is still processing: its results"
                           " come once it has ended", redact=False)
        return "".join(json.dumps(line, ensure_ascii=False) + "\n"
                       for line in job.result_lines()).encode()

    def delete(self, batch_id: str) -> None:
        """Only an ended batch can be deleted (cancel it first), as at Anthropic."""
        job = self.get(batch_id)
        if job.ended_at is None:
            raise APIError(400, f"message batch {batch_id!r} is still processing: cancel it and"
                           " wait until it has ended to delete it", redact=False)
        del self._jobs[batch_id]
        if self._db is not None:
            self._db.delete(KIND, batch_id)
        job.kept.drop(batch_id)


def _result(result: dict | None, cancelled: bool) -> dict:
    if result is None:
        if cancelled:
            return {"type": "canceled"}
        return {"type": "errored", "error": {"type": "error", "error": {
            "type": "api_error", "message": "the batch stopped before this request ran"}}}
    response = result["response"]
    if response["status_code"] < 400:
        return {"type": "succeeded", "message": response["body"]}
    return {"type": "errored", "error": response["body"]}


def _time(unix: int | None) -> str | None:
    return None if unix is None else rfc3339(unix)
