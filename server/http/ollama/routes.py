"""Ollama's API under /api, for the apps that speak it (Open WebUI, Continue, Home Assistant,
the `ollama` client libraries...): chat, generate and embed over the same engine path as the
OpenAI routes, and the model list, details and loaded models. Errors leave as Ollama's
`{"error": message}` (server.http.common.errors)."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter, Depends, Request

from api_schemas.ollama import (
    OLLAMA_API_VERSION,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.engine import on_gpu
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.chat_translation import renamed_params
from server.http.common.completion import complete, complete_chat, each_choice
from server.http.common.embeddings import embed_inputs
from server.http.common.errors import APIError
from server.http.common.request_mapping import completion_prompt, serving
from server.http.common.served_models import find_served, served_models
from server.http.common.timestamps import rfc3339
from server.http.ollama.format import OllamaFormat, created_at
from server.http.ollama.mapping import (
    RENAMES,
    chat_from_ollama,
    fills_context,
    generate_from_ollama,
)

router = APIRouter(prefix="/api", dependencies=[Depends(require_api_key)], tags=["ollama"],
                   route_class=OffLoopJson)


@router.get("/version", summary="The Ollama API version this server follows")
async def version() -> dict:
    return {"version": OLLAMA_API_VERSION}


@router.post("/chat", summary="Ollama chat")
async def chat(body: OllamaChatRequest, request: Request):
    engine = request.app.state.engine
    body.model = served_name(engine, body.model)

    def make_format(tools, start):
        return OllamaFormat(body.model, engine.tokenizer, chat=True, tool_calls=tools,
                            start=start)

    with renamed_params(RENAMES):
        return await complete_chat(request, chat_from_ollama(body), make_format,
                                   fill_context=fills_context(body), ndjson=True,
                                   truncate=body.truncate is not False)


@router.post("/generate", summary="Ollama generate")
async def generate(body: OllamaGenerateRequest, request: Request):
    engine = request.app.state.engine
    body.model = served_name(engine, body.model)
    if not body.prompt and body.suffix is None:  # Ollama's "load the model": nothing to write
        async with serving(engine, body.model):
            return {"model": body.model, "created_at": created_at(), "response": "",
                    "done": True, "done_reason": "load"}
    mapped = generate_from_ollama(body)
    with renamed_params(RENAMES):
        if isinstance(mapped, ChatCompletionRequest):
            return await complete_chat(
                request, mapped,
                lambda tools, start: OllamaFormat(body.model, engine.tokenizer, chat=False,
                                                  start=start),
                fill_context=fills_context(body), ndjson=True)
        return await _complete_text(request, mapped, fills_context(body))


async def _complete_text(request: Request, body: CompletionRequest, fill_context: bool):
    engine = request.app.state.engine
    return await complete(
        request, body,
        lambda engine: (body, [completion_prompt(engine, body.prompt, body.suffix)]),
        each_choice(lambda: OllamaFormat(body.model, engine.tokenizer, chat=False)),
        fill_context=fill_context, ndjson=True)


@router.post("/embed", summary="Ollama embed")
async def embed(body: OllamaEmbedRequest, request: Request) -> dict:
    engine = request.app.state.engine
    inputs = [body.input] if isinstance(body.input, str) else body.input
    started = datetime.now(timezone.utc)
    vectors, used = await embed_inputs(engine, _bare(body.model), inputs, body.dimensions,
                                       truncate=body.truncate is not False)
    took = (datetime.now(timezone.utc) - started).total_seconds()
    return {"model": body.model, "embeddings": [v.tolist() for v in vectors],
            "total_duration": round(took * 1e9), "load_duration": 0, "prompt_eval_count": used}


@router.get("/tags", summary="Ollama's model list")
async def tags(request: Request) -> dict:
    return {"models": [_card(request.app.state.engine, entry)
                       for entry in served_models(request.app.state.engine)
                       if entry.role != "draft"]}


@router.get("/ps", summary="Ollama's loaded models")
async def ps(request: Request) -> dict:
    engine = request.app.state.engine
    loaded = [e for e in served_models(engine) if e.role != "standby"]
    cards = [_card(engine, e) for e in loaded]
    return {"models": [card | {"size_vram": card["size"] if on_gpu() else 0,
                               "context_length": e.max_model_len}
                       for card, e in zip(cards, loaded, strict=True)]}


@router.post("/show", summary="Ollama's model details")
async def show(body: OllamaShowRequest, request: Request) -> dict:
    engine = request.app.state.engine
    name = body.model or body.name
    if not name:
        raise APIError(400, "model: a model name is needed", param="model",
                       code="invalid_value")
    entry = _entry(engine, served_name(engine, name))
    config, model = _config(engine, entry)
    arch = config.get("model_type", "unknown")
    info = {"general.architecture": arch, "general.basename": entry.id,
            f"{arch}.context_length": entry.max_model_len,
            f"{arch}.embedding_length": config.get("hidden_size"),
            f"{arch}.block_count": config.get("num_hidden_layers")}
    if model is not None:
        info["general.parameter_count"] = model.parameter_count()
    tokenizer = model.tokenizer if model is not None else None
    return {"modelfile": "", "parameters": "", "license": "",
            "template": getattr(tokenizer, "chat_template", None) or "",
            "details": _details(config, model), "capabilities": _capabilities(entry, model),
            "model_info": {k: v for k, v in info.items() if v is not None},
            "modified_at": rfc3339(entry.created)}


# ------------------------------------------------------------------------------ model details
def _bare(name: str) -> str:
    return name.removesuffix(":latest")


def served_name(engine, name: str) -> str:
    """`name`, or without the `:latest` tag Ollama's clients add when that is what we serve."""
    return name if _answers(engine, name) else _bare(name)


def _answers(engine, name: str) -> bool:
    """Whether `name` names a model this server serves (what `served_models` lists), without
    reading the standby targets' folders."""
    loaded = [m for m in (engine.draft, engine.embedder.model if engine.embedder else None)
              if m is not None]
    return (engine.serves(name) or engine.switcher.entry_named(name) is not None
            or any(name in (m.name, m.path) for m in loaded))


def _entry(engine, name: str):
    entry = find_served(engine, name)
    if entry is None:
        raise APIError(404, f"model {name!r} not found", param="model", code="model_not_found")
    return entry


def _loaded(engine, entry):
    """The loaded model of a served entry (None for a standby target)."""
    return {"target": engine.target, "draft": engine.draft,
            "embedding": engine.embedder.model if engine.embedder else None}.get(entry.role)


def _config(engine, entry) -> tuple[dict, object | None]:
    model = _loaded(engine, entry)
    if model is not None:
        return model.config, model
    try:
        return json.loads((Path(entry.path) / "config.json").read_text()), None
    except (OSError, ValueError):
        return {}, None


def _card(engine, entry) -> dict:
    config, model = _config(engine, entry)
    size = model.nbytes() if model is not None else _disk_size(entry.path)
    return {"name": entry.id, "model": entry.id, "modified_at": rfc3339(entry.created),
            "size": size, "digest": hashlib.sha256(entry.path.encode()).hexdigest(),
            "details": _details(config, model)}


def _details(config: dict, model) -> dict:
    arch = config.get("model_type", "")
    quantization = config.get("quantization") or {}
    dtype = model.float_dtype() if model is not None else str(config.get("torch_dtype", ""))
    level = f"Q{quantization['bits']}" if "bits" in quantization else \
        {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, "")
    return {"parent_model": "", "format": "mlx", "family": arch,
            "families": [arch] if arch else None,
            "parameter_size": _count(model.parameter_count()) if model is not None else "",
            "quantization_level": level}


def _capabilities(entry, model) -> list[str]:
    if entry.role == "embedding":
        return ["embedding"]
    out = ["completion", "tools"]
    if model is not None and getattr(model.tokenizer, "has_thinking", False):
        out.append("thinking")
    if model is not None and model.fim is not None:
        out.append("insert")
    return out


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + unit
    return str(n)


def _disk_size(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


