"""`X-Request-Id` and `server.log_format`: every answer carries the client's request id (or a
new one), and the request's log line names it; with `--log-format json` every line of the
server's log (uvicorn's too) is a JSON object, and a generation's carries its id, endpoint,
finish reason and the stats its answer reported."""

from __future__ import annotations

import json

import httpx
import pytest
from support.http import chat_body
from support.servers import start_server

pytestmark = pytest.mark.slow


@pytest.fixture()
def run(tiny_pair, tmp_path):
    """Start `python -m server` with extra flags: (url, log path); stopped afterwards."""
    started = []

    def start(*flags):
        log = tmp_path / f"server{len(started)}.log"
        proc, url = start_server(["--model", str(tiny_pair[0]), "--draft-model",
                                  str(tiny_pair[1]), *flags], log)
        started.append(proc)
        return url, log

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=30)


def test_json_log_lines_carry_the_request_id_and_the_stats(run):
    url, log = run("--log-format", "json")
    body = chat_body(max_tokens=6, temperature=0)
    r = httpx.post(f"{url}/v1/chat/completions", json=body,
                   headers={"X-Request-Id": "trace-42:a"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42:a"
    for bad in ("", "x" * 129, "spaces are not ids", "é"):
        r2 = httpx.post(f"{url}/v1/chat/completions", json=body,
                        headers={"X-Request-Id": bad.encode("utf-8")}, timeout=60)
        assert r2.headers["x-request-id"].startswith("req_")
    assert httpx.get(f"{url}/health").headers["x-request-id"].startswith("req_")
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    [mine] = [line for line in lines if line.get("request_id") == "trace-42:a"]
    assert (mine["logger"], mine["endpoint"], mine["finish_reason"]) == (
        "server.requests", "/v1/chat/completions", "length")
    assert mine["stats"]["generation_tokens"] == r.json()["usage"]["completion_tokens"] == 6
    assert mine["stats"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert any(line["logger"] == "uvicorn.access" for line in lines)
    assert {"time", "level", "logger", "message"} <= set(lines[0])


def test_text_log_names_the_request_id(run):
    url, log = run()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3},
                   headers={"X-Request-Id": "abc-123"}, timeout=60)
    assert r.headers["x-request-id"] == "abc-123"
    assert "/v1/completions length [abc-123]: prompt" in log.read_text()
