"""Start-up of `python -m server`: OpenBLAS without the user preloading it, and a taken port
reported before any model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.servers import free_port, start_server

from server import blas

pytestmark = pytest.mark.slow


def env_without_preload(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", blas.OPT_OUT_ENV, blas.REEXEC_MARKER_ENV)}
    return {**env, **extra}


def pair_args(tiny_pair) -> list[str]:
    return ["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1])]


needs_linux_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or blas.find_openblas() is None,
    reason="the OpenBLAS re-exec happens only on Linux with OpenBLAS installed")


@needs_linux_openblas
def test_server_started_without_preload_maps_openblas(tiny_pair, tmp_path):
    log = tmp_path / "server.log"
    proc, _ = start_server(pair_args(tiny_pair), log, env=env_without_preload())
    try:
        maps = Path(f"/proc/{proc.pid}/maps").read_text()  # execve keeps the pid
        assert "libopenblas" in maps
        assert "BLAS: OpenBLAS (" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@needs_linux_openblas
def test_opting_out_keeps_the_reference_blas_and_warns(tiny_pair, tmp_path):
    log = tmp_path / "server.log"
    env = env_without_preload(**{blas.OPT_OUT_ENV: "1"})
    proc, _ = start_server(pair_args(tiny_pair), log, env=env)
    try:
        assert "libopenblas" not in Path(f"/proc/{proc.pid}/maps").read_text()
        assert "WARNING server.blas: BLAS: " in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def probe(env: dict) -> list[str]:
    """A process that calls ensure_fast_blas, then prints its marker and whether OpenBLAS is
    mapped: the lines it printed (the process before a re-exec prints nothing)."""
    code = ("from server import blas; blas.ensure_fast_blas(); import mlx.core; "
            "import os; print(os.environ.get(blas.REEXEC_MARKER_ENV), blas.openblas_mapped())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.splitlines()


@needs_linux_openblas
def test_reexec_happens_once_and_the_marker_stops_a_loop():
    assert probe(env_without_preload()) == ["1 True"]  # re-executed once, with OpenBLAS
    # The marker set and no preload (as if the preload had not taken): no second re-exec.
    assert probe(env_without_preload(**{blas.REEXEC_MARKER_ENV: "1"})) == ["1 False"]
    assert probe(env_without_preload(**{blas.OPT_OUT_ENV: "1"})) == ["None False"]


def test_reexec_sets_the_preload_and_marker_and_keeps_argv(monkeypatch):
    calls = []
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "openblas_mapped", lambda: False)
    monkeypatch.setattr(blas, "find_openblas", lambda: Path("/lib/libopenblas.so.0"))
    monkeypatch.setattr(blas, "mlx_on_cpu", lambda: True)
    monkeypatch.setattr(blas.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(blas.sys, "orig_argv", ["python3", "-m", "server", "--port", "1"])
    for name in (blas.OPT_OUT_ENV, blas.REEXEC_MARKER_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    blas.ensure_fast_blas()
    [(exe, argv, env)] = calls
    assert (exe, argv) == (sys.executable, [sys.executable, "-m", "server", "--port", "1"])
    assert env["LD_PRELOAD"] == "/lib/libopenblas.so.0:/other.so"
    assert env[blas.REEXEC_MARKER_ENV] == "1"
    monkeypatch.setenv(blas.REEXEC_MARKER_ENV, "1")
    blas.ensure_fast_blas()  # the re-executed process: never again
    monkeypatch.delenv(blas.REEXEC_MARKER_ENV)
    monkeypatch.setenv(blas.OPT_OUT_ENV, "1")
    blas.ensure_fast_blas()
    assert len(calls) == 1


def test_a_taken_port_fails_at_once_before_any_model_loads(tiny_pair):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "server", *pair_args(tiny_pair),
                              "--port", str(port)], capture_output=True, text=True,
                             timeout=120, env=env_without_preload())
    assert out.returncode == 1, out
    log = out.stdout + out.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr
    assert "--port" in out.stderr
    assert "loading" not in log.lower(), log  # "loading target model ..." comes after listen
