"""Rank 0's record of target-cache operations is complete: replayed in process on a shadow
follower (the same model, its own caches), every cache a target forward reads is identical on
both sides, through batching, speculation, chunked prefill, the prefix cache, cancellation and
a draft change; and the output is the unmirrored scheduler's. No processes: any new operation
on target caches that the mirror does not record fails here first."""

from __future__ import annotations

import contextlib
import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from server.engine.distributed.mirror import Mirror, MirroredKVCache, apply_op
from server.engine.distributed.service import MirroredTarget, body_and_head
from server.engine.kv.prefix_cache import PrefixCache
from server.engine.kv.ragged_cache import RaggedKVCache
from server.engine.models.model_kit import LoadedModel, ModelKit, load_model
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.policy import SpeculationPolicy

pytestmark = pytest.mark.slow

TEXTS = ["def hello(world):\n    return", "Once upon a time", "x = 1\n" * 12, "a",
         "The quick brown fox jumps"]


class ShadowFollower:
    """Stands for the other ranks: applies each message to its own caches and checks, before
    every forward, that they equal rank 0's."""

    def __init__(self, model):
        self.model = model
        self.body, _ = body_and_head(model)
        self.caches: dict = {}
        self.rank0: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.forwards = 0

    def send(self, ops: list) -> None:
        for op in ops:
            if op[0] == "forward":
                for handle in op[2]:
                    assert_same_cache(self.rank0[handle], self.caches[handle])
                mx.eval(self.body(mx.array(op[1]), cache=[self.caches[h] for h in op[2]]))
                self.forwards += 1
            elif op[0] not in ("stop", "memory"):
                apply_op(op, self.caches, lambda: make_prompt_cache(self.model))


def assert_same_cache(ours, theirs) -> None:
    assert type(theirs) is (RaggedKVCache if isinstance(ours, RaggedKVCache) else KVCache)
    if isinstance(ours, RaggedKVCache):
        assert ours._idx == theirs._idx
        assert ours.offset.tolist() == theirs.offset.tolist()
        assert ours.left_padding.tolist() == theirs.left_padding.tolist()
        assert np.array_equal(ours._holes(ours._idx), theirs._holes(theirs._idx))
        used = ours._idx
    else:
        assert ours.offset == theirs.offset
        used = ours.offset
    if ours.keys is None or used == 0:
        return
    for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
        assert mx.array_equal(a[..., :used, :], b[..., :used, :]).item()


@pytest.fixture()
def mirrored_kit(tiny_pair):
    plain = load_model(str(tiny_pair[0]))
    follower = ShadowFollower(load_model(str(tiny_pair[0])).model)
    mirror = Mirror(follower, lambda what: contextlib.nullcontext())
    adopt = mirror.adopt

    def adopt_and_track(cache):
        follower.rank0[adopt(cache).handle] = cache
        return cache

    mirror.adopt = adopt_and_track
    MirroredKVCache.mirror = mirror
    target = MirroredTarget(plain.model, mirror, lambda what: contextlib.nullcontext())
    kit = ModelKit(LoadedModel(plain.name, plain.path, target, plain.tokenizer, plain.config))
    kit.load_draft(str(tiny_pair[1]))
    yield kit, follower
    MirroredKVCache.mirror = None


def run(kit, *, cancel: int | None = None, change_draft_at: int | None = None):
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=8, idle_prefill_chunk=16),
                          SpeculationPolicy(4, 8, 3))
    scheduler.prefix_cache = PrefixCache(1 << 26)
    tokenizer = kit.target.tokenizer
    requests = [GenerationParams(tuple(tokenizer.encode(TEXTS[i % len(TEXTS)])), 12 + 2 * i,
                                 speculation=SpeculationParams(num_draft_tokens=4 * (i % 2)))
                for i in range(7)]
    outputs = []
    for wave in (requests, requests[:3]):  # the second wave hits the prefix cache
        seqs = [scheduler.submit(p, lambda event: None) for p in wave]
        steps = 0
        while any(s.phase is not Phase.DONE for s in seqs):
            scheduler.step()
            steps += 1
            if cancel is not None and steps == 3:
                scheduler.cancel(seqs[cancel])
            if change_draft_at == steps:
                scheduler.draft_changed()
        outputs.append([list(s.output) for s in seqs])
    return outputs


def test_the_shadow_follower_sees_rank_0s_caches_at_every_forward(mirrored_kit, tiny_pair):
    kit, follower = mirrored_kit
    ours = run(kit, cancel=2)
    assert follower.forwards > 20
    plain = ModelKit(load_model(str(tiny_pair[0])))
    plain.load_draft(str(tiny_pair[1]))
    assert ours == run(plain, cancel=2)


def test_a_draft_change_mid_run_stays_mirrored(mirrored_kit):
    kit, follower = mirrored_kit
    run(kit, change_draft_at=4)
    assert follower.forwards > 20
    gc.collect()
    MirroredKVCache.mirror.send()
    assert set(follower.caches) == set(follower.rank0.keys())  # what rank 0 freed, it freed
