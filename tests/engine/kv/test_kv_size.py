"""A model's KV layout (`kv_size`): the bytes it predicts bound what `mlx_lm`'s caches
really allocate, within one allocation step, for every cache kind it reads."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from server.engine.kv.kv_size import NO_END, KVLayout, LayerSize, _layer_sizes, kv_layout
from server.engine.kv.window_cache import COMPACT_EVERY, DEFAULT_SLACK


def filled(model, chunks: list[int], window: int | None = None) -> list:
    """A fresh prompt cache of `model` (of `RotatingKVCache`s of a `window`) fed chunks of
    these sizes, one forward each."""
    cache = make_prompt_cache(model) if window is None else \
        [RotatingKVCache(max_size=window) for _ in model.layers]
    token = 5
    for n in chunks:
        model(mx.array([list(range(token, token + n))], mx.uint32), cache=cache)
        token += n
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("chunks", [[1], [255], [256], [300], [100, 1, 1, 200], [600, 37]])
def test_the_layout_bounds_what_the_caches_allocate(loaded_pair, chunks):
    target, _, draft = loaded_pair
    for model in (target, draft):
        layout = kv_layout(model)
        real = sum(c.nbytes for c in filled(model, chunks))
        predicted = layout.bytes(sum(chunks))
        per_step = layout.bytes(256 + 1) - layout.bytes(1)
        assert real <= predicted < real + per_step, (chunks, real, predicted)


def test_the_tiny_targets_layout_is_its_config(loaded_pair):
    """4 layers, 2 KV heads of 16 dims, fp32 keys and values: 1 KiB per token."""
    layout = kv_layout(loaded_pair[0])
    assert layout.layers == (LayerSize(bytes_per_token=256.0, step=256),) * 4
    assert layout.bytes(1) == 256 * 1024 and layout.bytes(10, rows=3) == 3 * 265 * 1024


def test_a_window_stops_where_its_batch_cache_does(loaded_pair):
    """A window layer's batch cache (`WindowKVCache`) keeps the window, its slack and what
    waits to be compacted: no more, whatever the context; with attention sinks, all of it."""
    target = loaded_pair[0]
    cache = filled(target, [40], window=64)
    assert isinstance(cache[0], RotatingKVCache)
    layout = KVLayout(tuple(size for c in cache for size in _layer_sizes(c)))
    most = 64 + DEFAULT_SLACK + COMPACT_EVERY
    assert layout.layers[0].max_tokens == most
    assert layout.bytes(10_000) == layout.bytes(most) == 4 * (most + 255) * 256
    assert layout.max_tokens(layout.bytes(most)) == NO_END
    sinks = [RotatingKVCache(max_size=64, keep=4) for _ in target.layers]
    target(mx.array([[5, 6]], mx.uint32), cache=sinks)
    assert _layer_sizes(sinks[0])[0].max_tokens is None


def test_a_state_cache_has_a_constant_size():
    cache = ArraysCache(2)
    cache[0] = mx.zeros((1, 3, 8))
    cache[1] = mx.zeros((1, 4, 16))
    [size] = _layer_sizes(cache)
    assert size == LayerSize(fixed_bytes=(3 * 8 + 4 * 16) * 4)
    assert KVLayout((size,)).bytes(1) == KVLayout((size,)).bytes(50_000)


def test_max_tokens_is_the_most_that_fits(loaded_pair):
    layout = kv_layout(loaded_pair[0])
    for budget in (layout.bytes(1) - 1, layout.bytes(1), 10**6, 123_456_789):
        n = layout.max_tokens(budget)
        if n == 0:
            assert layout.bytes(1) > budget
        else:
            assert layout.bytes(n) <= budget < layout.bytes(n + 1)


def test_every_cache_kind_of_the_zoo_is_bounded(zoo):
    """Full attention, windows, recurrent states and layers with several caches (`mlx_lm`'s
    own architectures as tiny models): the layout bounds what a prompt's caches allocate,
    within a step of every growing layer."""
    from mlx_lm import load

    for arch, (target, _) in zoo.items():
        model, _ = load(str(target))
        layout = kv_layout(model)
        for chunks in ([300], [100, 1, 257]):
            real = sum(c.nbytes for c in filled(model, chunks))
            predicted = layout.bytes(sum(chunks))
            per_step = layout.bytes(256 + 1) - layout.bytes(1)
            assert real <= predicted <= real + per_step, (arch, chunks, real, predicted)
