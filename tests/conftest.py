"""Shared fixtures: tiny random models built once per test session, loaded through mlx_lm."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The cost model keeps each model's forward-time table under $XDG_CACHE_HOME; the tests' random
# models are new every session, so their tables go to a folder of the session's own (servers the
# tests start inherit it), not into the user's ~/.cache. Set before `server` is imported.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mlx-spec-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

from support.engine import pair_kit  # noqa: E402
from support.servers import make_settings, served_url, started_engine  # noqa: E402

from server.model_files.synthetic import build_foreign_vocab_model, build_pair  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_pair(model_dir) -> tuple[Path, Path]:
    """(target, draft): a 4-layer target and a draft made of its first 2 layers."""
    return build_pair(model_dir / "pair", "tiny")


@pytest.fixture(scope="session")
def quantized_pairs(tiny_pair, model_dir) -> dict[int, tuple[Path, Path]]:
    """The tiny pair quantized as mlx-community's models are: {4: (target, draft), 8: ...}."""
    from support.models import quantized_pair

    return {bits: quantized_pair(tiny_pair, model_dir / f"q{bits}", bits) for bits in (4, 8)}


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
    from support.thinking_model import build_thinking_pair

    return build_thinking_pair(tiny_pair, model_dir / "thinking")


@pytest.fixture(scope="session")
def zoo(model_dir) -> dict:
    """Tiny random models of `mlx_lm`'s own architectures (`support.models.ZOO`): each one's
    (target, draft) folders, the draft its first 2 layers, all sharing one tokenizer."""
    from support.models import ZOO

    from server.model_files.architectures import build
    from server.model_files.tokenizer_builder import train_tokenizer

    tokenizer = train_tokenizer(512, max_bytes=400_000)
    return {arch: build(model_dir / "zoo" / arch, arch, tokenizer=tokenizer) for arch in ZOO}


@pytest.fixture(scope="session")
def loaded_pair(tiny_pair):
    """(target_model, tokenizer, draft_model) loaded with mlx_lm.load."""
    from mlx_lm import load

    target, tokenizer = load(str(tiny_pair[0]))
    draft, _ = load(str(tiny_pair[1]))
    return target, tokenizer, draft


@pytest.fixture(scope="module")
def kit(tiny_pair):
    """The tiny target with its draft loaded, as the server loads them (a module's own: a
    test may load or unload the draft)."""
    return pair_kit(tiny_pair)


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


@pytest.fixture(scope="module")
def live_server(engine, tiny_pair):
    """Our app (the shared tiny-pair engine) served by uvicorn in a thread: its URL."""
    with served_url(*tiny_pair, engine=engine) as url:
        yield url

