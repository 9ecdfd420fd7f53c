"""POST /v1/embeddings: the embedding model's vectors (`server.engine.models.embeddings`)."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request

from api_schemas.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.embeddings import embed_inputs

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["embeddings"],
                   route_class=OffLoopJson)


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    engine = request.app.state.engine
    vectors, used = await embed_inputs(engine, body.model, body.inputs(), body.dimensions)
    data = [Embedding(index=i, embedding=_encoded(v, body.encoding_format))
            for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=engine.embedder.model.name,
                             usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used))


def _encoded(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
