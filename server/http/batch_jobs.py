"""OpenAI's Batch API on a running server: a batch runs an uploaded file's requests through the
server's own app, beside the requests clients send, and writes their results to files.

A batch is validated when created, as at OpenAI: a file with a line that is not a request
(bad JSON, no `custom_id` or a repeated one, another url than the batch's `endpoint`) fails
whole, with an error per line. Otherwise it runs at once, `server.batch_concurrency` requests
in flight for all batches together (a full queue is waited out), and ends `completed` with an
output file (the 2xx results) and an error file (the rest), each in input order. A cancelled
batch starts no more requests; those in flight finish and are written. Batches, like files,
are kept in memory until a restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx

from api_schemas.batches import (
    BatchCreateRequest,
    BatchError,
    BatchErrors,
    BatchObject,
    BatchUsage,
)
from server.http.batch_lines import URLS, parse_line, send
from server.http.errors import APIError
from server.http.file_store import FileStore

log = logging.getLogger(__name__)

COMPLETION_WINDOW_S = 24 * 3600
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_REPORTED_ERRORS = 100  # a failed validation lists at most this many lines


@dataclass
class _Job:
    batch: BatchObject
    requests: list[dict]
    results: list[dict | None] = field(default_factory=list)
    task: asyncio.Task | None = None


class BatchJobs:
    def __init__(self, app, files: FileStore, concurrency: int, api_key: str | None):
        self._app, self._files = app, files
        self._limit = asyncio.Semaphore(concurrency)
        self._headers = {"Authorization": f"Bearer {api_key or 'unused'}"}
        self._jobs: dict[str, _Job] = {}
        self._client: httpx.AsyncClient | None = None

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
        now = int(time.time())
        batch = BatchObject(id=f"batch_{uuid.uuid4().hex}", endpoint=body.endpoint, model=model,
                            input_file_id=body.input_file_id, status="validating",
                            created_at=now, expires_at=now + COMPLETION_WINDOW_S,
                            metadata=body.metadata)
        requests, errors = validate(source.data, body.endpoint)
        job = _Job(batch, requests)
        self._jobs[batch.id] = job
        if errors:
            batch.status, batch.failed_at = "failed", now
            batch.errors = BatchErrors(data=errors[:MAX_REPORTED_ERRORS])
            return batch.model_copy(deep=True)
        batch.status, batch.in_progress_at = "in_progress", now
        batch.request_counts.total = len(requests)
        job.results = [None] * len(requests)
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        return batch.model_copy(deep=True)

    def get(self, batch_id: str) -> BatchObject:
        return self._job(batch_id).batch.model_copy(deep=True)

    def listed(self) -> list[BatchObject]:
        """Every batch, newest first."""
        return [job.batch.model_copy(deep=True) for job in reversed(self._jobs.values())]

    def cancel(self, batch_id: str) -> BatchObject:
        """A running batch is `cancelling` until its requests in flight are done, then
        `cancelled`; cancelling a cancelling batch changes nothing; any other is a 409."""
        batch = self._job(batch_id).batch
        if batch.status == "in_progress":
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
        elif batch.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"batch {batch_id!r} is {batch.status}: only a running batch can"
                           " be cancelled", param="batch_id", code="batch_not_running",
                           redact=False)
        return batch.model_copy(deep=True)

    async def close(self) -> None:
        """Stop every running batch (the server is stopping)."""
        tasks = [job.task for job in self._jobs.values() if job.task and not job.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _job(self, batch_id: str) -> _Job:
        job = self._jobs.get(batch_id)
        if job is None:
            raise APIError(404, f"No batch with id {batch_id!r} (batches are kept in memory"
                           " until a restart)", param="batch_id", code="batch_not_found",
                           redact=False)
        return job

    async def _run(self, job: _Job) -> None:
        try:
            await asyncio.gather(*(self._one(job, i) for i in range(len(job.requests))))
            self._finish(job)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a batch must end, whatever went wrong
            log.exception("batch %s failed", job.batch.id)
            job.batch.status, job.batch.failed_at = "failed", int(time.time())
            job.batch.errors = BatchErrors(data=[BatchError(code="server_error",
                                                            message=str(e))])

    async def _one(self, job: _Job, i: int) -> None:
        async with self._limit:
            if job.batch.status != "in_progress":
                return
            result = await send(self._http(), job.requests[i])
        job.results[i] = result
        counts = job.batch.request_counts
        if result["response"]["status_code"] < 400:
            counts.completed += 1
            add_usage(job.batch.usage, result["response"]["body"])
        else:
            counts.failed += 1

    def _finish(self, job: _Job) -> None:
        """Write the output and error files, in input order; `completed` or `cancelled`."""
        batch = job.batch
        cancelled = batch.status == "cancelling"
        batch.status, batch.finalizing_at = "finalizing", int(time.time())
        done = [r for r in job.results if r is not None]
        ok = [r for r in done if r["response"]["status_code"] < 400]
        failed = [r for r in done if r["response"]["status_code"] >= 400]
        for results, kind in ((ok, "output"), (failed, "error")):
            if results:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
                info = self._files.add(f"{batch.id}_{kind}.jsonl", "batch_output",
                                       data.encode(), budget=False)
                setattr(batch, f"{kind}_file_id", info.id)
        now = int(time.time())
        if cancelled:
            batch.status, batch.cancelled_at = "cancelled", now
        else:
            batch.status, batch.completed_at = "completed", now

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=self._app), base_url="http://batch",
                headers=self._headers, timeout=None)
        return self._client


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
