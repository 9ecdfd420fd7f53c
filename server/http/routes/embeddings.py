"""POST /v1/embeddings: the embedding model's vectors (`server.engine.embeddings`)."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request

from api_schemas.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from server.http.auth import require_api_key
from server.http.errors import APIError
from server.http.request_mapping import check_token_ids

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["embeddings"])


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    engine = request.app.state.engine
    embedder = engine.embedder
    if embedder is None:
        raise APIError(404, "this server serves no embedding model (models.embedding_model,"
                       " --embedding-model)", param="model", code="model_not_found")
    if body.model not in (None, "", embedder.model.name, embedder.model.path):
        raise APIError(404, f"model {body.model!r} does not exist; this server embeds with "
                       f"{embedder.model.name!r}", param="model", code="model_not_found")
    if body.dimensions is not None and body.dimensions > embedder.width:
        raise APIError(400, f"dimensions must be at most {embedder.width}, the model's",
                       param="dimensions", code="invalid_value")
    tokens = [_tokens(embedder, i) for i in body.inputs()]
    vectors = await engine.embed(tokens, body.dimensions)
    data = [Embedding(index=i, embedding=_encoded(v, body.encoding_format))
            for i, v in enumerate(vectors)]
    used = sum(len(t) for t in tokens)
    return EmbeddingResponse(data=data, model=embedder.model.name,
                             usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used))


def _tokens(embedder, given: str | list[int]) -> list[int]:
    model = embedder.model
    if isinstance(given, str):
        tokens = list(model.tokenizer.encode(given))
    else:
        check_token_ids(model.vocab_size, given, "input", code="invalid_value")
        tokens = list(given)
    limit = model.context_length
    if limit is not None and len(tokens) > limit:
        raise APIError(400, f"an input has {len(tokens)} tokens; the embedding model's context"
                       f" is {limit}", param="input", code="context_length_exceeded")
    return tokens


def _encoded(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
