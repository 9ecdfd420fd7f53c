"""Random prompts for the in-process benchmarks, drawn from the model's own vocabulary (an id
past the embedding's rows is not an error in MLX: the gather reads past the table and may crash)."""

from __future__ import annotations

import mlx.core as mx

from server.engine.draft_vocab import SubVocabModel


def vocab_size(model) -> int:
    """Token ids the model takes: its embedding's rows (`mlx_lm` models keep them in
    `args.vocab_size`), or the target's for a `SubVocabModel` draft."""
    if isinstance(model, SubVocabModel):
        return model.vocab_size
    return int(model.args.vocab_size)


def random_tokens(model, shape: tuple[int, ...]) -> mx.array:
    """Token ids, uniform over the model's vocabulary, as `uint32` of `shape`."""
    return mx.random.randint(0, vocab_size(model), shape).astype(mx.uint32)
