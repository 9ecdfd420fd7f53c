"""The app factory. Nothing is built at import time."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from server.config import Settings, engine_config
from server.engine import InferenceEngine, TargetEntry
from server.engine import build_engine as engine_from_config
from server.http.admin import cache, models
from server.http.admin import playground as ui
from server.http.admin.draft_candidates import AUTO, auto_draft, discover_targets
from server.http.admin.metrics import ServerMetrics
from server.http.admin.model_access import ModelAccessPolicy
from server.http.anthropic import batch_routes as message_batches
from server.http.anthropic import errors as anthropic_errors
from server.http.anthropic import routes as messages
from server.http.anthropic.batches import MessageBatches
from server.http.common.auth import log_exposure
from server.http.common.bodies import install_body_limits
from server.http.common.errors import install_error_handlers
from server.http.common.request_ids import RequestIds
from server.http.jobs.runner import BatchRunner
from server.http.jobs.state_db import StateDB
from server.http.llama_cpp import routes as llama_cpp
from server.http.ollama import errors as ollama_errors
from server.http.ollama import routes as ollama
from server.http.openai import completions, embeddings, tokens
from server.http.openai.batches import routes as batches
from server.http.openai.batches.files import FileStore
from server.http.openai.batches.jobs import OpenAIBatches
from server.http.openai.responses import conversation_routes as conversations
from server.http.openai.responses import routes as responses
from server.http.openai.responses.background import BackgroundResponses
from server.http.openai.responses.conversations import ConversationStore
from server.http.openai.responses.store import ResponseStore
from server.http.openapi import install_openapi

log = logging.getLogger(__name__)

# `server.cors_origins` left unset: browser pages served from this machine, on any port.
LOOPBACK_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
# The APIs whose errors are not in OpenAI's shape; the first a request speaks wins.
ERROR_SHAPES = [ollama_errors.SHAPE, anthropic_errors.SHAPE]
# The admin endpoints (model and cache changes) never answer another origin's page.
ADMIN_PATHS = ("/v1/models/draft", "/v1/models/target", "/v1/cache")
# The POST routes that take a batch's requests: bounded by the Files budget, not the body bound.
UPLOAD_PATHS = ("/v1/files", "/v1/messages/batches")


def build_engine(settings: Settings) -> InferenceEngine:
    """The engine `settings` ask for, not started (`server.config.engine_config`), with its
    draft and standby targets resolved: an "auto" draft, discovered targets."""
    m = settings.models
    roots = ModelAccessPolicy.from_settings(settings).roots
    draft = _draft_path(m.model, m.draft_model, roots)
    more = [TargetEntry(t.model, t.name, _draft_path(t.model, t.draft_model, roots),
                        t.num_draft_tokens, t.adapter_path, t.chat_template)
            for t in m.more_targets] + _discovered(m, draft, roots)
    return engine_from_config(engine_config(settings, draft=draft, more_targets=more))


def _discovered(m, draft: str | None, roots) -> list[TargetEntry]:
    """`models.discover_targets`: the other local models as standby targets, each with its
    automatic draft."""
    if not m.discover_targets:
        return []
    taken = {m.model_name or m.model, *(t.name for t in m.more_targets)}
    found = [(name, folder) for name, folder in discover_targets(
        roots, [m.model, *([draft] if draft else []), *(t.model for t in m.more_targets)])
        if name not in taken]
    log.info("discover_targets: %d local models may be served: %s", len(found),
             ", ".join(name for name, _ in found) or "none")
    return [TargetEntry(str(folder), name, auto_draft(str(folder), roots))
            for name, folder in found]


def _draft_path(target: str, draft: str | None, roots) -> str | None:
    """`target`'s draft: None for none (left out, null or "none"); for "auto", the smallest
    local model that can draft for it (`auto_draft`), if any."""
    if (draft or "none").lower() == "none":
        return None
    if draft.lower() != AUTO:
        return draft
    found = auto_draft(target, roots)
    log.info("draft_model auto: %s for %s", found or "none found", target)
    return found


def create_app(settings: Settings, engine: InferenceEngine | None = None) -> FastAPI:
    """`engine`, if given, must already be started (tests share one across apps)."""
    owns_engine = engine is None
    state = StateDB(settings.server.state_dir) if settings.server.state_dir else None
    try:
        engine = engine or build_engine(settings)
    except BaseException:
        if state is not None:
            state.close()
        raise

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if owns_engine:
            engine.start()
        for work in (app.state.background, app.state.batches, app.state.message_batches):
            work.resume()  # what a restart interrupted (with server.state_dir)
        try:
            yield
        finally:
            await app.state.batch_runner.close()
            if state is not None:
                state.close()
            if owns_engine:
                engine.stop()

    app = FastAPI(title="MLX speculative decoding server", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.access = ModelAccessPolicy.from_settings(settings)
    app.state.responses = ResponseStore(settings.server.responses_store_size, state)
    app.state.conversations = ConversationStore(settings.server.responses_store_size, state)
    app.state.files = FileStore(int(settings.server.files_max_gb * 1e9), state)
    app.state.batch_runner = runner = BatchRunner(
        app, settings.server.batch_concurrency or max(1, settings.engine.max_batch_size // 2),
        settings.server.api_key)
    app.state.batches = OpenAIBatches(runner, app.state.files, state)
    app.state.message_batches = MessageBatches(runner, state)
    app.state.background = BackgroundResponses(runner, app.state.responses, state)
    log_exposure(settings.server)
    app.state.metrics = ServerMetrics(
        queue_depth=lambda: engine.queue_depth, batch_size=lambda: engine.batch_size,
        switcher=engine.switcher if engine.switcher.entries else None,
        batch_pending=lambda: runner.pending, suffix_info=engine.suffix_info,
        memory=engine.memory_info)
    engine.add_observer(app.state.metrics)
    install_error_handlers(app, ERROR_SHAPES)
    install_openapi(app, ERROR_SHAPES)
    install_bounds(app, settings.server)
    install_cors(app, settings.server.cors_origins)
    app.add_middleware(HeadAsGet)
    app.add_middleware(RequestIds)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(conversations.router)
    app.include_router(message_batches.router)
    app.include_router(messages.router)
    app.include_router(embeddings.router)
    app.include_router(batches.router)
    app.include_router(ollama.router)
    app.include_router(models.router)
    app.include_router(models.health_router)
    app.include_router(cache.router)
    app.include_router(tokens.router)
    app.include_router(llama_cpp.router)
    if settings.server.ui:
        app.include_router(ui.router)
    return app


def install_bounds(app: FastAPI, server) -> None:
    """`server.max_body_mb` for every body; the Files budget (plus an ordinary body for the
    form around the file) for a batch's requests."""
    limit = int(server.max_body_mb * 1e6)
    upload = (int(server.files_max_gb * 1e9) + limit, "server.files_max_gb")
    install_body_limits(app, limit=limit, setting="server.max_body_mb",
                        larger=dict.fromkeys(UPLOAD_PATHS, upload))


class HeadAsGet:
    """HEAD is answered as GET without its body (RFC 9110), on every GET route: FastAPI's
    routes take GET only. uvicorn drops the body, since its own scope still says HEAD."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class CrossOrigin:
    """CORS on every path but the admin endpoints'."""

    def __init__(self, app, **cors):
        self.app, self.cors = app, CORSMiddleware(app, **cors)

    async def __call__(self, scope, receive, send):
        admin = scope["type"] == "http" and scope["path"].startswith(ADMIN_PATHS)
        await (self.app if admin else self.cors)(scope, receive, send)


def install_cors(app: FastAPI, origins: list[str] | None) -> None:
    """Let browser pages of `origins` (None: this machine's) call the API, not its admin
    endpoints; [] lets none. Allowed pages may reach it on a private address too (Chrome's
    Private Network Access)."""
    if origins == []:
        return
    app.add_middleware(
        CrossOrigin, allow_origins=origins or [],
        allow_origin_regex=LOOPBACK_ORIGINS if origins is None else None,
        allow_methods=["*"], allow_headers=["*"], allow_private_network=True,
        expose_headers=["Retry-After", "X-Request-Id"], max_age=600)
