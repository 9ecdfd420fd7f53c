"""Anthropic's Message Batches: a batch's requests (`{"custom_id", "params"}`, each a
`POST /v1/messages` body) run through the server's own app (`batch_jobs.BatchRunner`); once it
has ended, its results are one JSON line per request, in request order:
`{"custom_id", "result": {"type": "succeeded", "message"}}`, or `errored` with the error body,
or `canceled` for a request a cancel kept from starting. As at Anthropic, `request_counts`
are all `processing` until the batch ends. Batches are kept in memory until a restart."""

from __future__ import annotations

import json
import uuid

from api_schemas.anthropic import MessageBatch, MessageBatchCreate, MessageBatchRequestCounts
from server.http.batch_jobs import COMPLETION_WINDOW_S, BatchRunner, Job, now
from server.http.batch_lines import request_problem
from server.http.errors import APIError
from server.http.timestamps import rfc3339

URL = "/v1/messages"


class _MessageJob(Job):
    def __init__(self, batch_id: str, custom_ids: list[str], requests: list[dict]):
        super().__init__(requests)
        self.id, self.custom_ids = batch_id, custom_ids
        self.created_at, self.ended_at = now(), None
        self.cancel_initiated_at: int | None = None

    def end(self) -> None:
        self.ended_at = now()
        self.requests = []  # the bodies; the results stay until the batch is deleted

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
    def __init__(self, runner: BatchRunner):
        self._runner = runner
        self._jobs: dict[str, _MessageJob] = {}

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
                           for r in body.requests])
        self._jobs[job.id] = job
        self._runner.start(job)
        return job

    def get(self, batch_id: str) -> _MessageJob:
        job = self._jobs.get(batch_id)
        if job is None:
            raise APIError(404, f"No message batch with id {batch_id!r} (batches are kept in"
                           " memory until a restart)", redact=False)
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
        if self.get(batch_id).ended_at is None:
            raise APIError(400, f"message batch {batch_id!r} is still processing: cancel it and"
                           " wait until it has ended to delete it", redact=False)
        del self._jobs[batch_id]


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
