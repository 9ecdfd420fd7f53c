"""Batch fixes for `mlx_lm` architectures whose forward assumes one sequence.

A few of `mlx_lm`'s models run alone but not with a batch cache of several rows:
- `gemma2` attends with grouped queries in five dimensions (batch, kv heads, repeats, queries,
  keys) but adds a four-dimensional mask, which broadcasts only when the batch has one row;
- `gpt_bigcode` (StarCoder) reads its absolute positions from `cache.offset` as one integer,
  where a batch cache holds one offset per row (its left padding's positions, negative, are
  clipped to 0: the mask hides them, and the embedding lookup stays in range).

`adapt_for_batching` swaps those modules' classes for subclasses that do the same computation
with a batch's mask and offsets (the weights and their names are untouched), so one row gives
`mlx_lm`'s own numbers.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gpt_bigcode
from mlx_lm.models.base import create_attention_mask


class Gemma2Attention(gemma2.Attention):
    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mask[:, :, None]  # (B, 1, L, S) -> (B, 1, 1, L, S): kv heads x repeats
        return super().__call__(x, mask, cache)


class GPTBigCodeModel(gpt_bigcode.GPTBigCodeModel):
    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        _, length = inputs.shape
        hidden = self.wte(inputs)
        if cache is None:
            cache = [None] * len(self.h)
        offset = mx.array(0 if cache[0] is None else cache[0].offset)  # one per row, or one
        mask = create_attention_mask(hidden, cache[0])
        positions = mx.maximum(mx.arange(length) + offset[..., None], 0)  # padding: 0
        hidden = hidden + self.wpe(positions)
        for layer, c in zip(self.h, cache, strict=True):
            hidden = layer(hidden, mask, cache=c)
        return self.ln_f(hidden)


BATCHED = {gemma2.Attention: Gemma2Attention, gpt_bigcode.GPTBigCodeModel: GPTBigCodeModel}


def adapt_for_batching(model: nn.Module) -> int:
    """Swap every module of a class in `BATCHED` for its batch-ready subclass; how many."""
    swapped = 0
    for _, module in model.named_modules():
        batched = BATCHED.get(type(module))
        if batched is not None:
            module.__class__ = batched
            swapped += 1
    return swapped
