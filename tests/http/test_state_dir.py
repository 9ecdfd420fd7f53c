"""`server.state_dir`: what the Responses, Conversations, Files, Batch and Message Batches APIs
keep survives a restart, checked through the official SDKs against the same server before it
stopped: equal objects, equal items, the same greedy continuations. Work a restart interrupts
(a batch, a message batch, a background response) goes on at the next start: the results kept
before the stop are not run again (their ids are the same), and the rest equal the requests
sent alone. One server per folder; an unreadable database is a clear start-up error."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
import time
from contextlib import contextmanager

import pytest
from support.http import chat_body
from support.servers import make_settings, started_engine, uvicorn_thread

from server.http.jobs.state_db import StateDB, StateError

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

LONG = {"max_tokens": 64, "ignore_eos": True, "temperature": 0}  # slow enough to interrupt


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """This module's own engine, without suffix drafting: a restart here must come while
    requests run, and the shared engine's suffix index, filled with other tests' answers,
    drafts the tiny target's repetitive texts almost whole (a 5-request batch was done
    before the server stopped)."""
    with started_engine(*tiny_pair, engine={"suffix_max_mb": 0}) as eng:
        yield eng


@pytest.fixture()
def folder(tmp_path):
    return tmp_path / "state"


@contextmanager
def served(engine, tiny_pair, folder, **server):
    """A server on `folder` (uvicorn in a thread, so its start and stop run): the SDKs."""
    from server.http.app import create_app

    settings = make_settings(*tiny_pair, state_dir=str(folder), **server)
    with uvicorn_thread(create_app(settings, engine)) as url:
        yield (openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
               anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0))


def until(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"still not {what}")


def kept(folder, kind: str) -> dict[str, object]:
    """The records of `kind` in the folder's database (read only: a server may hold it)."""
    db = sqlite3.connect(f"file:{folder / 'state.sqlite3'}?mode=ro", uri=True)
    try:
        return {key: json.loads(value) for key, value in db.execute(
            "SELECT key, value FROM records WHERE kind = ? ORDER BY seq", (kind,))}
    finally:
        db.close()


def dumped(obj) -> dict:
    return obj.model_dump(mode="json")


def test_responses_and_conversations_survive_a_restart(engine, tiny_pair, folder):
    gen = dict(model=str(tiny_pair[0]), temperature=0, max_output_tokens=8)
    with served(engine, tiny_pair, folder) as (oai, _):
        first = oai.responses.create(input="Write a function", instructions="Be brief.", **gen)
        second = oai.responses.create(previous_response_id=first.id, input="Shorter", **gen)
        gone = oai.responses.create(input="x", max_output_tokens=2, model=gen["model"])
        oai.responses.delete(gone.id)
        items = dumped(oai.responses.input_items.list(second.id, order="asc"))
        conv = oai.conversations.create(
            items=[{"type": "message", "role": "user", "content": "You write Python."}],
            metadata={"topic": "code"})
        oai.responses.create(conversation=conv.id, input="Write a function", **gen)
        conv = oai.conversations.update(conv.id, metadata={"topic": "tests"})
        conv_items = dumped(oai.conversations.items.list(conv.id, order="asc"))
        # what the next turn is, asked before the restart
        third = oai.responses.create(previous_response_id=second.id, input="Again", **gen)
        turn = oai.responses.create(conversation=conv.id, input="Again", **gen)
        oai.conversations.items.delete(turn.output[0].id, conversation_id=conv.id)
        oai.conversations.items.delete(
            oai.conversations.items.list(conv.id, order="desc").data[0].id,
            conversation_id=conv.id)
        oai.responses.delete(third.id)

    with served(engine, tiny_pair, folder) as (oai, _):
        assert dumped(oai.responses.retrieve(first.id)) == dumped(first)
        assert dumped(oai.responses.retrieve(second.id)) == dumped(second)
        assert dumped(oai.responses.input_items.list(second.id, order="asc")) == items
        with pytest.raises(openai.NotFoundError, match="are kept, the last 256"):
            oai.responses.retrieve(gone.id)
        again = oai.responses.create(previous_response_id=second.id, input="Again", **gen)
        assert again.output_text == third.output_text
        assert again.usage.input_tokens == third.usage.input_tokens
        assert dumped(oai.conversations.retrieve(conv.id)) == dumped(conv)
        assert dumped(oai.conversations.items.list(conv.id, order="asc")) == conv_items
        again = oai.responses.create(conversation=conv.id, input="Again", **gen)
        assert again.output_text == turn.output_text

    with served(engine, tiny_pair, folder, responses_store_size=1) as (oai, _):
        oai.conversations.retrieve(conv.id)  # the one most recently stored is kept
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(first.id)


def test_files_and_finished_batches_survive_a_restart(engine, tiny_pair, folder):
    body = chat_body(max_tokens=6, temperature=0)
    data = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n"
                   for i in range(2)).encode()
    with served(engine, tiny_pair, folder) as (oai, claude):
        source = oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        deleted = oai.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        oai.files.delete(deleted.id)
        batch = oai.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
        batch = until(lambda: (b := oai.batches.retrieve(batch.id)).status == "completed" and b,
                      "completed")
        output = oai.files.content(batch.output_file_id).content
        messages = claude.messages.batches.create(requests=[
            {"custom_id": "m", "params": {"model": str(tiny_pair[0]), "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "Hi"}]}}])
        until(lambda: claude.messages.batches.retrieve(messages.id).processing_status
              == "ended", "ended")
        results = [dumped(r) for r in claude.messages.batches.results(messages.id)]
        ended = dumped(claude.messages.batches.retrieve(messages.id))

    with served(engine, tiny_pair, folder) as (oai, claude):
        assert oai.files.content(source.id).content == data
        assert dumped(oai.files.retrieve(source.id)) == dumped(source)
        with pytest.raises(openai.NotFoundError, match="are kept until deleted"):
            oai.files.retrieve(deleted.id)
        assert dumped(oai.batches.retrieve(batch.id)) == dumped(batch)
        assert oai.files.content(batch.output_file_id).content == output
        assert [b.id for b in oai.batches.list()] == [batch.id]
        restored = dumped(claude.messages.batches.retrieve(messages.id))
        assert restored.pop("results_url").split("/v1/")[1] == (
            ended.pop("results_url").split("/v1/")[1])  # the new server's address
        assert restored == ended
        assert [dumped(r) for r in claude.messages.batches.results(messages.id)] == results
        claude.messages.batches.delete(messages.id)
    with served(engine, tiny_pair, folder) as (oai, claude):
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.retrieve(messages.id)
    assert kept(folder, "batch_results") == {}  # an ended batch's results are in its files


def alone(oai, body: dict) -> str:
    body = dict(body)
    extra = {"ignore_eos": body.pop("ignore_eos")}
    return oai.chat.completions.create(model="", **body, extra_body=extra
                                       ).choices[0].message.content


def test_a_batch_interrupted_by_a_restart_goes_on(engine, tiny_pair, folder):
    bodies = [chat_body(f"Write function number {i}", **LONG) for i in range(6)]
    data = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n"
                   for i, body in enumerate(bodies)).encode()
    with served(engine, tiny_pair, folder, batch_concurrency=1) as (oai, _):
        source = oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = oai.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
        until(lambda: oai.batches.retrieve(batch.id).request_counts.completed >= 2, "started")
    before = kept(folder, "batch_results")
    assert 2 <= len(before) < len(bodies)

    with served(engine, tiny_pair, folder, batch_concurrency=1) as (oai, _):
        done = until(lambda: (b := oai.batches.retrieve(batch.id)).status == "completed" and b,
                     "completed")
        assert (done.request_counts.completed, done.request_counts.total) == (6, 6)
        lines = [json.loads(line) for line in
                 oai.files.content(done.output_file_id).text.splitlines()]
        assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(6)]
        for key, result in before.items():  # kept, not run again
            assert lines[int(key.rpartition("/")[2])] == result
        for line, body in zip(lines, bodies, strict=True):
            assert line["response"]["body"]["choices"][0]["message"]["content"] == alone(
                oai, body)
        assert done.usage.output_tokens == 6 * 64


def test_a_message_batch_interrupted_by_a_restart_goes_on(engine, tiny_pair, folder):
    params = [{"model": str(tiny_pair[0]), "max_tokens": 48, "temperature": 0,
               "ignore_eos": True, "messages": [{"role": "user", "content": f"Story {i}"}]}
              for i in range(5)]
    with served(engine, tiny_pair, folder, batch_concurrency=1) as (_, claude):
        batch = claude.messages.batches.create(
            requests=[{"custom_id": f"m{i}", "params": p} for i, p in enumerate(params)])
        until(lambda: len(kept(folder, "message_batch_results")) >= 2, "started")
    before = kept(folder, "message_batch_results")
    assert len(before) < len(params)

    with served(engine, tiny_pair, folder, batch_concurrency=1) as (_, claude):
        until(lambda: claude.messages.batches.retrieve(batch.id).processing_status == "ended",
              "ended")
        results = list(claude.messages.batches.results(batch.id))
        assert [r.custom_id for r in results] == [f"m{i}" for i in range(5)]
        assert claude.messages.batches.retrieve(batch.id).request_counts.succeeded == 5
        for key, result in before.items():
            assert results[int(key.rpartition("/")[2])].result.message.id == (
                result["response"]["body"]["id"])
        for result, p in zip(results, params, strict=True):
            message = claude.messages.create(  # the SDK sends no temperature: extra_body
                **{k: v for k, v in p.items() if k not in ("ignore_eos", "temperature")},
                extra_body={"ignore_eos": True, "temperature": 0})
            assert result.result.message.content[0].text == message.content[0].text


def test_a_background_response_interrupted_by_a_restart_goes_on(engine, tiny_pair, folder):
    gen = dict(model=str(tiny_pair[0]), input="Write a long story", temperature=0,
               max_output_tokens=400, extra_body={"ignore_eos": True})
    with served(engine, tiny_pair, folder) as (oai, _):
        queued = oai.responses.create(**gen, background=True)
        until(lambda: oai.responses.retrieve(queued.id).status == "in_progress", "running")
    assert list(kept(folder, "background_requests")) == [queued.id]

    with served(engine, tiny_pair, folder) as (oai, _):
        done = until(lambda: (r := oai.responses.retrieve(queued.id)).status == "incomplete"
                     and r, "finished")
        assert (done.id, done.background, done.usage.output_tokens) == (queued.id, True, 400)
        assert done.output_text == oai.responses.create(**gen).output_text
        [item] = oai.responses.input_items.list(done.id)
        assert item.content[0].text == "Write a long story"
    assert kept(folder, "background_requests") == {}


def test_one_server_per_folder_and_a_clear_error_for_a_bad_database(folder, tmp_path):
    db = StateDB(folder)
    with pytest.raises(StateError, match="in use by another server"):
        StateDB(folder)
    db.close()
    StateDB(folder).close()  # free again

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "state.sqlite3").write_bytes(b"not a database" * 100)
    with pytest.raises(StateError, match="cannot be read.*move it away"):
        StateDB(bad)
    StateDB(tmp_path / "other").close()
    raw = sqlite3.connect(tmp_path / "other" / "state.sqlite3")
    raw.execute("UPDATE meta SET value = '99' WHERE name = 'schema'")
    raw.commit()
    raw.close()
    with pytest.raises(StateError, match="another version"):
        StateDB(tmp_path / "other")


def test_the_command_line_refuses_a_folder_in_use(tiny_pair, folder):
    from server.__main__ import main

    held = StateDB(folder)
    try:
        with pytest.raises(SystemExit, match="in use by another server"):
            main(["--model", str(tiny_pair[0]), "--draft-model", "none", "--port", "0",
                  "--state-dir", str(folder)])
    finally:
        held.close()


def test_a_failed_write_is_logged_and_served_from_memory(folder, caplog):
    from api_schemas.responses import ResponseObject
    from server.http.openai.responses.store import ResponseStore

    db = StateDB(folder)
    store = ResponseStore(4, db)
    db._db.close()  # writes fail from now on
    response = ResponseObject(status="completed", model="m")
    with caplog.at_level(logging.ERROR):
        store.put(response, [])
    assert store.get(response.id).response == response
    assert "could not write responses" in caplog.text
