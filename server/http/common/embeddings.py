"""The embedding model's vectors of a request's inputs: what OpenAI's `/v1/embeddings` and
Ollama's `/api/embed` share."""

from __future__ import annotations

import asyncio

from server.http.common.errors import APIError
from server.http.common.request_mapping import check_token_ids


async def embed_inputs(engine, model: str | None, inputs: list[str | list[int]],
                       dimensions: int | None, *, truncate: bool = False):
    """The embedding model's vectors of `inputs` and the tokens they took; `truncate`: cut an
    input longer than the model's context (else a 400)."""
    embedder = engine.embedder
    if embedder is None:
        raise APIError(404, "this server serves no embedding model (models.embedding_model,"
                       " --embedding-model)", param="model", code="model_not_found")
    if model not in (None, "", embedder.model.name, embedder.model.path):
        raise APIError(404, f"model {model!r} does not exist; this server embeds with "
                       f"{embedder.model.name!r}", param="model", code="model_not_found")
    if dimensions is not None and dimensions > embedder.width:
        raise APIError(400, f"dimensions must be at most {embedder.width}, the model's",
                       param="dimensions", code="invalid_value")
    tokens = await asyncio.to_thread(  # off the event loop: long inputs take seconds
        lambda: [_tokens(embedder, i, truncate) for i in inputs])
    return await engine.embed(tokens, dimensions), sum(len(t) for t in tokens)


def _tokens(embedder, given: str | list[int], truncate: bool) -> list[int]:
    model = embedder.model
    if isinstance(given, str):
        tokens = list(model.tokenizer.encode(given))
    else:
        check_token_ids(model.vocab_size, given, "input", code="invalid_value")
        tokens = list(given)
    limit = model.context_length
    if limit is not None and len(tokens) > limit:
        if truncate:
            return tokens[:limit]
        raise APIError(400, f"an input has {len(tokens)} tokens; the embedding model's context"
                       f" is {limit}", param="input", code="context_length_exceeded")
    return tokens
