"""Text embeddings from a decoder model's final hidden states (`POST /v1/embeddings`).

The embedding model (`models.embedding_model`, apart from the target) runs its body
(`server.engine.head`: tokens to normalized hidden states) over an input's tokens. The last
token's state (`last` pooling: Qwen3-Embedding and the other decoder embedding models, whose
tokenizer ends each input with its end-of-text token) or the mean over the tokens (`mean`) is
the embedding, L2-normalized. `dimensions` keeps the first d components and normalizes again
(Matryoshka embeddings, OpenAI's `dimensions`). Each input is one forward on the MLX thread, so
streams that decode meanwhile wait for one input at a time.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from server.engine.head import split_of
from server.engine.model_kit import LoadedModel, ModelLoadError

POOLINGS = ("last", "mean")


class Embedder:
    def __init__(self, model: LoadedModel, pooling: str = "last"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}")
        body = split_of(model.model).body
        if body is None:
            raise ModelLoadError(f"cannot embed with {model.path}: its hidden states are not"
                                 " apart from its output head")
        self.model, self.pooling, self._body = model, pooling, body

    @property
    def width(self) -> int:
        """The embedding's length before `dimensions` cuts it."""
        return int(self.model.config["hidden_size"])

    def embed(self, tokens: list[int], dimensions: int | None = None) -> np.ndarray:
        """The normalized embedding (float32) of one input; on the MLX thread."""
        hidden = self._body(mx.array([tokens]))[0]
        pooled = hidden[-1] if self.pooling == "last" else hidden.mean(axis=0)
        vector = np.array(pooled.astype(mx.float32))[:dimensions]
        return vector / max(float(np.linalg.norm(vector)), 1e-12)
