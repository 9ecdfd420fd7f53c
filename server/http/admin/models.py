"""GET /v1/models[/{id}] (in OpenAI's shape, or Anthropic's for a request with an
`anthropic-version` header) and the draft admin endpoints; GET /health."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import PlainTextResponse

from api_schemas.admin import (
    CompatibilityRequest,
    CompatibilityResponse,
    DraftCandidate,
    DraftCandidates,
    DraftCard,
    Health,
    LoadDraftRequest,
    LoadTargetRequest,
    ModelEntry,
    ModelList,
    TargetCard,
    UnloadResponse,
)
from api_schemas.anthropic import ModelInfo, ModelInfoList
from server.engine import KEEP, IncompatibleDraft, ModelLoadError
from server.http.admin.draft_candidates import draft_candidates
from server.http.admin.model_access import local_model_path, weights_problem
from server.http.common import paging
from server.http.common.auth import require_admin_key, require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.errors import APIError, redact_paths, shape_of
from server.http.common.served_models import find_served, served_models
from server.http.common.timestamps import rfc3339
from server.model_files.gguf import UnsupportedGGUF, resolve_model_path

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["models"],
                   route_class=OffLoopJson)
health_router = APIRouter(tags=["health"], route_class=OffLoopJson)
admin = [Depends(require_admin_key)]


def anthropic_model(entry: ModelEntry) -> ModelInfo:
    return ModelInfo(id=entry.id, display_name=entry.id, role=entry.role, path=entry.path,
                     created_at=rfc3339(entry.created),
                     max_input_tokens=entry.max_model_len)


@router.get("/models", summary="List models",
            description="OpenAI's model list; with an `anthropic-version` header (Anthropic's"
            " clients) Anthropic's, paged by `limit`, `after_id` and `before_id`.")
async def list_models(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=1000, description="Anthropic clients: page size.")]
    = 20,
    after_id: Annotated[str | None, Query(description="Anthropic clients: the page after"
                                                      " this id.")] = None,
    before_id: Annotated[str | None, Query(description="Anthropic clients: the page before"
                                                       " this id.")] = None,
) -> ModelList | ModelInfoList:
    served = served_models(request.app.state.engine)
    if not _speaks_anthropic(request):
        return ModelList(data=served)
    infos = [anthropic_model(entry) for entry in served]
    return ModelInfoList(**paging.page(infos, limit, after=("after_id", after_id),
                                       before=("before_id", before_id)))


@router.get("/models/draft/candidates", dependencies=admin, summary="List draft candidates",
            description="Local models that could draft for the target (under the model"
            " roots, smaller, with the same tokenizer), smallest first.")
async def list_draft_candidates(request: Request) -> DraftCandidates:
    engine = request.app.state.engine
    found = await asyncio.to_thread(draft_candidates, request.app.state.access.roots,
                                    engine.target, engine.draft)
    return DraftCandidates(data=[DraftCandidate(**c) for c in found])


@router.get("/models/{model_id:path}", summary="Retrieve a model",
            description="One entry of the model list, by id, path or alias (Anthropic's shape"
            " for an Anthropic client); 404 for a model this server does not serve.")
async def retrieve_model(model_id: str, request: Request) -> ModelEntry | ModelInfo:
    engine = request.app.state.engine
    entry = find_served(engine, model_id)
    if entry is not None:
        return anthropic_model(entry) if _speaks_anthropic(request) else entry
    raise APIError(404, f"model {model_id!r} does not exist; this server serves "
                   + " and ".join(repr(entry.id) for entry in served_models(engine)),
                   param="model", code="model_not_found")


@router.post("/models/draft", dependencies=admin)
async def load_draft(body: LoadDraftRequest, request: Request) -> DraftCard:
    path = await _loadable(request, body.model, "model")
    card = await request.app.state.engine.load_draft(path, body.num_draft_tokens)
    return DraftCard(**vars(card))


@router.post("/models/target", dependencies=admin,
             description="Serve another target (and draft). Both load before anything changes"
             " (a failed load leaves the previous models serving); then every request in"
             " flight ends with a 503 (`model_replaced`), to be sent again.")
async def load_target(body: LoadTargetRequest, request: Request) -> TargetCard:
    path = await _loadable(request, body.model, "model")
    draft = KEEP
    if "draft_model" in body.model_fields_set:
        draft = None if (body.draft_model or "none").lower() == "none" else \
            await _loadable(request, body.draft_model, "draft_model")
    target, draft_card = await request.app.state.engine.load_target(
        path, name=body.model_name, draft=draft, num_draft_tokens=body.num_draft_tokens)
    card = {k: v for k, v in vars(target).items() if k != "num_draft_tokens"}
    return TargetCard(**card, draft=DraftCard(**vars(draft_card)) if draft_card else None)


async def _loadable(request: Request, ref: str, param: str) -> str:
    """The local folder of a model the admin endpoints may load (a GGUF file converted)."""
    path = await local_model_path(request.app.state.access.check(ref))
    path, problem = await _gguf_folder(path)
    if problem:
        raise APIError(400, problem, param=param, code="unsupported_model")
    return path


async def _gguf_folder(path: str) -> tuple[str, str | None]:
    """(a .gguf file's converted folder, converted once off the event loop, or why it cannot
    be); any other path as is."""
    try:
        return await asyncio.to_thread(resolve_model_path, path), None
    except (UnsupportedGGUF, ValueError, RuntimeError) as e:
        return path, redact_paths(f"cannot import this GGUF file: {e}")


@router.delete("/models/draft", dependencies=admin)
async def unload_draft(request: Request) -> UnloadResponse:
    engine = request.app.state.engine
    name = engine.draft.name if engine.draft is not None else None
    if not await engine.unload_draft():
        raise APIError(404, "no draft model is loaded", code="no_draft")
    return UnloadResponse(id=name)


@router.post("/models/draft/compatibility")
async def draft_compatibility(body: CompatibilityRequest, request: Request
                              ) -> CompatibilityResponse:
    """Weights present and readable, then the same tokenizer as the target's."""
    ref = request.app.state.access.check(body.model)
    if ref.hub:  # a download: admin-key holders only, as for loading
        require_admin_key(request)
    path = await local_model_path(ref)
    reason = await asyncio.to_thread(weights_problem, path)
    if reason is None:
        path, reason = await _gguf_folder(path)
    if reason is None:
        try:
            reason = await request.app.state.engine.check_draft(path)
        except IncompatibleDraft as e:
            reason = str(e)
        except ModelLoadError as e:  # a tokenizer that does not load: not a usable draft
            reason = redact_paths(str(e))
    return CompatibilityResponse(compatible=reason is None, reason=reason)


@health_router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(request.app.state.metrics.render(),
                             media_type="text/plain; version=0.0.4")


@health_router.get("/health", response_model_exclude_unset=True,
                   responses={503: {"model": Health, "description": "Draining (shutting"
                                    " down), or failed (the engine died; the process exits)."}})
async def health(request: Request, response: Response) -> Health:
    """200 while serving; 503 with `"status": "draining"` once shutdown began, so a load
    balancer stops sending requests that would get 503 `shutting_down`; 503 `"failed"` once
    the inference engine died (the process exits for its supervisor to restart it)."""
    engine = request.app.state.engine
    status = "failed" if engine.failed else "draining" if engine.draining else "ok"
    if status != "ok":
        response.status_code = 503
    draft = engine.draft.name if engine.draft is not None else None
    cache = engine.cache_info()
    # `distributed` only when the target is sharded: one process answers the shape it did.
    more = {"distributed": engine.distributed} if engine.distributed is not None else {}
    quantized = {role: {**model.quantization, "dequantized": model.dequantized}
                 for role, model in (("target", engine.target), ("draft", engine.draft))
                 if model is not None and model.quantization}
    if quantized:
        more["quantization"] = quantized
    if engine.cost_model_status is not None:
        more["cost_model"] = engine.cost_model_status
    memory = engine.memory_info()
    if memory is not None:
        more["memory"] = memory
    return Health(status=status, target=engine.model_name,
                  draft=draft, queue_depth=engine.queue_depth, batch_size=engine.batch_size,
                  cache_entries=cache["entries"], cache_bytes=cache["bytes"],
                  disk_cache_entries=cache["disk_entries"], disk_cache_bytes=cache["disk_bytes"],
                  **more)


def _speaks_anthropic(request: Request) -> bool:
    """A request from one of Anthropic's clients: the model list in Anthropic's shape."""
    shape = shape_of(request)
    return shape is not None and shape.name == "anthropic"
