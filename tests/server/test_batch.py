"""`python -m server.batch`: a Batch API file run in process, each result equal to the same
request over HTTP (greedy), the lines that are not requests reported, never fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.http import chat_body
from support.servers import TEST_SERVER_ENV, make_settings

from server.batch import run_file

pytestmark = pytest.mark.anyio
CHAT = chat_body(max_tokens=8, temperature=0)
REQUESTS = {
    "chat": ("/v1/chat/completions", CHAT),
    "drafted": ("/v1/chat/completions", {**CHAT, "num_draft_tokens": 3}),
    "text": ("/v1/completions", {"prompt": "def f(", "max_tokens": 8, "temperature": 0}),
    "responses": ("/v1/responses", {"input": "Write a function", "max_output_tokens": 8,
                                    "temperature": 0}),
    "messages": ("/v1/messages", {"model": "", "max_tokens": 8, "temperature": 0,
                                  "messages": CHAT["messages"]}),
    "refused": ("/v1/chat/completions", {**CHAT, "temperature": 7}),
}


def batch_lines() -> list[str]:
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})
             for cid, (url, body) in REQUESTS.items()]
    return lines + ["{not json", "", json.dumps({"custom_id": "streamed", "method": "POST",
                                                "url": "/v1/chat/completions",
                                                "body": {**CHAT, "stream": True}}),
                    json.dumps({"custom_id": "elsewhere", "url": "/v1/audio/speech",
                                "body": {"input": "x"}})]


def text_of(url: str, body: dict) -> str:
    if url == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if url == "/v1/completions":
        return body["choices"][0]["text"]
    if url == "/v1/responses":
        return body["output"][0]["content"][0]["text"]
    return body["content"][0]["text"]


async def test_each_result_is_the_requests_answer_over_http(tiny_pair, client, tmp_path):
    out = tmp_path / "results.jsonl"
    assert await run_file(make_settings(*tiny_pair), batch_lines(), out) == 9  # not ""
    results = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in results}
    assert len(results) == 9 and len({r["id"] for r in results}) == 9
    for cid, (url, body) in REQUESTS.items():
        expected = await client.post(url, json=body)
        got = by_id[cid]["response"]
        assert got["status_code"] == expected.status_code, cid
        if expected.status_code == 200:
            assert text_of(url, got["body"]) == text_of(url, expected.json()), cid
        else:
            assert got["body"]["error"]["param"] == "temperature"
    assert by_id["streamed"]["error"]["message"] == "stream is not supported in a batch"
    assert by_id["elsewhere"]["error"]["message"].startswith("url must be one of")
    assert [r["error"]["code"] for r in results if r["custom_id"] is None] == ["invalid_json"]


def test_the_command(tiny_pair, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(batch_lines()[:3]) + "\n")
    run = subprocess.run([sys.executable, "-m", "server.batch", "-i", str(src), "-o", str(out),
                          "--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1])],
                         capture_output=True, text=True, timeout=300,
                         env={**TEST_SERVER_ENV, **os.environ})
    assert run.returncode == 0, run.stderr
    assert "3 results written" in run.stderr
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == \
        ["chat", "drafted", "text"]
