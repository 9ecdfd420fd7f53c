"""Shared fixtures: tiny random models built once per test session, loaded through mlx_lm."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

# The cost model keeps each model's forward-time table under $XDG_CACHE_HOME; the tests' random
# models are new every session, so their tables go to a folder of the session's own (servers the
# tests start inherit it), not into the user's ~/.cache. Set before `server` is imported.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mlx-spec-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

from server.model_files.synthetic import build_foreign_vocab_model, build_pair  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_pair(model_dir) -> tuple[Path, Path]:
    """(target, draft): a 4-layer target and a draft made of its first 2 layers."""
    return build_pair(model_dir / "pair", "tiny")


@pytest.fixture(scope="session")
def padded_draft(model_dir) -> Path:
    """Same tokenizer as `tiny_pair`, a larger embedding (like Qwen2.5-0.5B vs 7B)."""
    _, draft = build_pair(model_dir / "padded", "tiny", draft_vocab_pad=64)
    return draft


@pytest.fixture(scope="session")
def foreign_model(model_dir) -> Path:
    """A model with a different vocabulary: an incompatible draft."""
    return build_foreign_vocab_model(model_dir / "foreign")


@pytest.fixture(scope="session")
def thinking_pair(tiny_pair, model_dir) -> tuple[Path, Path]:
    """The tiny pair taught to write `<think>` ... `</think>` (`thinking_model`)."""
    from thinking_model import build_thinking_pair

    return build_thinking_pair(tiny_pair, model_dir / "thinking")


@pytest.fixture(scope="session")
def loaded_pair(tiny_pair):
    """(target_model, tokenizer, draft_model) loaded with mlx_lm.load."""
    from mlx_lm import load

    target, tokenizer = load(str(tiny_pair[0]))
    draft, _ = load(str(tiny_pair[1]))
    return target, tokenizer, draft


def corrupt_copy(model: Path, folder: Path) -> Path:
    """`model` copied to `folder` (once) with its weights file overwritten: a failed load."""
    if not folder.exists():
        shutil.copytree(model, folder)
        (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return folder


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


@pytest.fixture(scope="session")
def engine(tiny_pair):
    """One started engine with the tiny pair, shared by read-only API tests."""
    with started_engine(*tiny_pair) as eng:
        yield eng


@pytest.fixture()
def app(engine, tiny_pair):
    from server.http.app import create_app

    return create_app(make_settings(*tiny_pair), engine)


@pytest.fixture()
async def client(app):
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


def chat_body(content="Write a function", **extra):
    return {"messages": [{"role": "user", "content": content}], **extra}


async def read_sse(response) -> list[dict | str]:
    """The `data:` payloads of an SSE response, JSON-decoded except `[DONE]`."""
    import json

    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


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


def start_server(args: list[str], log: Path, env: dict | None = None):
    """`python -m server ARGS --port P` in a subprocess, once /health answers: (proc, url).
    `env`: the process's environment (default: this one's)."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "server", *args, "--port", str(port)]
    env = {**TEST_SERVER_ENV, **(os.environ if env is None else env)}
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


@pytest.fixture(scope="module")
def live_server(engine, tiny_pair):
    """Our app (the shared tiny-pair engine) served by uvicorn in a thread: its URL."""
    from server.http.app import create_app

    with uvicorn_thread(create_app(make_settings(*tiny_pair), engine)) as url:
        yield url


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


def mlx_lm_greedy(target, prompt: str, max_tokens: int) -> dict[str, str]:
    """mlx_lm's greedy texts for `prompt`: as a chat's one user turn ("chat"), and bare
    ("text")."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(target))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True)
    return {"chat": generate(model, tokenizer, chat, max_tokens=max_tokens),
            "text": generate(model, tokenizer, prompt, max_tokens=max_tokens)}
