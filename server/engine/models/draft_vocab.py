"""Drafts with a smaller vocabulary than the target's (FR-Spec's frequency-ranked head).

On a CPU a draft's cost is mostly the weights it reads per token, and a small model's output
head is most of them: SmolLM2-135M's 49,152 x 576 head is 28M of its 135M parameters, so a
3-layer draft with the full head costs ~30% of the target per token, which no acceptance rate
can turn into a 1.4x speedup. A draft that predicts only the N most frequent tokens reads N/V of
that head (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling").

Such a draft is a plain `mlx_lm` model whose vocabulary is the N kept target ids plus one
"other" row, with a `draft_vocab.json` next to its weights:

    {"target_vocab_size": 49152, "target_ids": [ids of draft rows 0 .. N-1 in the target]}

`SubVocabModel` wraps it so the engine sees the target's vocabulary: target ids in (ids the
draft does not know become its "other" row), logits over the target's vocabulary out, with
-inf for every token the draft cannot propose (the "other" row included). Proposals and their
probabilities are then exact inputs to verification: a token outside the subset has draft
probability 0 and is never proposed, and rejection sampling stays lossless.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from server.engine.models.head import _Split, set_split, split_of

VOCAB_FILE = "draft_vocab.json"


def draft_index(target_ids, target_vocab_size: int) -> np.ndarray:
    """Target id -> draft row: the i-th kept id -> i, every other id -> N, the "other" row."""
    index = np.full(target_vocab_size, len(target_ids), dtype=np.uint32)
    index[np.asarray(target_ids, dtype=np.int64)] = np.arange(len(target_ids), dtype=np.uint32)
    return index


class SubVocabModel(nn.Module):
    def __init__(self, model: nn.Module, target_ids: list[int], target_vocab_size: int):
        super().__init__()
        ids = np.asarray(target_ids, dtype=np.int64)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= target_vocab_size:
            raise ValueError(f"{VOCAB_FILE}: target_ids must lie in [0, {target_vocab_size})")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"{VOCAB_FILE}: target_ids has duplicates")
        # Target id -> draft row; unknown ids -> N, the draft's "other" row on the way in and
        # the -inf column of the widened logits on the way out. ("_": not a parameter.)
        self.inner = model
        self.num_kept = len(ids)
        self._index = mx.array(draft_index(ids, target_vocab_size))
        # Body and head apart (`server.engine.models.head`) when the inner model allows, so a
        # prefill
        # widens one position per row to the target's vocabulary, not every position (a
        # 6-prompt prefill of the default draft took half the target's time widening 678
        # positions to 49,152 logits each).
        inner = split_of(model)
        set_split(self, _Split(None) if inner.body is None else _Split(
            lambda inputs, cache=None: inner.body(self._index[inputs], cache=cache),
            lambda hidden: self._widen(inner.head(hidden))))

    @property
    def layers(self):  # make_prompt_cache counts them
        return self.inner.layers

    @property
    def vocab_size(self) -> int:
        """Token ids it takes and scores: the target's."""
        return self._index.shape[0]

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        return self._widen(self.inner(self._index[inputs], cache=cache, **kwargs))

    def _widen(self, logits: mx.array) -> mx.array:
        """The draft's logits over the target's vocabulary (-inf where it cannot propose)."""
        kept = logits[..., : self.num_kept]
        blocked = mx.full((*kept.shape[:-1], 1), -mx.inf, dtype=kept.dtype)
        return mx.take(mx.concatenate([kept, blocked], axis=-1), self._index, axis=-1)


def read_vocab(folder: Path) -> tuple[list[int], int] | None:
    """(target_ids, target_vocab_size) from a draft folder, or None if it has the full vocab."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return [int(i) for i in data["target_ids"]], int(data["target_vocab_size"])


def write_vocab(folder: Path, target_ids: list[int], target_vocab_size: int) -> None:
    (Path(folder) / VOCAB_FILE).write_text(json.dumps(
        {"target_vocab_size": target_vocab_size, "target_ids": [int(i) for i in target_ids]}))


def wrap_if_sub_vocab(model: nn.Module, folder: Path) -> nn.Module:
    found = read_vocab(folder)
    return model if found is None else SubVocabModel(model, *found)
