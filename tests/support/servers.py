"""Servers for the tests: settings, started engines, the app in process (httpx), in a thread
(uvicorn) or in a subprocess (`python -m server`), and free ports."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import pytest


def make_settings(target, draft, engine=None, cache=None, models=None, **server):
    from server.config import Settings

    return Settings.load(
        None,
        models={"model": str(target), "draft_model": str(draft) if draft else None,
                **(models or {})},
        # Tests check what speculation outputs, so rows draft up to the caps: the cost model
        # would rightly stop the tiny pair from drafting (its draft is half the target).
        server=server, engine={"cost_model": False, **(engine or {})}, cache=cache or {},
    )


@contextmanager
def started_engine(target, draft, **settings):
    """An engine for `target` and `draft` (make_settings' other arguments), started; stopped
    on exit."""
    from server.http.app import build_engine

    eng = build_engine(make_settings(target, draft, **settings))
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free right now (`mlx.launch --starting-port`:
    rank i listens on the first + i)."""
    import socket

    for _ in range(100):
        first = free_port()
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


@asynccontextmanager
async def served(target, draft, *, model_roots=None, engine=None, cache=None, models=None,
                 **server):
    """A fresh started engine and an httpx client on its app; stopped on exit. `models`: more
    model settings."""
    import httpx

    from server.http.app import build_engine, create_app

    settings = make_settings(target, draft, engine, cache, models, **server)
    if model_roots is not None:
        settings.models.model_roots = [str(r) for r in model_roots]
    engine = build_engine(settings)
    engine.start()
    try:
        app = create_app(settings, engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as client:
            yield client, engine
    finally:
        engine.stop()


# The tiny pair's draft is half its target, so measured forward times say drafting barely pays
# and the cost model's choice would hang on timing noise: servers under test draft their caps.
TEST_SERVER_ENV = {"MLX_SPEC_ENGINE__COST_MODEL": "false"}


def start_server(args: list[str], log: Path, env: dict | None = None, module: str = "server"):
    """`python -m server ARGS --port P` in a subprocess, once /health answers: (proc, url).
    `env`: the process's environment (default: this one's); `module`: another entry point
    (a test's wrapper of `server.__main__`, found on the tests' path)."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", module, *args, "--port", str(port)]
    env = {**TEST_SERVER_ENV, **(os.environ if env is None else env)}
    if module != "server":
        tests = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"server did not start: {log.read_text()}")


@contextmanager
def running_server(args: list[str], log: Path):
    """`start_server`, terminated on exit."""
    proc, url = start_server(args, log)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def uvicorn_thread(app):
    """`app` served by uvicorn in a thread of this process: its URL."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def disk_cache_files(folder) -> list:
    """The prompt-cache files of a disk cache folder."""
    return sorted(folder.glob("*.safetensors"))


def _size(path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # a superseded entry, deleted since the listing
        return 0


async def wait_for_disk_entries(client, folder) -> dict:
    """/health once the writer has settled: at least one entry, and the bytes it reports are
    the files' (a second entry superseding the first may still be on its way)."""
    for _ in range(200):
        health = (await client.get("/health")).json()
        on_disk = sum(_size(f) for f in disk_cache_files(folder))
        if health["disk_cache_entries"] and health["disk_cache_bytes"] == on_disk:
            return health
        await asyncio.sleep(0.05)
    raise AssertionError(f"the disk cache never settled: {health}, {on_disk} bytes in files")


@contextmanager
def served_url(target, draft, engine=None, **settings):
    """Our app on `target` and `draft` (`make_settings`' other arguments) served by uvicorn in
    a thread: its URL. `engine`: a started one to serve; else one is started here."""
    from server.http.app import create_app

    with ExitStack() as stack:
        if engine is None:
            engine = stack.enter_context(started_engine(target, draft, **settings))
        app = create_app(make_settings(target, draft, **settings), engine)
        yield stack.enter_context(uvicorn_thread(app))
