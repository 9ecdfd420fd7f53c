"""RaggedKVCache (holes instead of rolls) against `mlx_lm`'s BatchKVCache with its roll."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache

from server.engine.kv.ragged_cache import RaggedKVCache

PROMPTS = [[5, 9, 31, 7, 2, 88], [40, 41], [3, 100, 200, 17]]
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_pair):
    return load(str(tiny_pair[0]))[0]


def _prefilled(model, kind):
    width = max(len(p) for p in PROMPTS)
    padding = [width - len(p) for p in PROMPTS]
    cache = [kind(padding) for _ in model.layers]
    inputs = mx.array([[0] * pad + p for pad, p in zip(padding, PROMPTS, strict=True)])
    model(inputs, cache=cache)
    return cache


def _roll(cache, counts):
    for c in cache:
        c.prepare(right_padding=counts)
        c.finalize()


def _close(a, b):
    assert a.shape == b.shape
    assert mx.allclose(a, b, atol=TOL, rtol=TOL).item(), mx.abs(a - b).max().item()


def _step(model, theirs, ours, tokens):
    x = mx.array(tokens)
    _close(model(x, cache=theirs), model(x, cache=ours))


def test_dropping_tails_equals_rolling_them(model):
    theirs, ours = _prefilled(model, BatchKVCache), _prefilled(model, RaggedKVCache)
    _step(model, theirs, ours, [[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    counts = [2, 0, 1]  # row 0 keeps one of the three, row 1 all, row 2 two
    _roll(theirs, counts)
    for c in ours:
        c.drop_tail(counts)
    assert ours[0].holes.sum() == 3
    for _ in range(3):  # the next rounds see the same context, hole or roll
        _step(model, theirs, ours, [[1], [2], [3]])
    _step(model, theirs, ours, [[4, 5], [6, 7], [8, 9]])
    for c in ours:  # a second ragged round on top of the first
        c.trim(1)
        c.drop_tail([0, 1, 0])
    for c in theirs:
        c.trim(1)
    _roll(theirs, [0, 1, 0])
    _step(model, theirs, ours, [[10], [11], [12]])
    for row in range(len(PROMPTS)):  # what the prefix cache would store: no holes
        a, b = theirs[0].extract(row), ours[0].extract(row)
        assert a.offset == b.offset
        _close(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
        _close(a.values[..., : a.offset, :], b.values[..., : b.offset, :])


def test_holes_survive_filter_and_extend(model):
    theirs, ours = _prefilled(model, BatchKVCache), _prefilled(model, RaggedKVCache)
    _step(model, theirs, ours, [[11, 12], [21, 22], [31, 32]])
    _roll(theirs, [1, 0, 1])
    for c in ours:
        c.drop_tail([1, 0, 1])
    keep = mx.array([0, 2])
    for c in theirs + ours:
        c.filter(keep)
    _step(model, theirs, ours, [[5], [6]])
    joining = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # longer than the batch: both parts re-pad
    for cache, kind in ((theirs, BatchKVCache), (ours, RaggedKVCache)):
        row = [KVCache() for _ in model.layers]
        model(mx.array([joining]), cache=row)
        for mine, new in zip(cache, [kind.merge([c]) for c in row], strict=True):
            mine.extend(new)
    _step(model, theirs, ours, [[1], [2], [3]])
    assert isinstance(RaggedKVCache.merge([KVCache()]), RaggedKVCache)


def _alone(model, tokens):
    """`mlx_lm`'s plain single-row prefill: last logits and the cache."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    return logits, cache


@pytest.mark.parametrize("restored", [(0, 0, 0), (0, 1, 2), (4, 0, 3), (5, 1, 1)])
def test_rows_restored_to_different_lengths_share_one_prefill(model, restored):
    """`prefill_rows` feeds each row the rest of its prompt on top of whatever prefix it holds
    (fresh rows left-padded, restored ones right-padded with holes after): each row's logits,
    its next decoding step and its extracted cache equal that row prefilled alone."""
    from server.engine.kv.batch import prefill_rows

    caches, chunks = [], []
    for prompt, n in zip(PROMPTS, restored, strict=True):
        caches.append(_alone(model, prompt[:n])[1] if n else [KVCache() for _ in model.layers])
        chunks.append(prompt[n:])
    logits, batch = prefill_rows(model, caches, chunks)
    alone = [_alone(model, prompt) for prompt in PROMPTS]
    for row, (row_logits, _) in enumerate(alone):
        _close(logits[row], row_logits)
    step = model(mx.array([[7], [8], [9]]), cache=batch)[:, -1]
    for row, (token, (_, cache)) in enumerate(zip([7, 8, 9], alone, strict=True)):
        _close(step[row], model(mx.array([[token]]), cache=cache)[0, -1])
        mine = batch[0].extract(row)
        assert mine.offset == cache[0].offset
        _close(mine.keys[..., : mine.offset, :], cache[0].keys[..., : mine.offset, :])
