"""A real `python -m server` whose MLX worker dies (fault injection, `support.faulty_server`):
the requests in flight get the error, /health turns 503, the process exits non-zero within a
few seconds, and with `server.state_dir` a restart finishes the batch it was running, each
answer the one its request gets alone."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from support.faulty_server import INJECTED
from support.http import chat_body
from support.servers import start_server

from server.http.shutdown import EXIT_ENGINE_FAILED, FAILED_EXIT_S

pytestmark = pytest.mark.slow


def pair_args(tiny_pair, *extra) -> list[str]:
    return ["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]), *extra]


def fault_env(after_rounds: int, kind: str) -> dict:
    import os

    return {**os.environ, "FAULT_AFTER_ROUNDS": str(after_rounds), "FAULT_KIND": kind}


def kept_results(folder) -> list[str]:
    """The batch results the state database holds (`batch_id/index`)."""
    import sqlite3

    db = sqlite3.connect(f"file:{folder / 'state.sqlite3'}?mode=ro", uri=True)
    try:
        return sorted(key for (key,) in db.execute(
            "SELECT key FROM records WHERE kind = 'batch_results'"))
    finally:
        db.close()


def health_until_gone(url: str, timeout: float = 30.0) -> list[tuple[int, str]]:
    """(status, status field) of /health, polled until the server stops answering."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            return seen
        seen.append((r.status_code, r.json()["status"]))
        time.sleep(0.02)
    raise AssertionError(f"the server still answers: {seen[-3:]}")


@pytest.mark.parametrize("kind", ["mlx", "exit"])
def test_the_process_exits_non_zero_within_seconds(tiny_pair, tmp_path, kind):
    log = tmp_path / "log.txt"
    proc, url = start_server(pair_args(tiny_pair), log, env=fault_env(3, kind),
                             module="support.faulty_server")
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json=chat_body(max_tokens=50, ignore_eos=True))
        failed_at = time.monotonic()
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_failed" and INJECTED in error["message"]
        seen = health_until_gone(url)
        assert (503, "failed") in seen and (200, "ok") not in seen, seen
        assert proc.wait(timeout=30) == EXIT_ENGINE_FAILED
        assert time.monotonic() - failed_at < FAILED_EXIT_S + 2
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "exiting with status 70" in log.read_text()


RESPONSE = {"input": "Write a long story", "max_output_tokens": 300, "temperature": 0,
            "ignore_eos": True, "background": True}


def test_with_a_state_dir_a_restart_finishes_the_batch(tiny_pair, tmp_path):
    """Two short requests finish before the fault; the four others fail with the worker and
    keep no result, so the next start runs them; a background response the fault cut short
    runs again too."""
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  state_dir: {tmp_path / 'state'}\n")
    lengths = [2, 2, 300, 300, 300, 300]
    bodies = [chat_body(f"Write function number {i}", max_tokens=n, ignore_eos=True,
                        temperature=0) for i, n in enumerate(lengths)]
    data = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n"
                   for i, body in enumerate(bodies))
    args = pair_args(tiny_pair, "--config", str(config))
    # 30 rounds: the short ones' few, not the 60 and more (5 tokens a round at most) of 300
    proc, url = start_server(args, tmp_path / "faulty.txt", env=fault_env(30, "mlx"),
                             module="support.faulty_server")
    try:
        source = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},
                            files={"file": ("in.jsonl", data.encode())}).json()
        batch = httpx.post(f"{url}/v1/batches", json={
            "input_file_id": source["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}).json()
        deadline = time.monotonic() + 60
        while len(kept_results(tmp_path / "state")) < 2 and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        background = httpx.post(f"{url}/v1/responses", json=RESPONSE).json()
        assert background["status"] == "queued"
        assert proc.wait(timeout=60) == EXIT_ENGINE_FAILED
    finally:
        if proc.poll() is None:
            proc.kill()
    assert kept_results(tmp_path / "state") == [f"{batch['id']}/0", f"{batch['id']}/1"]

    proc, url = start_server(args, tmp_path / "restarted.txt")
    try:
        deadline = time.monotonic() + 120
        while (done := httpx.get(f"{url}/v1/batches/{batch['id']}").json())["status"] \
                != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        lines = [json.loads(line) for line in httpx.get(
            f"{url}/v1/files/{done['output_file_id']}/content").text.splitlines()]
        assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(6)]
        for line, body in zip(lines, bodies, strict=True):
            assert line["response"]["status_code"] == 200
            alone = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
            assert line["response"]["body"]["choices"][0]["message"]["content"] == \
                alone["choices"][0]["message"]["content"]
        while (done := httpx.get(f"{url}/v1/responses/{background['id']}").json())["status"] \
                in ("queued", "in_progress"):
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 300
        alone = httpx.post(f"{url}/v1/responses", json={**RESPONSE, "background": False},
                           timeout=60).json()
        assert done["output"][0]["content"][0]["text"] == \
            alone["output"][0]["content"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
