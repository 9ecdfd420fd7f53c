"""OpenAI's Batch API: a batch runs an uploaded file's requests (`batch_jobs.BatchRunner`) and
writes their results to files.

A batch is validated when created, as at OpenAI: a file with a line that is not a request
(bad JSON, no `custom_id` or a repeated one, another url than the batch's `endpoint`) fails
whole, with an error per line. Otherwise it runs at once and ends `completed` with an output
file (the 2xx results) and an error file (the rest), each in input order; `request_counts`
and `usage` grow as it runs. A cancelled batch is `cancelling` until its requests in flight
are done, then `cancelled`, with the results it has. Batches are kept in memory until a
restart, or with `server.state_dir` across restarts: each result is kept as it comes, and a
batch a restart interrupted runs the requests without one when the server starts again.
"""

from __future__ import annotations

import json
import logging
import uuid

from api_schemas.batches import (
    BatchCreateRequest,
    BatchError,
    BatchErrors,
    BatchObject,
    BatchUsage,
)
from server.http.common.errors import APIError
from server.http.jobs.lines import URLS, parse_line
from server.http.jobs.runner import COMPLETION_WINDOW_S, BatchRunner, Job, KeptResults, now
from server.http.jobs.state_db import StateDB
from server.http.openai.batches.files import FileStore

log = logging.getLogger(__name__)
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_REPORTED_ERRORS = 100  # a failed validation lists at most this many lines
KIND, RESULTS = "batches", "batch_results"  # the StateDB's records: batches, results so far
ENDED = ("completed", "cancelled", "failed", "expired")


class _OpenAIJob(Job):
    def __init__(self, batch: BatchObject, requests: list[dict], files: FileStore,
                 db: StateDB | None):
        super().__init__(requests)
        self.batch, self.files, self.db = batch, files, db
        self.kept = KeptResults(db, RESULTS)

    def record(self, i: int, result: dict) -> None:
        self.restore(i, result)
        self.kept.put(self.batch.id, i, result)

    def restore(self, i: int, result: dict) -> None:
        """Count a result (a new one, or one kept before a restart)."""
        super().record(i, result)
        counts = self.batch.request_counts
        if succeeded(result):
            counts.completed += 1
            add_usage(self.batch.usage, result["response"]["body"])
        else:
            counts.failed += 1

    def end(self) -> None:
        """Write the output and error files, in input order; `completed` or `cancelled`."""
        batch = self.batch
        batch.finalizing_at = now()
        done = [r for r in self.results if r is not None]
        for kind, results in (("output", [r for r in done if succeeded(r)]),
                              ("error", [r for r in done if not succeeded(r)])):
            if results:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
                info = self.files.add(f"{batch.id}_{kind}.jsonl", "batch_output", data.encode(),
                                      uploaded=False)
                setattr(batch, f"{kind}_file_id", info.id)
        if self.cancelling:
            batch.status, batch.cancelled_at = "cancelled", now()
        else:
            batch.status, batch.completed_at = "completed", now()
        self.requests, self.results = [], []  # the files hold them now
        self.saved()

    def fail(self, error: Exception) -> None:
        self.batch.status, self.batch.failed_at = "failed", now()
        self.batch.errors = BatchErrors(data=[BatchError(code="server_error",
                                                         message=str(error))])
        self.saved()

    def saved(self) -> None:
        """Write the batch through; an ended one's results are in its files now."""
        if self.db is not None:
            _save(self.db, self.batch)
        if self.batch.status in ENDED:
            self.kept.drop(self.batch.id)


class OpenAIBatches:
    def __init__(self, runner: BatchRunner, files: FileStore, db: StateDB | None = None):
        self._runner, self._files, self._db = runner, files, db
        self._batches: dict[str, BatchObject] = {}
        self._jobs: dict[str, _OpenAIJob] = {}
        if db is not None:
            self._batches = {key: BatchObject.model_validate(value)
                             for key, value in db.load(KIND)}

    def resume(self) -> None:
        """Run again the batches a restart interrupted (on the server's loop, at start): the
        requests without a kept result; a cancelling one ends with what it has."""
        if self._db is None:
            return
        kept = KeptResults(self._db, RESULTS).by_batch()
        for batch in self._batches.values():
            if batch.status in ("in_progress", "cancelling"):
                self._resume(batch, kept.get(batch.id, {}))

    def _resume(self, batch: BatchObject, kept: dict[int, dict]) -> None:
        source = self._files.find(batch.input_file_id)
        requests, errors = validate(source.data, batch.endpoint) if source else ([], [])
        job = _OpenAIJob(batch, requests, self._files, self._db)
        if source is None or errors or max(kept, default=-1) >= len(requests):
            job.fail(RuntimeError(f"its input file {batch.input_file_id} was deleted or changed"
                                  " before the restart it was interrupted by"))
            return
        batch.request_counts.completed = batch.request_counts.failed = 0
        batch.usage = BatchUsage()
        for i, result in kept.items():
            job.restore(i, result)
        job.cancelling = batch.status == "cancelling"
        log.info("batch %s resumed: %d of %d requests to run", batch.id,
                 len(requests) - len(kept), len(requests))
        self._jobs[batch.id] = job
        self._runner.start(job)

    def create(self, body: BatchCreateRequest, model: str) -> BatchObject:
        """The new batch: `failed` when its file does not validate, else `in_progress`."""
        source = self._files.get(body.input_file_id, param="input_file_id")
        if source.info.purpose != "batch":
            raise APIError(400, f"file {body.input_file_id!r} has purpose"
                           f" {source.info.purpose!r}; a batch's input must be uploaded with"
                           " purpose 'batch'", param="input_file_id", code="invalid_value",
                           redact=False)
        if body.endpoint not in URLS:
            raise APIError(400, f"endpoint must be one of {', '.join(URLS)}", param="endpoint",
                           code="invalid_value", redact=False)
        created = now()
        batch = BatchObject(id=f"batch_{uuid.uuid4().hex}", endpoint=body.endpoint, model=model,
                            input_file_id=body.input_file_id, status="validating",
                            created_at=created, expires_at=created + COMPLETION_WINDOW_S,
                            metadata=body.metadata)
        self._batches[batch.id] = batch
        requests, errors = validate(source.data, body.endpoint)
        if errors:
            batch.status, batch.failed_at = "failed", created
            batch.errors = BatchErrors(data=errors[:MAX_REPORTED_ERRORS])
        else:
            batch.status, batch.in_progress_at = "in_progress", created
            batch.request_counts.total = len(requests)
            self._jobs[batch.id] = job = _OpenAIJob(batch, requests, self._files, self._db)
            self._runner.start(job)
        if self._db is not None:
            _save(self._db, batch)
        return batch.model_copy(deep=True)

    def get(self, batch_id: str) -> BatchObject:
        return self._batch(batch_id).model_copy(deep=True)

    def listed(self) -> list[BatchObject]:
        """Every batch, newest first."""
        return [batch.model_copy(deep=True) for batch in reversed(self._batches.values())]

    def cancel(self, batch_id: str) -> BatchObject:
        """A running batch is `cancelling` until its requests in flight are done, then
        `cancelled`; cancelling a cancelling batch changes nothing; any other is a 409."""
        batch = self._batch(batch_id)
        if batch.status == "in_progress":
            batch.status, batch.cancelling_at = "cancelling", now()
            self._jobs[batch_id].cancelling = True
            if self._db is not None:
                _save(self._db, batch)
        elif batch.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"batch {batch_id!r} is {batch.status}: only a running batch can"
                           " be cancelled", param="batch_id", code="batch_not_running",
                           redact=False)
        return batch.model_copy(deep=True)

    def _batch(self, batch_id: str) -> BatchObject:
        batch = self._batches.get(batch_id)
        if batch is None:
            kept = "" if self._db is not None else " (batches are kept in memory until a restart)"
            raise APIError(404, f"No batch with id {batch_id!r}{kept}", param="batch_id",
                           code="batch_not_found", redact=False)
        return batch


def _save(db: StateDB, batch: BatchObject) -> None:
    db.put(KIND, batch.id, batch.model_dump(mode="json"))


def succeeded(result: dict) -> bool:
    return result["response"]["status_code"] < 400


def validate(data: bytes, endpoint: str) -> tuple[list[dict], list[BatchError]]:
    """The file's requests, and an error for each line (1-based) that is not one: OpenAI's
    checks (JSON, a unique string `custom_id`, POST to the batch's endpoint, a body) and ours
    (no `stream`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [BatchError(code="invalid_file", message=f"the file is not UTF-8: {e}")]
    requests, errors, seen = [], [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        request, code, message = parse_line(line)
        if code is None:
            code, message = _line_problem(request, endpoint, seen)
        if code is not None:
            errors.append(BatchError(code=code, message=message, line=number))
            continue
        seen.add(request["custom_id"])
        requests.append(request)
    if not requests and not errors:
        errors.append(BatchError(code="empty_file", message="the file holds no requests"))
    if len(requests) > MAX_LINES:
        errors.append(BatchError(code="too_many_requests",
                                 message=f"{len(requests)} requests; a batch holds at most"
                                         f" {MAX_LINES:,}"))
    return requests, errors


def _line_problem(request: dict, endpoint: str, seen: set) -> tuple[str | None, str | None]:
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "custom_id must be a non-empty string"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line"
    if request["url"] != endpoint:
        return "mismatched_url", f"url {request['url']!r} is not the batch's endpoint {endpoint!r}"
    return None, None


def add_usage(usage: BatchUsage, body) -> None:
    """Add a response body's token counts: OpenAI's chat, completions and embeddings
    (`prompt_tokens`), Responses' and Anthropic's (`input_tokens`)."""
    counts = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(counts, dict):
        return
    details = counts.get("prompt_tokens_details") or counts.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") or counts.get("cache_read_input_tokens") or 0
    prompt = counts.get("prompt_tokens", counts.get("input_tokens")) or 0
    if "cache_read_input_tokens" in counts:  # Anthropic's input_tokens leave the cached out
        prompt += cached
    output = counts.get("completion_tokens", counts.get("output_tokens")) or 0
    reasoning = (counts.get("completion_tokens_details")
                 or counts.get("output_tokens_details") or {}).get("reasoning_tokens") or 0
    usage.input_tokens += prompt
    usage.output_tokens += output
    usage.total_tokens += prompt + output
    usage.input_tokens_details.cached_tokens += cached
    usage.output_tokens_details.reasoning_tokens += reasoning
