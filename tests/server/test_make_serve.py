"""`make serve` (the Makefile's recipe, run by make itself, on the tiny pair through
`MLX_SPEC_*` variables) exits 0 after a clean drain: Ctrl-C typed at a terminal (a pty), and
SIGTERM sent to the server it runs."""

from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest
from support.paths import ROOT
from support.servers import TEST_SERVER_ENV, free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")]
# The test run's .venv is made already: make must not reinstall it (-o: take it as up to date).
MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed", "serve"]


def make_env(tiny_pair, port: int) -> dict:
    target, draft = tiny_pair
    return {**os.environ, **TEST_SERVER_ENV, "MLX_SPEC_MODELS__MODEL": str(target),
            "MLX_SPEC_MODELS__DRAFT_MODEL": str(draft), "MLX_SPEC_SERVER__PORT": str(port)}


def wait_healthy(port: int, alive) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert alive(), "make serve exited before serving"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("make serve did not start")


def test_ctrl_c_at_a_terminal_drains_and_make_exits_0(tiny_pair):
    port = free_port()
    pid, fd = pty.fork()
    if pid == 0:  # the child: make, in a session whose terminal is the pty
        os.chdir(ROOT)
        os.execvpe("make", MAKE, make_env(tiny_pair, port))
    output, status = bytearray(), []
    reader = threading.Thread(target=read_pty, args=(fd, output), daemon=True)
    reader.start()
    try:
        wait_healthy(port, lambda: not exited(pid, status))
        os.write(fd, b"\x03")  # Ctrl-C: the terminal signals its foreground process group
        deadline = time.monotonic() + 60
        while not exited(pid, status):
            assert time.monotonic() < deadline, "make serve still running after Ctrl-C"
            time.sleep(0.1)
    finally:
        if not status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    reader.join(5)
    os.close(fd)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status[0]) == 0, text[-3000:]
    assert "shutting down" in text and "Interrupt" not in text and "Error" not in text, text


def test_sigterm_to_the_server_drains_and_make_exits_0(tiny_pair, tmp_path):
    port = free_port()
    log = tmp_path / "make.log"
    with open(log, "w") as out:
        make = subprocess.Popen(MAKE, cwd=ROOT, env=make_env(tiny_pair, port),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, lambda: make.poll() is None)
        # Without a terminal the recipe's shell became the server: make's only child.
        (server,) = subprocess.run(["pgrep", "-P", str(make.pid)], capture_output=True,
                                   text=True, check=True).stdout.split()
        os.kill(int(server), signal.SIGTERM)
        assert make.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if make.poll() is None:
            make.kill()
            make.wait()
    text = log.read_text()
    assert "shutting down" in text and "Error" not in text, text


def read_pty(fd: int, into: bytearray) -> None:
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child's side closed
                return
            if not chunk:
                return
            into.extend(chunk)


def exited(pid: int, status: list) -> bool:
    if not status:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(code)
    return bool(status)
