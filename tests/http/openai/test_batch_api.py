"""OpenAI's Files and Batch APIs through the official `openai` SDK, and Anthropic's Message
Batches through the `anthropic` SDK: a batch's results are the answers of the same requests sent
one by one (greedy), in input order, with their usage summed; a file that is not a batch fails
validation line by line; cancelling stops a batch; every answer validates strictly as the SDKs'
own types."""

from __future__ import annotations

import io
import json
import logging
import time

import httpx
import pytest
from support.http import chat_body
from support.servers import make_settings, served_url, uvicorn_thread

openai = pytest.importorskip("openai")
from openai.types import Batch, FileObject  # noqa: E402

CHAT = chat_body(max_tokens=8, temperature=0)
REQUESTS = {
    "plain": {**CHAT, "use_draft": False},
    "drafted": {**CHAT, "num_draft_tokens": 3},
    "other": chat_body("Write a sorting function", max_tokens=12, temperature=0),
    "refused": {**CHAT, "temperature": 7},
}


@pytest.fixture(scope="module")
def server_url(engine, tiny_pair):
    """The SDK on a server whose batches run one request at a time (so one can be cancelled
    while it runs), that keeps 64 KB of files and wants a key (which the batches' own
    requests carry)."""
    with served_url(*tiny_pair, engine=engine, batch_concurrency=1, files_max_gb=64e-6,
                    api_key="sk-test") as url:
        yield url


@pytest.fixture(scope="module")
def sdk(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-test", max_retries=0)


@pytest.fixture(scope="module")
def claude(server_url):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server_url, api_key="sk-test", max_retries=0)


def jsonl(requests: dict, url="/v1/chat/completions") -> bytes:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})
                   + "\n" for cid, body in requests.items()).encode()


def upload(sdk, data: bytes, purpose="batch") -> FileObject:
    return sdk.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose=purpose)


def wait(sdk, batch_id: str) -> Batch:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch still {batch.status}")


def lines(sdk, file_id: str) -> list[dict]:
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


def strict(model, obj) -> None:
    model.model_validate(obj.model_dump(mode="json", exclude_unset=True))


def test_results_are_the_answers_of_the_requests_alone(sdk):
    source = upload(sdk, jsonl(REQUESTS))
    strict(FileObject, source)
    assert (source.purpose, source.bytes, source.filename) == ("batch", len(jsonl(REQUESTS)),
                                                               "requests.jsonl")
    batch = sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"run": "test"})
    assert batch.status == "in_progress" and batch.request_counts.total == 4
    batch = wait(sdk, batch.id)
    strict(Batch, batch)
    assert batch.status == "completed" and batch.metadata == {"run": "test"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    assert batch.completed_at >= batch.finalizing_at >= batch.in_progress_at >= batch.created_at
    out, errors = lines(sdk, batch.output_file_id), lines(sdk, batch.error_file_id)
    assert [r["custom_id"] for r in out] == ["plain", "drafted", "other"]  # input order
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for result in out:
        alone = answer_alone(sdk, REQUESTS[result["custom_id"]])
        body = result["response"]["body"]
        assert result["response"]["status_code"] == 200 and result["error"] is None
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert body["usage"]["completion_tokens"] == alone.usage.completion_tokens
        for name in usage:
            usage[name] += body["usage"][name]
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == \
        (usage["prompt_tokens"], usage["completion_tokens"], sum(usage.values()))
    [refused] = errors
    assert refused["custom_id"] == "refused" and refused["response"]["status_code"] == 400
    ids = [r["response"]["request_id"] for r in out + errors]  # each answer's X-Request-Id
    assert len(set(ids)) == 4 and all(i.startswith("req_") for i in ids)
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    assert {f.id for f in sdk.files.list(purpose="batch_output")} >= \
        {batch.output_file_id, batch.error_file_id}
    with pytest.raises(openai.ConflictError, match="only a running batch"):
        sdk.batches.cancel(batch.id)


def answer_alone(sdk, body: dict):
    """The same request through the SDK (our fields in `extra_body`)."""
    return sdk.chat.completions.create(model="", messages=body["messages"], extra_body={
        k: v for k, v in body.items() if k != "messages"})


def test_other_endpoints(sdk):
    text = {"t": {"prompt": "def f(", "max_tokens": 6, "temperature": 0}}
    source = upload(sdk, jsonl(text, "/v1/completions"))
    batch = wait(sdk, sdk.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                         completion_window="24h").id)
    [result] = lines(sdk, batch.output_file_id)
    alone = sdk.completions.create(model="", **text["t"])
    assert result["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    assert batch.error_file_id is None


def test_a_file_that_is_not_a_batch_fails_line_by_line(sdk):
    good = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": CHAT})
    data = "\n".join([good, "{not json", good, good.replace("/v1/chat/completions",
                                                             "/v1/completions").replace(
                          '"a"', '"b"'),
                      json.dumps({"method": "POST", "url": "/v1/chat/completions",
                                  "body": CHAT})]).encode()
    batch = sdk.batches.create(input_file_id=upload(sdk, data).id, completion_window="24h",
                               endpoint="/v1/chat/completions")
    strict(Batch, batch)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json"), (3, "duplicate_custom_id"), (4, "mismatched_url"),
        (5, "missing_custom_id")]


def test_cancel(sdk):
    many = {f"r{i}": chat_body(f"Write function number {i}", max_tokens=16) for i in range(30)}
    batch = sdk.batches.create(input_file_id=upload(sdk, jsonl(many)).id,
                               endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait(sdk, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    counts = batch.request_counts
    assert counts.total == 30 and counts.completed + counts.failed < 30
    if counts.completed:  # those in flight when it was cancelled
        assert len(lines(sdk, batch.output_file_id)) == counts.completed
    assert sdk.batches.cancel(batch.id).status == "cancelled"  # again: no change


def test_other_clients_are_served_while_a_batch_runs(sdk, server_url):
    """A batch takes `server.batch_concurrency` of the engine's rows (here 1): a client's
    request is answered, with its own text, while the batch is still running."""
    many = {f"r{i}": chat_body(f"Write function number {i}", max_tokens=16) for i in range(40)}
    batch = sdk.batches.create(input_file_id=upload(sdk, jsonl(many)).id,
                               endpoint="/v1/chat/completions", completion_window="24h")
    before = answer_alone(sdk, REQUESTS["other"]).choices[0].message.content
    running = sdk.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.request_counts.completed < 40
    assert 0 < pending_gauge(server_url) <= 40 - running.request_counts.completed
    batch = wait(sdk, batch.id)
    assert batch.request_counts.completed == 40 and pending_gauge(server_url) == 0
    assert answer_alone(sdk, REQUESTS["other"]).choices[0].message.content == before


def test_a_server_stopped_while_its_batch_runs_leaves_the_engine_serving(engine, tiny_pair,
                                                                         caplog):
    """Stopping cancels the batch's requests in flight; their events then find the server's
    event loop closed, which must not fail the engine's other requests (it did: the MLX thread
    raised, failed every running row, and died)."""
    from server.http.app import create_app

    many = {f"r{i}": chat_body(f"Write function number {i}", max_tokens=32) for i in range(40)}
    with uvicorn_thread(create_app(make_settings(*tiny_pair, batch_concurrency=4),
                                   engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.batches.create(input_file_id=upload(client, jsonl(many)).id,
                              endpoint="/v1/chat/completions", completion_window="24h")
        time.sleep(0.3)  # requests in flight
    time.sleep(0.5)  # their cancellation reaches the engine
    with uvicorn_thread(create_app(make_settings(*tiny_pair), engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert answer_alone(client, REQUESTS["plain"]).choices[0].finish_reason == "length"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def pending_gauge(server_url: str) -> float:
    """/metrics' count of batch requests not answered yet."""
    text = httpx.get(f"{server_url}/metrics").text
    [line] = [line for line in text.splitlines()
              if line.startswith("mlx_spec_batch_requests_pending ")]
    return float(line.split()[1])


def test_files_and_batches_listed_retrieved_deleted(sdk):
    first, second = upload(sdk, b"{}\n"), upload(sdk, b"[]\n", purpose="user_data")
    assert sdk.files.retrieve(first.id) == first
    listed = [f.id for f in sdk.files.list()]
    assert listed.index(second.id) < listed.index(first.id)  # newest first
    assert [f.id for f in sdk.files.list(purpose="user_data")] == [second.id]
    oldest = sdk.files.list(order="asc", limit=1)
    assert oldest.has_more and sdk.files.list(order="asc", after=oldest.data[0].id).data
    deleted = sdk.files.delete(second.id)
    assert (deleted.id, deleted.deleted) == (second.id, True)
    with pytest.raises(openai.NotFoundError, match="No file"):
        sdk.files.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(second.id)
    source = upload(sdk, jsonl({"a": CHAT}))
    made = [sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                               completion_window="24h").id for _ in range(2)]
    batches = sdk.batches.list(limit=2)  # newest first
    assert [b.id for b in batches.data] == made[::-1]
    assert all(isinstance(b, Batch) for b in batches.data)
    assert sdk.batches.retrieve(made[0]).id == made[0]
    for batch_id in made:
        wait(sdk, batch_id)
    with pytest.raises(openai.NotFoundError, match="No batch"):
        sdk.batches.retrieve("batch_nope")


def test_bad_requests(sdk):
    with pytest.raises(openai.BadRequestError, match="purpose must be one of"):
        upload(sdk, b"{}", purpose="anything")
    notes = upload(sdk, jsonl({"a": CHAT}), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        sdk.batches.create(input_file_id=notes.id, endpoint="/v1/chat/completions",
                           completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="No file"):
        sdk.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                           completion_window="24h")
    source = upload(sdk, jsonl({"a": CHAT}))
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        sdk.batches.create(input_file_id=source.id, endpoint="/v1/moderations",
                           completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                           completion_window="1h")
    with pytest.raises(openai.APIStatusError, match="does not fit") as e:
        upload(sdk, b" " * 70_000)
    assert e.value.status_code == 413


# -- Anthropic's Message Batches -------------------------------------------------------------

MESSAGE = {"model": "", "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "user", "content": "Write a function"}]}


def ended(claude, batch_id: str):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = claude.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch still {batch.processing_status}")


def test_message_batch_results_are_the_messages_alone(claude):
    from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse

    params = {"a": MESSAGE, "b": {**MESSAGE, "max_tokens": 12, "messages": [
        {"role": "user", "content": "Write a sorting function"}]},
        "bad": {k: v for k, v in MESSAGE.items() if k != "max_tokens"}}
    batch = claude.messages.batches.create(requests=[
        {"custom_id": cid, "params": p} for cid, p in params.items()])
    strict(MessageBatch, batch)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 3
    batch = ended(claude, batch.id)
    strict(MessageBatch, batch)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (2, 1, 0)
    assert batch.ended_at >= batch.created_at and batch.results_url.endswith("/results")
    results = list(claude.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["a", "b", "bad"]
    for r in results:
        strict(MessageBatchIndividualResponse, r)
    for r in results[:2]:
        fields = {k: v for k, v in params[r.custom_id].items() if k != "temperature"}
        alone = claude.messages.create(**fields, extra_body={"temperature": 0})  # SDK 2.x
        assert r.result.type == "succeeded"
        assert r.result.message.content[0].text == alone.content[0].text
    assert results[2].result.type == "errored"
    assert results[2].result.error.error.type == "invalid_request_error"
    assert "max_tokens" in results[2].result.error.error.message
    with pytest.raises(anthropic_errors().BadRequestError, match="has ended"):
        claude.messages.batches.cancel(batch.id)


def anthropic_errors():
    import anthropic

    return anthropic


def test_message_batch_cancel_list_delete(claude):
    many = [{"custom_id": f"r{i}", "params": {**MESSAGE, "max_tokens": 16, "messages": [
        {"role": "user", "content": f"Write function number {i}"}]}} for i in range(30)]
    batch = claude.messages.batches.create(requests=many)
    with pytest.raises(anthropic_errors().BadRequestError, match="still processing"):
        claude.messages.batches.delete(batch.id)
    canceling = claude.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at
    batch = ended(claude, batch.id)
    counts = batch.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.errored + counts.canceled == 30
    kinds = [r.result.type for r in claude.messages.batches.results(batch.id)]
    assert kinds.count("canceled") == counts.canceled
    listed = claude.messages.batches.list(limit=1)
    assert [b.id for b in listed.data] == [batch.id] and listed.has_more  # newest first
    older = claude.messages.batches.list(after_id=batch.id)
    assert batch.id not in [b.id for b in older.data] and older.data
    deleted = claude.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic_errors().NotFoundError, match="No message batch"):
        claude.messages.batches.retrieve(batch.id)


@pytest.mark.parametrize("requests, message", [
    ([{"custom_id": "a", "params": MESSAGE}, {"custom_id": "a", "params": MESSAGE}],
     "used by an earlier request"),
    ([{"custom_id": "a", "params": {**MESSAGE, "stream": True}}], "stream is not supported"),
    ([{"custom_id": "no spaces", "params": MESSAGE}], "custom_id"),
    ([], "requests"),
])
def test_message_batch_bad_requests(claude, requests, message):
    with pytest.raises(anthropic_errors().BadRequestError, match=message) as e:
        claude.messages.batches.create(requests=requests)
    assert e.value.body["type"] == "error"
