"""A model's body (tokens to hidden states) and head (hidden states to logits), apart.

A prefill needs the logits of each prompt's last token only, but `model(inputs)` applies the
output head to every position: for SmolLM2-135M (a 49k-token vocabulary on a 576-wide model)
the head is a fifth of the prefill's multiply-adds. With the two apart, the prefill runs the
body over the prompt and the head over one position per row.

`mlx_lm`'s llama-style models are `head(body(x))`, with `model.model` the body and
`model.lm_head` (or the tied embedding) the head. Not every architecture is (some scale or cap
the logits), so the split is used only after checking, once per model, that it gives the
model's own logits; otherwise `last_logits` runs the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

_CHECK_INPUT = [[1, 2, 3]]
_TOLERANCE = 1e-4
_ATTRIBUTE = "_server_head_split"  # where a model keeps its checked split


@dataclass(frozen=True)
class _Split:
    body: Callable | None  # None: the model is not head(body(x)); run it whole
    head: Callable | None = None


def _candidate(model: nn.Module) -> _Split:
    body = model["model"] if "model" in model else None
    if body is None:
        return _Split(None)
    if isinstance(model.get("lm_head"), nn.Module):  # not a bare matrix (talkie's)
        return _Split(body, model.lm_head)
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False) and "embed_tokens" in body:
        return _Split(body, body.embed_tokens.as_linear)
    return _Split(None)


def split_of(model: nn.Module) -> _Split:
    """The model's checked split (computed and checked on first use, then kept on the model)."""
    split = model.__dict__.get(_ATTRIBUTE)
    if split is None:
        split = _candidate(model)
        if split.body is not None:
            x = mx.array(_CHECK_INPUT)
            whole = model(x, cache=make_prompt_cache(model))
            parts = split.head(split.body(x, cache=make_prompt_cache(model)))
            if whole.shape != parts.shape or not mx.allclose(
                    whole, parts, atol=_TOLERANCE, rtol=_TOLERANCE).item():
                split = _Split(None)
        set_split(model, split)
    return split


def set_split(model: nn.Module, split: _Split) -> None:
    """Keep `split` on the model (a plain attribute, not a parameter); the benchmark sets
    `_Split(None)` to time the whole model."""
    object.__setattr__(model, _ATTRIBUTE, split)


def last_logits(model: nn.Module, inputs: mx.array, cache: list, columns: mx.array) -> mx.array:
    """Feed `inputs` (B, S) through `model` with `cache`; the logits (B, V) of row i at column
    `columns[i]`, with the head applied to those positions only when the model allows it."""
    rows = mx.arange(inputs.shape[0])
    split = split_of(model)
    if split.body is None:
        return model(inputs, cache=cache)[rows, columns]
    return split.head(split.body(inputs, cache=cache)[rows, columns])
