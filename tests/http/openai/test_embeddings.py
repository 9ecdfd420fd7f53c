"""POST /v1/embeddings against the embedding model's hidden states computed with mlx_lm
directly, and through the openai SDK (which asks for base64)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from mlx_lm import load
from openai.types import CreateEmbeddingResponse
from support.servers import make_settings, uvicorn_thread

TEXTS = ["def binary_search(items, x):", "hello world", "a"]


@pytest.fixture(scope="module")
def embedding_server(tiny_pair):
    """The tiny pair, with its target also serving embeddings: (TestClient, url, settings)."""
    from server.http.app import build_engine, create_app

    settings = make_settings(*tiny_pair)
    settings.models.embedding_model = str(tiny_pair[0])
    engine = build_engine(settings)
    engine.start()
    try:
        app = create_app(settings, engine)
        with TestClient(app) as client, uvicorn_thread(app) as url:
            yield client, url
    finally:
        engine.stop()


def reference(path, text_or_ids, pooling="last", dimensions=None) -> np.ndarray:
    model, tokenizer = load(str(path))
    ids = tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    hidden = model.model(mx.array([ids]))[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    vector = np.array(pooled.astype(mx.float32))[:dimensions]
    return vector / np.linalg.norm(vector)


def test_vectors_are_the_pooled_normalized_hidden_states(embedding_server, tiny_pair):
    client, _ = embedding_server
    r = client.post("/v1/embeddings", json={"input": TEXTS, "model": str(tiny_pair[0])})
    assert r.status_code == 200, r.text
    body = r.json()
    CreateEmbeddingResponse.model_validate(body)  # strictly the SDK's type
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for text, item in zip(TEXTS, body["data"], strict=True):
        assert np.allclose(item["embedding"], reference(tiny_pair[0], text), atol=1e-4)
    _, tokenizer = load(str(tiny_pair[0]))
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in TEXTS)
    ids = tokenizer.encode(TEXTS[0])
    one = client.post("/v1/embeddings", json={"input": ids, "dimensions": 16}).json()
    vector = one["data"][0]["embedding"]
    assert len(vector) == 16 and np.allclose(vector, reference(tiny_pair[0], ids,
                                                               dimensions=16), atol=1e-4)


def test_the_openai_sdk_decodes_its_base64(embedding_server, tiny_pair):
    _, url = embedding_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model=str(tiny_pair[0]), input=TEXTS[1])
    assert np.allclose(out.data[0].embedding, reference(tiny_pair[0], TEXTS[1]), atol=1e-4)
    assert [(m.id, m.model_extra["role"]) for m in client.models.list()] == [
        (str(tiny_pair[0]), "target"), (str(tiny_pair[1]), "draft"),
        (str(tiny_pair[0]), "embedding")]


def test_mean_pooling(tiny_pair):
    from server.engine.models.embeddings import Embedder
    from server.engine.models.model_kit import load_model

    embedder = Embedder(load_model(str(tiny_pair[0])), "mean")
    _, tokenizer = load(str(tiny_pair[0]))
    inputs = [tokenizer.encode(text) for text in TEXTS]
    # In one padded forward, each input's mean is still its own.
    for ids, vector in zip(inputs, embedder.embed_batch(inputs), strict=True):
        assert np.allclose(vector, reference(tiny_pair[0], ids, "mean"), atol=1e-4)


def test_batches_group_similar_lengths_within_the_budget():
    from server.engine.models.embeddings import batches

    inputs = [[1] * n for n in (5, 40, 6, 7, 100, 39, 5)]
    groups = batches(inputs, budget=80)
    assert sorted(i for g in groups for i in g) == list(range(len(inputs)))
    for group in groups:
        longest = max(len(inputs[i]) for i in group)
        assert len(group) == 1 or longest * len(group) <= 80
    assert groups == [[0, 6, 2, 3], [5, 1], [4]]  # shortest first; 100 tokens alone


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": "a", "model": "other"}, 404, "model"),
    ({"input": "a", "dimensions": 100_000}, 400, "dimensions"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": "a " * 5000}, 400, "input"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
])
def test_bad_inputs_are_400s(embedding_server, body, status, param):
    client, _ = embedding_server
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.anyio
async def test_without_an_embedding_model_it_is_a_404(client):
    r = await client.post("/v1/embeddings", json={"input": "a"})
    assert r.status_code == 404 and "models.embedding_model" in r.json()["error"]["message"]


def test_langchain_embeds_through_it(embedding_server, tiny_pair):
    from langchain_openai import OpenAIEmbeddings

    _, url = embedding_server
    # Without check_embedding_ctx_length, langchain sends the texts (not tiktoken's ids).
    embeddings = OpenAIEmbeddings(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  model=str(tiny_pair[0]), check_embedding_ctx_length=False)
    vectors = embeddings.embed_documents(TEXTS[:2])
    query = embeddings.embed_query(TEXTS[2])
    for text, vector in zip(TEXTS, [*vectors, query], strict=True):
        assert np.allclose(vector, reference(tiny_pair[0], text), atol=1e-4)
