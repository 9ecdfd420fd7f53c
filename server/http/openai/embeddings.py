"""POST /v1/embeddings: the embedding model's vectors (`server.engine.models.embeddings`)."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request

from api_schemas.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from server.http.common.auth import require_api_key
from server.http.common.errors import APIError
from server.http.common.request_mapping import check_token_ids

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["embeddings"])


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    engine = request.app.state.engine
    vectors, used = await embed_inputs(engine, body.model, body.inputs(), body.dimensions)
    data = [Embedding(index=i, embedding=_encoded(v, body.encoding_format))
            for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=engine.embedder.model.name,
                             usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used))


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
    tokens = [_tokens(embedder, i, truncate) for i in inputs]
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


def _encoded(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
