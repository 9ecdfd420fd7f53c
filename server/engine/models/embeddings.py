"""Text embeddings from a decoder model's final hidden states (`POST /v1/embeddings`).

The embedding model (`models.embedding_model`, apart from the target) runs its body
(`server.engine.models.head`: tokens to normalized hidden states) over an input's tokens. The last
token's state (`last` pooling: Qwen3-Embedding and the other decoder embedding models, whose
tokenizer ends each input with its end-of-text token) or the mean over the tokens (`mean`) is
the embedding, L2-normalized. `dimensions` keeps the first d components and normalizes again
(Matryoshka embeddings, OpenAI's `dimensions`). Inputs of similar length share a forward on the
MLX thread (`batches`, up to `engine.idle_prefill_chunk` tokens padded), so streams that decode
meanwhile wait for one such forward at a time.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from server.engine.errors import ModelLoadError
from server.engine.models.head import split_of
from server.engine.models.model_kit import LoadedModel

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
        return self.embed_batch([tokens], dimensions)[0]

    def embed_batch(self, inputs: list[list[int]],
                    dimensions: int | None = None) -> list[np.ndarray]:
        """The embeddings of several inputs in one forward; on the MLX thread. Shorter inputs
        are padded on the right, which a causal model's states up to their last token never
        see, so each is the input's own embedding."""
        lengths = [len(t) for t in inputs]
        width = max(lengths)
        hidden = self._body(mx.array([t + [0] * (width - len(t)) for t in inputs]))
        ends = mx.array(lengths)
        if self.pooling == "last":
            pooled = hidden[mx.arange(len(inputs)), ends - 1]
        else:
            real = (mx.arange(width)[None, :] < ends[:, None])[..., None]
            pooled = (hidden * real).sum(axis=1) / ends[:, None]
        vectors = np.array(pooled.astype(mx.float32))[:, :dimensions]
        norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return list(vectors / norms)


def batches(inputs: list[list[int]], budget: int) -> list[list[int]]:
    """The inputs' indices in groups of similar length, each at most `budget` tokens once
    padded (an input longer than that alone): one forward each."""
    groups: list[list[int]] = []
    for i in sorted(range(len(inputs)), key=lambda i: len(inputs[i])):
        group = groups[-1] if groups else None
        if group is not None and len(inputs[i]) * (len(group) + 1) <= budget:
            group.append(i)  # sorted: this input is the group's longest
        else:
            groups.append([i])
    return groups
