"""A real `python -m server` process: SIGTERM drains, and a non-streamed client that leaves
frees its row."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from support.servers import start_server

pytestmark = pytest.mark.slow


def pair_args(tiny_pair, *extra) -> list[str]:
    return ["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]), *extra]


def stream_lines(url, body, lines, done):
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
    except httpx.HTTPError as e:
        lines.append(f"transport error: {e}")
    finally:
        done.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_with_three_active_streams_ends_them_cleanly_and_exits_0(tiny_pair, tmp_path,
                                                                          sig):
    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  drain_timeout_s: 1.0\n")
    proc, url = start_server(pair_args(tiny_pair, "--config", str(config)), tmp_path / "log.txt")
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "stream": True, "ignore_eos": True}
    streams = [([], threading.Event()) for _ in range(3)]
    for lines, done in streams:
        threading.Thread(target=stream_lines, args=(url, body, lines, done), daemon=True).start()
    deadline = time.monotonic() + 60
    while not all(len(lines) >= 3 for lines, _ in streams):
        assert time.monotonic() < deadline, [lines[:2] for lines, _ in streams]
        time.sleep(0.05)
    started = time.monotonic()
    proc.send_signal(sig)
    health = health_while_draining(url)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    assert proc.wait(timeout=30) == 0  # drained: a clean exit (not uvicorn's signal raised again)
    elapsed = time.monotonic() - started
    assert elapsed < 15, elapsed  # drain_timeout_s (1 s) + uvicorn's backstop (5 s) + exit
    for lines, done in streams:
        assert done.wait(5)
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "shutting_down" or "shutting down" in error["message"]


def health_while_draining(url, timeout=5.0) -> httpx.Response:
    """/health, polled until it stops answering 200 (the drain lasts drain_timeout_s)."""
    deadline = time.monotonic() + timeout
    while (r := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
        assert r.json()["status"] == "ok"
        assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
        time.sleep(0.02)
    return r


def test_a_non_streamed_client_that_leaves_frees_its_row(tiny_pair, tmp_path):
    """No timing assumptions: the client closes its socket once its row is decoding, and the
    request must end as cancelled (no finished completion counted), not run to its length."""
    proc, url = start_server(pair_args(tiny_pair), tmp_path / "log.txt")
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "go"}],
                           "max_tokens": 4000, "ignore_eos": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for_batch_size(url, lambda n: n == 1)
        sock.close()
        wait_for_batch_size(url, lambda n: n == 0)
        assert "finish_reason=" not in finished_completions(url)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
        assert 'finish_reason="length"' in finished_completions(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for_batch_size(url, ok, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not ok(n := httpx.get(f"{url}/health").json()["batch_size"]):
        assert time.monotonic() < deadline, n
        time.sleep(0.02)


def finished_completions(url) -> str:
    """The completions counter's sample lines with a non-zero count."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return "\n".join(line for line in lines if line.startswith("mlx_spec_completions_total{")
                     and not line.endswith(" 0.0"))
