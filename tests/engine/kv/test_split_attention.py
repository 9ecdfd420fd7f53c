"""Attention in runs of rows (`split_attention`): the cheapest cut, computed by hand; the same
logits as attention over the whole width; and, in the scheduler, a long prompt among short
ones gives every request the tokens it gets alone, with the runs really taken."""

from __future__ import annotations

import mlx.core as mx
import pytest
from support.engine import alone, assert_same_or_near_tie, run_batch, tokens_of

from server.engine.kv import split_attention
from server.engine.kv.batch import ModelBatch, new_cache, prefill_rows
from server.engine.kv.split_attention import plan_segments
from server.engine.params import GenerationParams, SpeculationParams

TOL = 1e-5


def test_one_long_row_among_short_ones_gets_a_run_of_its_own():
    # rows 0-2 use keys 900-999, row 3 all 1000: one run reads 4,000 positions + 512, three
    # 300 + 1,000 + 2 x 512
    assert plan_segments([900, 900, 900, 0], 1000) == [(0, 3, 900), (3, 4, 0)]
    # a long row in the middle: three runs
    assert plan_segments([900, 0, 900, 900], 1000) == [(0, 1, 900), (1, 2, 0), (2, 4, 900)]


def test_rows_of_like_lengths_stay_one_run():
    assert plan_segments([0, 0, 0], 300) is None
    # splitting off row 0 saves 3 x 100 = 300 positions, less than a run's 512
    assert plan_segments([0, 100, 100, 100], 300) is None
    assert plan_segments([0, 100, 100, 100], 300, cost=100) == [(0, 1, 0), (1, 4, 100)]


def test_rows_that_all_start_late_read_from_there():
    assert plan_segments([700, 800], 1000) == [(0, 2, 700)]


def test_the_cost_is_read_when_planning(monkeypatch):
    monkeypatch.setattr(split_attention, "SEGMENT_COST", 10**9)
    assert plan_segments([900, 900, 900, 0], 1000) is None


def _batch(model, lengths: list[int]) -> ModelBatch:
    batch = ModelBatch(model)
    _, cache = prefill_rows(model, [new_cache(model) for _ in lengths],
                            [[1 + (i + 3 * n) % 50 for n in range(length)]
                             for i, length in enumerate(lengths)])
    batch.rows = [object()] * len(lengths)
    batch.cache = cache
    return batch


def test_runs_give_the_logits_of_attention_over_the_whole_width(kit, monkeypatch):
    model = kit.target.model
    calls = []
    original = split_attention.plan_segments

    def spy(*args, **kwargs):
        calls.append(original(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr("server.engine.kv.batch.plan_segments", spy)
    split, whole = _batch(model, [12, 700, 9, 14]), _batch(model, [12, 700, 9, 14])
    inputs = mx.array([[5, 6], [7, 8], [9, 10], [11, 12]])
    got = split.forward(inputs)
    assert calls[-1] == [(0, 1, 688), (1, 2, 0), (2, 4, 686)]
    monkeypatch.setattr(split_attention, "SEGMENT_COST", 10**9)
    expected = whole.forward(inputs)
    assert calls[-1] is None
    assert mx.allclose(got, expected, atol=TOL, rtol=TOL).item(), mx.abs(got - expected).max()
    assert all(c.segments is None for c in split.cache)  # the plan lives for one forward


@pytest.mark.parametrize("k", [0, 4], ids=["no-draft", "draft-k4"])
def test_a_long_prompt_among_short_ones_changes_no_request(kit, k, monkeypatch):
    runs = []
    original = split_attention.plan_segments
    monkeypatch.setattr("server.engine.kv.batch.plan_segments",
                        lambda *a, **kw: runs.append(original(*a, **kw)) or runs[-1])
    encode = kit.target.tokenizer.encode
    prompts = [encode("x = 1\n" * 120)[:600], encode("def hello(world):"), encode("a b c"),
               encode("Once upon a time")]
    requests = [GenerationParams(tuple(p), 12, speculation=SpeculationParams(num_draft_tokens=k))
                for p in prompts]
    events, _ = run_batch(kit, requests, prefill_chunk=1024)
    assert any(plan is not None and len(plan) > 1 for plan in runs)  # the runs were taken
    for p, ev in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))


def test_the_installed_attention_reads_only_each_runs_keys(kit):
    """Row 0's padding holds NaN values: attention over the whole width multiplies them by
    zero weights (NaN); the runs never read them."""
    import sys
    from types import SimpleNamespace

    model = kit.target.model
    assert split_attention.install(model)
    attention = sys.modules[type(model).__module__].scaled_dot_product_attention
    queries, keys = mx.ones((2, 4, 1, 8)), mx.ones((2, 2, 10, 8))
    values = mx.ones((2, 2, 10, 8))
    values[0, :, :6] = float("nan")
    mask = (mx.arange(10)[None] >= mx.array([6, 0])[:, None])[:, None, None, :]
    cache = SimpleNamespace(segments=[(0, 1, 6), (1, 2, 0)])
    out = attention(queries, keys, values, cache=cache, scale=1.0, mask=mask)
    assert out.shape == (2, 4, 1, 8) and mx.allclose(out, mx.ones_like(out)).item()
    cache.segments = None
    whole = attention(queries, keys, values, cache=cache, scale=1.0, mask=mask)
    assert mx.isnan(whole[0]).all().item() and not mx.isnan(whole[1]).any().item()
