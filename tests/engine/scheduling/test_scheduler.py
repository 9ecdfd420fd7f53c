"""The scheduler and the batched decoder: batching changes no request's output.

Engine-level tests drive a `Scheduler` on the test's thread (no HTTP), so every request's
tokens can be compared with the same request run alone and with `mlx_lm`.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from support.engine import (
    TEXTS,
    alone,
    assert_same_or_near_tie,
    pair_kit,
    params,
    run_batch,
    tokens_of,
)
from support.http import chat_body
from support.servers import served

from server.engine.errors import QueueFull
from server.engine.events import Finished, TokenEvent
from server.engine.generation import generate_events
from server.engine.models.model_kit import ModelKit
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.cost_model import DrafterRates, StepCosts
from server.engine.speculation.forward_times import ForwardTimes
from server.engine.speculation.policy import SpeculationPolicy

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def noisy_draft_kit(tiny_pair) -> ModelKit:
    """The tiny pair with heavy noise on the draft's weights: it seldom agrees with the target
    (nor with prompt lookup), so a draft cache that kept its own tokens shows."""
    from mlx.utils import tree_flatten, tree_unflatten

    kit = pair_kit(tiny_pair)
    model = kit.draft.model
    key = mx.random.key(0)
    noisy = []
    for name, w in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        noisy.append((name, w + 4.0 * w.std() * mx.random.normal(w.shape, w.dtype, key=sub)))
    model.update(tree_unflatten(noisy))
    return kit


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("k", [0, 4], ids=["no-draft", "draft-k4"])
def test_concurrent_greedy_requests_equal_each_alone(kit, n, k):
    requests = [params(kit, i, k=k if i % 2 == 0 else 0) for i in range(n)]
    events, seqs = run_batch(kit, requests)
    for p, ev in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))
        assert isinstance(ev[-1], Finished)
    if k:  # the drafting rows really drafted, in a batch
        assert sum(s.counters.proposed for s in seqs) > 0


def test_alone_equals_mlx_lm(kit):
    p = params(kit, 0, k=4)
    expected = [int(t) for t, _ in generate_step(mx.array(p.prompt_tokens), kit.target.model,
                                                 max_tokens=p.max_tokens)]
    assert alone(kit, p) == expected


def test_batched_speculation_accepts_different_lengths_per_row(kit):
    """Rows with different acceptance in the same round stay exact (the ragged trim)."""
    requests = [params(kit, i, k=4, max_tokens=40) for i in range(4)]
    events, seqs = run_batch(kit, requests)
    for p, ev in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))
    rates = {round(s.counters.accepted / max(s.counters.proposed, 1), 3) for s in seqs}
    assert len(rates) > 1  # the rows did accept at different rates


def test_hybrid_rows_that_look_up_while_the_draft_model_drafts_for_others(noisy_draft_kit,
                                                                         monkeypatch):
    """A hybrid row in a lookup round still sits in the draft model's batch: it catches up
    there while other rows draft with the model, and must keep none of the draft model's own
    tokens. Checked at every model round: each row's first draft token is the draft model's
    greedy token after the row's whole context (what a cache holding exactly that context
    gives); and mixed drafters in one batch give each row its text alone."""
    from server.engine.scheduling import decoder
    kit = noisy_draft_kit
    checked = []  # per model round: did a hybrid row that had looked up draft with the model
    looked_up = set()
    real = decoder._draft_with_model

    def with_model(batch, ks):
        contexts = {id(r): list(r.context) for r in batch.rows}
        proposals, steps = real(batch, ks)
        for r in batch.rows:
            if r.round_drafter == "prompt_lookup":
                looked_up.add(id(r))
            elif proposals[id(r)].tokens:  # (a row the draft fell far behind catches up first)
                logits = kit.draft.model(mx.array(contexts[id(r)])[None])[0, -1]
                assert proposals[id(r)].tokens[0] == int(mx.argmax(logits))
                checked.append(id(r) in looked_up)
        return proposals, steps

    monkeypatch.setattr(decoder, "_draft_with_model", with_model)
    requests = []
    for i in range(8):
        p = params(kit, i, k=4, max_tokens=60)
        source = "hybrid" if i % 2 == 0 else "model"
        requests.append(replace(p, speculation=replace(p.speculation, source=source,
                                                       adaptive=False)))
    events, _ = run_batch(kit, requests)
    assert sum(checked) > 10
    for p, ev in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))


def _table(rows, tokens, seconds):
    return ForwardTimes(tuple(rows), tuple(tokens), tuple(map(tuple, seconds)))


# At 8 rows a second token costs 20% more than one, a third 100% more (tests/test_cost_model.py).
COSTS = StepCosts(_table((1, 8), (1, 2, 3), [[0.05, 0.05, 0.06], [0.10, 0.12, 0.24]]),
                  _table((1, 8), (1, 2), [[0.001, 0.001], [0.002, 0.003]]))


def test_the_cost_model_chooses_each_rows_k_in_a_batch(kit):
    """With measured costs, rows draft what pays, within the caps (by default k = 4 anywhere).
    Three greedy rows with no rounds yet, at the prior 0.5 plus one standard error (0.8536):
    plain 3 / 0.0643 = 46.7 tok/s; k = 1, 5.561 / (0.07 + 0.0013) = 78.0; k = 2, 7.746 /
    (0.1114 + 0.0026) = 67.9; k = 3, 9.612 / (0.1529 + 0.0039) = 61.3: k = 1.
    A seeded sampled row keeps its own k (4), so its text does not depend on the batch; the
    round is then 5 wide and the draft runs 4 steps anyway, so the others draft 4 too."""
    policy = SpeculationPolicy()
    assert (policy.num_draft_tokens, policy.batch_draft_tokens, policy.spec_max_batch) == \
        (4, 4, 256)
    requests = [params(kit, i, k=4, max_tokens=30) for i in range(3)]
    seeded = params(kit, 1, k=4, temperature=0.9, seed=8, max_tokens=30)
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16), policy)
    scheduler.costs = COSTS
    events = [[] for _ in range(4)]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate([*requests, seeded])]
    rates = DrafterRates()  # before any round: every row at the prior
    def for_round(rows, batch_size, costs=None):
        return policy.choose(policy.round_options(rows, batch_size, rates), len(rows),
                             len(rows), costs)

    assert for_round(seqs[:3], 3, COSTS) == {id(s): 1 for s in seqs[:3]}
    assert for_round(seqs, 4, COSTS) == {id(s): 4 for s in seqs}
    assert for_round(seqs[:1], 1) == {id(seqs[0]): 4}  # no costs: up to the caps
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, s, ev in zip(requests, seqs[:3], events[:3], strict=True):
        assert s.counters.proposed > 0
        assert s.tried["model"][1] >= s.tried["model"][0] == s.counters.accepted
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))
    assert tokens_of(events[3]) == alone(kit, seeded)


def test_a_learned_choice_picks_within_the_most_k_a_request_allows(kit):
    """The adaptive schedule halves k after an early rejection; a learned choice (the
    `YieldLearner` picks k from measured rounds) is offered the request's whole range instead.
    A request that fixed its k ("adaptive": false) keeps that k either way."""
    policy = SpeculationPolicy()
    adaptive = params(kit, 0, k=4, max_tokens=30)
    fixed = replace(params(kit, 1, k=3, max_tokens=30),
                    speculation=SpeculationParams(num_draft_tokens=3, adaptive=False))
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16), policy)
    seqs = [scheduler.submit(p, lambda event: None) for p in (adaptive, fixed)]
    for seq in seqs:
        seq.schedule.update(requested=seq.schedule.k, proposed=seq.schedule.k, accepted=0)
    assert [seq.schedule.k for seq in seqs] == [2, 3]  # halved; fixed: unchanged

    def caps(learned):
        return [o.cap for o in policy.round_options(seqs, 1, DrafterRates(), learned=learned)]

    assert caps(learned=False) == [2, 3]
    assert caps(learned=True) == [4, 3]


def test_prompts_arriving_while_others_decode_share_one_prefill_forward(kit, monkeypatch):
    """Three prompts submitted while two rows decode are prefilled in one (3, L) forward in
    the next step, not one forward each; their outputs are those of each request alone."""
    import server.engine.scheduling.scheduler as scheduler_module
    monkeypatch.setattr(scheduler_module, "DEFAULT_GROUP_OVERHEAD", 10**6)  # any padding

    calls = []
    rows_prefill, one_prefill = scheduler_module.prefill_rows, scheduler_module.prefill

    def counted_rows(model, caches, chunks):
        calls.append(len(chunks))
        return rows_prefill(model, caches, chunks)

    def counted_one(model, cache, tokens):
        calls.append(1)
        return one_prefill(model, cache, tokens)

    monkeypatch.setattr(scheduler_module, "prefill_rows", counted_rows)
    monkeypatch.setattr(scheduler_module, "prefill", counted_one)
    first = [params(kit, i, max_tokens=20) for i in range(2)]
    later = [params(kit, i, max_tokens=10) for i in range(2, 5)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=128), SpeculationPolicy(4, 0))
    events = [[] for _ in range(5)]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(first)]
    while any(s.phase is not Phase.DECODE for s in seqs):
        scheduler.step()
    scheduler.step()
    calls.clear()
    seqs += [scheduler.submit(p, events[i + 2].append) for i, p in enumerate(later)]
    scheduler.step()
    assert calls == [3] and all(s.phase is Phase.DECODE for s in seqs[2:])
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, ev in zip([*first, *later], events, strict=True):
        assert tokens_of(ev) == alone(kit, p)


def test_sampled_and_greedy_rows_do_not_affect_each_other(kit):
    greedy = params(kit, 0, k=4)
    sampled = params(kit, 1, k=4, temperature=0.9, top_p=0.95, seed=11)
    plain_sampled = params(kit, 2, temperature=0.7, seed=5, repetition_penalty=1.2)
    events, _ = run_batch(kit, [greedy, sampled, plain_sampled])
    assert tokens_of(events[0]) == alone(kit, greedy)
    assert tokens_of(events[1]) == alone(kit, sampled)  # seeded: the same alone and batched
    assert tokens_of(events[2]) == alone(kit, plain_sampled)
    assert alone(kit, sampled) == alone(kit, sampled)


def test_a_seeded_request_gives_the_same_text_alone_and_in_a_batch_that_stops_speculating(kit):
    """With the default policy a batch stops speculating; a seeded drafting request does not,
    so its sampled text is the same whatever else runs."""
    seeded = params(kit, 1, k=4, temperature=0.9, seed=21, max_tokens=24)
    others = [params(kit, i, k=4) for i in (0, 2, 3)]
    events, seqs = run_batch(kit, [seeded, *others], spec_max_batch=1)
    assert tokens_of(events[0]) == alone(kit, seeded)
    assert seqs[0].counters.proposed > 0
    for p, ev in zip(others, events[1:], strict=True):
        assert tokens_of(ev) == alone(kit, p)


def test_rows_joining_a_large_batch_skip_the_draft_until_they_can_draft(kit):
    """A batch too large to speculate does not prefill the draft; a row left alone catches the
    draft up on its whole context and drafts, with the same greedy text."""
    requests = [params(kit, i, k=4, max_tokens=12 + 20 * (i == 2)) for i in range(3)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16), SpeculationPolicy(4, 1))
    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    scheduler.step()  # all three admitted: a batch of 3 does not draft
    assert all(s.draft_cache is None for s in seqs)
    while scheduler.prefilling:
        scheduler.step()
    assert len(scheduler.draft) == 0
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    assert [s.counters.proposed for s in seqs[:2]] == [0, 0]
    assert seqs[2].counters.proposed > 0 and seqs[2].counters.accepted > 0
    for p, ev in zip(requests, events, strict=True):
        assert tokens_of(ev) == alone(kit, p)


def test_rows_catch_the_draft_up_one_step_at_a_time(kit):
    """When a batch shrinks enough to draft, its rows catch the draft up on their contexts
    within `prefill_chunk` tokens per step (one row here: each context is longer), not all
    at once."""
    requests = [params(kit, i, k=4, max_tokens=30 if i else 3) for i in range(3)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=8), SpeculationPolicy(4, 2))
    seqs = [scheduler.submit(p, lambda e: None) for p in requests]
    while seqs[0].phase is not Phase.DONE:
        scheduler.step()
    assert all(len(s.context) > 8 for s in seqs[1:]) and len(scheduler.draft or []) == 0
    scheduler.step()
    assert len(scheduler.draft) == 1
    scheduler.step()
    assert len(scheduler.draft) == 2
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, s in zip(requests, seqs, strict=True):
        assert s.output == alone(kit, p)


@pytest.mark.parametrize("chunk", [16, 1024], ids=["one-can-join", "all-can-join"])
def test_a_round_is_priced_with_the_rows_that_can_draft_in_it(kit, chunk):
    """Eight rows decode without the draft's prefill. With COSTS and the prior 0.5, k = 1 pays
    if all eight draft (12 tokens / 0.122 s = 98 tok/s against 80 x 1.1 for plain rounds), not
    if one does (8.5 / 0.121 = 70). With `prefill_chunk` 16 one row a step could catch the draft
    up on its context: the rounds stay plain and the draft prefills nothing. With 1024 all
    eight catch up in the first round and draft. Either way each text is the one it has alone."""
    base = params(kit, 2, k=4, max_tokens=12)
    requests = [replace(base, prompt_tokens=(base.prompt_tokens * 4)[:40 + i]) for i in range(8)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=chunk), SpeculationPolicy())
    scheduler.costs = StepCosts(COSTS.target, COSTS.draft)
    scheduler._draft_may_pay = lambda seq: False
    seqs = [scheduler.submit(p, lambda e: None) for p in requests]
    while scheduler.prefilling or not len(scheduler.target):
        scheduler.step()
    scheduler.step()  # the first decoding round
    assert len(scheduler.draft or []) == (0 if chunk == 16 else 8)
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
        assert chunk > 16 or len(scheduler.draft or []) == 0
    assert all((s.counters.proposed > 0) == (chunk > 16) for s in seqs)
    for p, s in zip(requests, seqs, strict=True):
        assert_same_or_near_tie(kit, p, s.output, alone(kit, p))


@pytest.mark.parametrize("k", [0, 4], ids=["no-draft", "drafting"])
def test_short_prompts_arriving_together_are_prefilled_in_one_forward(kit, monkeypatch, k):
    """Whole prompts that fit the step's budget share one forward (per model, when
    they draft); a row that ends at its first token leaves the group; the prefix cache gets
    each row's own prompt."""
    import server.engine.scheduling.scheduler as scheduler_module
    from server.engine.kv.prefix_cache import PrefixCache

    groups = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows",
                        lambda model, caches, chunks: groups.append(len(chunks))
                        or real(model, caches, chunks))
    requests = [params(kit, i, k=k, max_tokens=1 if i == 1 else 16) for i in (0, 1, 3, 5, 6)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=512), SpeculationPolicy(4, 8))
    scheduler.prefix_cache = PrefixCache(1 << 30)
    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    scheduler.step()
    # one prefill forward for all five (and one of the draft's, when they draft)
    assert groups == [len(requests)] * (2 if k else 1)
    assert seqs[1].phase is Phase.DONE and len(scheduler.target) == 4
    assert len(scheduler.draft or []) == (4 if k else 0)
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, ev in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))
    if k:
        assert all(s.counters.proposed > 0 for s in seqs if s is not seqs[1])
    again = []
    seq = scheduler.submit(requests[2], again.append)
    while seq.phase is not Phase.DONE:
        scheduler.step()
    assert seq.cached_tokens == len(requests[2].prompt_tokens) - 1
    assert tokens_of(again) == tokens_of(events[2])


@pytest.mark.parametrize("k", [0, 4], ids=["no-draft", "drafting"])
def test_prompts_restored_to_different_lengths_share_one_prefill(kit, monkeypatch, k):
    """Prompts the prefix cache restored to different lengths (and a fresh one) are still
    prefilled together, in one forward per model, and each gives its output alone."""
    import server.engine.scheduling.scheduler as scheduler_module
    monkeypatch.setattr(scheduler_module, "DEFAULT_GROUP_OVERHEAD", 10**6)  # any padding
    from server.engine.kv.prefix_cache import PrefixCache

    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=512), SpeculationPolicy(4, 8))
    scheduler.prefix_cache = PrefixCache(1 << 30)
    seen = [params(kit, i, k=k, max_tokens=2) for i in (0, 4)]
    for p in seen:  # one at a time: the cache now holds two prompts of different lengths
        seq = scheduler.submit(p, lambda e: None)
        while seq.phase is not Phase.DONE:
            scheduler.step()
    extend = kit.target.tokenizer.encode
    requests = [replace(seen[0], prompt_tokens=seen[0].prompt_tokens + tuple(extend(" x = 2")),
                        max_tokens=12),
                replace(seen[1], prompt_tokens=seen[1].prompt_tokens + tuple(extend(" and")),
                        max_tokens=12),
                params(kit, 6, k=k, max_tokens=12)]
    groups = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows",
                        lambda model, caches, chunks: groups.append(len(chunks))
                        or real(model, caches, chunks))
    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    scheduler.step()
    assert groups == [len(requests)] * (2 if k else 1)
    cached = [s.cached_tokens for s in seqs]
    assert cached[0] != cached[1] and min(cached[:2]) > 0 and cached[2] == 0
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, ev in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(ev), alone(kit, p))


def test_first_tokens_go_out_before_the_drafts_prefill(kit, monkeypatch):
    """A drafting group's first tokens need only the target's prefill: they are emitted
    before the draft prefills the same prompts."""
    import server.engine.scheduling.scheduler as scheduler_module

    order = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows", lambda model, caches, chunks: (
        order.append("draft" if model is kit.draft.model else "target")
        or real(model, caches, chunks)))
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4, 8, 2))
    requests = [params(kit, i, k=2, max_tokens=4) for i in range(2)]
    seqs = [scheduler.submit(p, lambda e: isinstance(e, TokenEvent) and order.append("token"))
            for p in requests]
    scheduler.step()
    assert order[:4] == ["target", "token", "token", "draft"]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    assert all(s.counters.proposed for s in seqs)


def test_prompts_that_would_pad_each_other_more_than_a_forward_costs_go_in_two_groups(
        kit, monkeypatch):
    """Short prompts are not padded to a long one's length when the padding would cost more
    than a forward of its own (`DEFAULT_GROUP_OVERHEAD` tokens): the short ones share a
    forward, the long one gets its own. Outputs are those of each request alone."""
    import server.engine.scheduling.scheduler as scheduler_module

    widths = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows", lambda model, caches, chunks: (
        widths.append([len(c) for c in chunks]) or real(model, caches, chunks)))
    monkeypatch.setattr(scheduler_module, "DEFAULT_GROUP_OVERHEAD", 32)
    base = params(kit, 0, max_tokens=6)
    tokens = base.prompt_tokens * 40
    short = [replace(base, prompt_tokens=tokens[i: i + n]) for i, n in enumerate((3, 4, 5))]
    long = replace(base, prompt_tokens=tokens[3: 43])  # padding the others: 3 x 35 > 32
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4, 0))
    requests = [long, *short]
    seqs = [scheduler.submit(p, lambda e: None) for p in requests]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    assert sorted(map(sorted, widths)) == [[3, 4, 5], [40]]
    for p, s in zip(requests, seqs, strict=True):
        assert_same_or_near_tie(kit, p, s.output, alone(kit, p))


def test_a_forwards_fixed_cost_in_tokens_comes_from_the_measured_table(kit):
    """One token's forward (0.05 s) over a token of the largest forward (0.24 s / 24 tokens)."""
    from server.engine.scheduling.scheduler import DEFAULT_GROUP_OVERHEAD

    scheduler = Scheduler(kit)
    assert scheduler._group_overhead() == DEFAULT_GROUP_OVERHEAD  # nothing measured
    scheduler.costs = COSTS
    assert scheduler._group_overhead() == 5


def test_a_group_takes_a_prompt_while_padding_costs_less_than_a_forward():
    from server.engine.scheduling.scheduler import _fits

    assert _fits([], 0, 100, budget=100, overhead=0)  # the first, if it fits alone
    assert not _fits([], 0, 101, budget=100, overhead=0)  # else it is prefilled in chunks
    assert _fits([10, 20], 20, 36, budget=1024, overhead=32)  # pads two rows 16: 32 <= 32
    assert not _fits([10, 20], 20, 37, budget=1024, overhead=32)  # 34 > 32
    assert _fits([10, 20], 20, 5, budget=1024, overhead=15)  # shorter: padded itself by 15
    assert not _fits([10, 20], 20, 5, budget=1024, overhead=14)
    assert not _fits([10, 20], 20, 30, budget=89, overhead=100)  # 3 x 30 > 89


def test_a_wave_starts_with_the_last_group_of_the_shortest_first_cut():
    from types import SimpleNamespace

    from server.engine.scheduling.scheduler import _last_group

    order = [SimpleNamespace(unprefilled=n) for n in (10, 12, 14, 60, 61, 200)]
    assert [s.unprefilled for s in _last_group(order, 1024, 32)] == [200]  # 2 x 139 > 32
    assert [s.unprefilled for s in _last_group(order[:5], 1024, 32)] == [60, 61]
    assert [s.unprefilled for s in _last_group(order[:5], 1024, 10**6)] == [10, 12, 14, 60, 61]
    assert [s.unprefilled for s in _last_group(order[:5], 150, 10**6)] == [60, 61]


def test_drafting_and_plain_prompts_share_a_prefill_group(kit, monkeypatch):
    """One target forward for the whole group, the draft's over its drafting rows only; those
    alone join the draft's batch. Outputs are those of each request alone."""
    import server.engine.scheduling.scheduler as scheduler_module
    monkeypatch.setattr(scheduler_module, "DEFAULT_GROUP_OVERHEAD", 10**6)  # any padding

    widths = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows", lambda model, caches, chunks: (
        widths.append((model is kit.draft.model, len(chunks))) or real(model, caches, chunks)))
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4, 8, 2))
    requests = [params(kit, i, k=2 if i % 2 else 0, max_tokens=12) for i in range(4)]
    seqs = [scheduler.submit(p, lambda e: None) for p in requests]
    scheduler.step()
    assert widths == [(False, 4), (True, 2)]
    assert [s in scheduler.draft for s in seqs] == [False, True, False, True]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, s in zip(requests, seqs, strict=True):
        assert_same_or_near_tie(kit, p, s.output, alone(kit, p))


def test_a_burst_is_prefilled_in_large_steps_unless_rows_decode_and_it_is_no_wave(
        kit, monkeypatch):
    """`idle_prefill_chunk` while no request decodes (one grouped forward per step), and for a
    wave (`_in_wave`): no decoding round until all of it is in (each row's first token comes
    with its group). `prefill_chunk` for prompts that are no wave, so the running streams are
    stalled by at most that per round. Outputs are those of each request alone."""
    import server.engine.scheduling.scheduler as scheduler_module

    groups = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows",
                        lambda model, caches, chunks: groups.append(len(chunks))
                        or real(model, caches, chunks))
    base = params(kit, 0, max_tokens=8)
    burst = [replace(base, prompt_tokens=(base.prompt_tokens * 20)[i: i + 10]) for i in range(6)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=8, idle_prefill_chunk=20),
                          SpeculationPolicy(4, 0))
    seqs = [scheduler.submit(p, lambda e: None) for p in burst]
    scheduler.step()  # a wave of 6: two prompts in one forward (their first tokens), no round
    assert groups == [2] and sorted(len(s.output) for s in seqs) == [0, 0, 0, 0, 1, 1]
    scheduler.step()  # two more, and still no round
    assert groups == [2, 2] and sorted(len(s.output) for s in seqs) == [0, 0, 1, 1, 1, 1]
    scheduler.step()  # the wave's last two, then a round for all six
    assert groups == [2, 2, 2] and [len(s.output) for s in seqs] == [2] * 6
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()

    monkeypatch.setattr(scheduler_module, "WAVE_MAX_TOKENS", 8)  # no longer a wave
    first = [scheduler.submit(p, lambda e: None) for p in burst[:2]]
    scheduler.step()  # nothing decodes: both in one forward, and a round
    assert [len(s.output) for s in first] == [2, 2]
    later = [scheduler.submit(p, lambda e: None) for p in burst[2:4]]
    scheduler.step()  # 2 prompts behind 2 rows: 8 prompt tokens this step, and a round
    assert sorted(s.prefilled for s in later) == [0, 8] and [len(s.output) for s in first] == [3, 3]
    while any(s.phase is not Phase.DONE for s in first + later):
        scheduler.step()
    for p, s in zip(burst + burst[:4], seqs + first + later, strict=True):
        assert_same_or_near_tie(kit, p, s.output, alone(kit, p))


def test_waiting_prompts_are_grouped_shortest_first_and_the_oldest_is_not_starved(
        kit, monkeypatch):
    """Outside a wave, the prefill group takes the shortest waiting prompts (less padding),
    not the oldest; once `MAX_PASSED_OVER` groups went before the oldest prompt, it goes next.
    Outputs are those of each request alone."""
    import server.engine.scheduling.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "WAVE_MAX_TOKENS", 0)  # no wave: see the next test

    widths = []
    real_rows, real_one = scheduler_module.prefill_rows, scheduler_module.prefill
    monkeypatch.setattr(scheduler_module, "prefill_rows", lambda model, caches, chunks:
                        widths.append(sorted(len(c) for c in chunks))
                        or real_rows(model, caches, chunks))
    monkeypatch.setattr(scheduler_module, "prefill", lambda model, cache, tokens:
                        widths.append([len(tokens)]) or real_one(model, cache, tokens))
    base = params(kit, 0, max_tokens=3)

    def sized(n: int) -> GenerationParams:
        return replace(base, prompt_tokens=(base.prompt_tokens * 20)[:n])

    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=24, idle_prefill_chunk=24),
                          SpeculationPolicy(4, 0))
    requests = [sized(40), sized(12), sized(8), sized(30)]
    seqs = [scheduler.submit(p, lambda e: None) for p in requests]
    scheduler.step()
    assert widths == [[8, 12]]  # not the 40-token prompt that came first
    for _ in range(scheduler_module.MAX_PASSED_OVER):
        seqs += [scheduler.submit(p, lambda e: None) for p in (sized(6), sized(7))]
    while seqs[0].prefill_passed_over < scheduler_module.MAX_PASSED_OVER:
        scheduler.step()
    widths.clear()
    scheduler.step()
    assert widths[0] == [24]  # the oldest's first chunk, before the 30-token prompt and others
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for s in seqs:
        assert_same_or_near_tie(kit, s.params, s.output, alone(kit, s.params))


def test_a_wave_prefills_its_longest_prompts_first_and_the_most_rows_last(kit, monkeypatch):
    """A wave is cut into groups shortest first (little padding), but the groups go longest
    first: a row that got its first token waits for every later group, so the group with the
    most rows goes last. No round runs in between. Outputs are those of each request alone."""
    import server.engine.scheduling.scheduler as scheduler_module

    widths = []
    real = scheduler_module.prefill_rows
    monkeypatch.setattr(scheduler_module, "prefill_rows", lambda model, caches, chunks:
                        widths.append(sorted(len(c) for c in chunks))
                        or real(model, caches, chunks))
    base = params(kit, 0, max_tokens=3)
    wave = [replace(base, prompt_tokens=(base.prompt_tokens * 20)[:n]) for n in (10, 4, 5, 11, 6)]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=24, idle_prefill_chunk=24),
                          SpeculationPolicy(4, 0))
    seqs = [scheduler.submit(p, lambda e: None) for p in wave]
    scheduler.step()
    assert widths == [[10, 11]] and [len(s.output) for s in seqs] == [1, 0, 0, 1, 0]
    scheduler.step()  # the three shortest, in one forward (3 x 6 of 24), then the first round
    assert widths == [[10, 11], [4, 5, 6]] and [len(s.output) for s in seqs] == [2] * 5
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, s in zip(wave, seqs, strict=True):
        assert_same_or_near_tie(kit, p, s.output, alone(kit, p))


def test_a_row_the_draft_fell_behind_catches_up_a_few_tokens_per_round(kit, monkeypatch):
    """Rows that did not draft for 20 rounds (as when their batch was too large for it to pay)
    feed the draft at most `CATCH_UP_WIDTH` tokens of that backlog per round, and draft again
    once it is in; rows whose end comes first do not start. Outputs are those of each request
    alone."""
    from server.engine.kv.batch import ModelBatch
    from server.engine.scheduling.decoder import CATCH_UP_WIDTH

    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4, 8, 2))
    policy, rounds, widths = scheduler.policy, [], []

    class Paused:  # no drafting in rounds 2 to 21
        drafts, round_options = policy.drafts, policy.round_options

        def choose(self, *args):
            rounds.append(len(rounds) + 1)
            ks = policy.choose(*args)
            return {} if 2 <= rounds[-1] <= 21 else ks

    scheduler.policy = Paused()
    real_forward = ModelBatch.forward
    monkeypatch.setattr(ModelBatch, "forward", lambda batch, inputs, **kw: (
        widths.append(inputs.shape[1]) if batch is scheduler.draft else None)
        or real_forward(batch, inputs, **kw))
    requests = [params(kit, 0, k=2, max_tokens=80), params(kit, 1, k=2, max_tokens=25)]
    seqs = [scheduler.submit(p, lambda e: None) for p in requests]
    proposed = []
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
        if len(rounds) == 21 and not proposed:
            proposed = [s.counters.proposed for s in seqs]
    assert max(widths) == CATCH_UP_WIDTH  # the backlog went in 8 at a time
    assert seqs[0].counters.proposed > proposed[0]  # and the long request drafted again
    assert seqs[1].counters.proposed == proposed[1]  # the short one ended first: no catch-up
    for p, s in zip(requests, seqs, strict=True):
        assert_same_or_near_tie(kit, p, s.output, alone(kit, p))


def test_a_new_row_gets_the_drafts_prefill_only_if_its_batch_size_recently_drafted(
        kit, monkeypatch):
    """At one row, with these costs, drafting saves 0.0275 s per token (the prior 0.854 with
    k = 4: 44.5 tok/s against 20): 0.55 s over 20 tokens, which repays the draft's prefill
    of a 200-token prompt (0.0375 s), but not when single rows drafted in none of the last
    300 rounds (share 2 / 52: 0.021 s). The row still gives its output alone."""
    import server.engine.scheduling.scheduler as scheduler_module

    base = params(kit, 0, k=4, max_tokens=20)
    request = replace(base, prompt_tokens=(base.prompt_tokens * 40)[:200])
    real = scheduler_module.prefill_rows
    widths = []
    monkeypatch.setattr(scheduler_module, "prefill_rows", lambda model, caches, chunks: (
        widths.append(model is kit.draft.model) or real(model, caches, chunks)))
    for drafted in (True, False):
        widths.clear()
        scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy())
        scheduler.costs = COSTS
        for _ in range(300):
            scheduler.drafting_share.record(1, drafted)
        seq = scheduler.submit(request, lambda e: None)
        while seq.phase is not Phase.DONE:
            scheduler.step()
        assert widths == ([False, True] if drafted else [False])
        assert_same_or_near_tie(kit, request, seq.output, alone(kit, request))


def test_a_seeded_sampled_row_drafts_even_where_drafting_does_not_pay(kit):
    """Its text depends on drafting its own k in every round, so it gets the draft's prefill
    even when the cost model says drafting would not repay it (a draft forward as dear as ten
    of the target's): its text is the one it has alone; the greedy row does not draft."""
    slow = _table((1, 8), (1, 2), [[0.5, 0.5], [0.5, 0.5]])
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16), SpeculationPolicy())
    scheduler.costs = StepCosts(COSTS.target, slow)
    seeded = params(kit, 1, k=4, temperature=0.9, seed=8, max_tokens=20)
    greedy = params(kit, 0, k=4, max_tokens=20)
    events = [[], []]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate([greedy, seeded])]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    assert seqs[0].counters.proposed == 0 and seqs[1].counters.proposed > 0
    assert tokens_of(events[1]) == alone(kit, seeded)


def test_unseeded_rows_draw_their_own_randomness(kit):
    p = params(kit, 1, temperature=1.0, max_tokens=24)
    events, _ = run_batch(kit, [p, p])
    assert tokens_of(events[0]) != tokens_of(events[1])


def test_cancelling_one_row_leaves_the_others_unchanged(kit):
    requests = [params(kit, i, k=4 if i % 2 else 0, max_tokens=30) for i in range(4)]
    events, seqs = run_batch(kit, requests, cancel_after={1: 3})
    assert len(seqs[1].output) <= 3 + 5  # stops within one round (k + 1 tokens)
    for i in (0, 2, 3):
        assert tokens_of(events[i]) == alone(kit, requests[i])


def test_a_long_prompt_is_prefilled_in_chunks_between_decoding_rounds(kit):
    short = params(kit, 0, max_tokens=40)
    long = GenerationParams(tuple(range(3, 3 + 200)), 5)
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=32), SpeculationPolicy(4, 8))
    out = []
    first = scheduler.submit(short, out.append)
    while first.phase is not Phase.DECODE:
        scheduler.step()
    second = scheduler.submit(long, lambda e: None)
    produced_during_prefill = 0
    while second.phase is not Phase.DECODE:
        before = len(first.output)
        scheduler.step()
        produced_during_prefill += len(first.output) - before
    assert produced_during_prefill >= 200 // 32 - 1  # one round per prefill chunk


def test_queue_overflow_is_refused(kit):
    scheduler = Scheduler(kit, SchedulerConfig(max_batch_size=1, max_queue_size=2))
    for i in range(2):
        scheduler.submit(params(kit, i), lambda e: None)
    with pytest.raises(QueueFull):
        scheduler.submit(params(kit, 3), lambda e: None)


def test_max_tokens_zero_finishes_at_once(kit):
    events = list(generate_events(kit, params(kit, 0, max_tokens=0)))
    assert len(events) == 1 and events[0].finish_reason == "length"


def test_ignore_eos_and_min_tokens(kit):
    eos = next(iter(kit.target.tokenizer.eos_token_ids))
    bias = ((eos, 100.0),)  # EOS would be the argmax at every step
    p = GenerationParams(params(kit, 0).prompt_tokens, 6,
                         sampling=SamplingParams(logit_bias=bias))
    assert tokens_of(list(generate_events(kit, p))) == [eos]
    for k in (0, 4):
        forced = GenerationParams(p.prompt_tokens, 6, sampling=p.sampling, ignore_eos=True,
                                  speculation=SpeculationParams(num_draft_tokens=k))
        out = tokens_of(list(generate_events(kit, forced)))
        assert len(out) == 6 and eos not in out
        at_least = GenerationParams(p.prompt_tokens, 6, sampling=p.sampling, min_tokens=3,
                                    speculation=SpeculationParams(num_draft_tokens=k))
        out = tokens_of(list(generate_events(kit, at_least)))
        assert len(out) == 4 and out[-1] == eos and eos not in out[:3]


# -- through HTTP ----------------------------------------------------------------------------


async def test_concurrent_http_requests_equal_sequential_ones(tiny_pair):
    bodies = [chat_body(TEXTS[i], max_tokens=16, num_draft_tokens=4 if i % 2 else 0)
              for i in range(6)]
    async with served(*tiny_pair) as (client, _):
        sequential = [(await client.post("/v1/chat/completions", json=b)).json() for b in bodies]
        concurrent = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=b) for b in bodies))
    for one, many in zip(sequential, concurrent, strict=True):
        assert many.status_code == 200
        assert many.json()["choices"][0]["message"] == one["choices"][0]["message"]


async def test_full_queue_is_503_with_retry_after(tiny_pair):
    async with served(*tiny_pair, max_queue_size=1, engine={"max_batch_size": 1}) as (c, e):
        running = asyncio.create_task(c.post("/v1/chat/completions",
                                             json=chat_body(max_tokens=3000, use_draft=False)))
        while e.batch_size < 1:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(c.post("/v1/chat/completions",
                                             json=chat_body(max_tokens=2)))
        while e.queue_depth < 1:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        running.cancel()
        assert (await waiting).status_code == 200


async def test_a_cancelled_request_frees_its_row(tiny_pair):
    async with served(*tiny_pair) as (_, engine):
        job = engine.submit(GenerationParams(prompt_tokens=(1, 2, 3), max_tokens=100_000))
        seen = 0
        async for _ in job:
            seen += 1
            if seen == 3:
                job.cancel()
                break
        for _ in range(500):
            if engine.batch_size == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.batch_size == 0
        assert len(job.sequence.output) <= 3 + 5  # at most one more round


async def test_draft_unload_during_a_running_batch(tiny_pair):
    async with served(*tiny_pair) as (client, engine):
        bodies = [chat_body(TEXTS[i], max_tokens=60) for i in range(3)]
        expected = [(await client.post("/v1/chat/completions", json={**b, "use_draft": False}))
                    .json()["choices"][0]["message"]["content"] for b in bodies]
        tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=b))
                 for b in bodies]
        while engine.batch_size < 3:
            await asyncio.sleep(0.01)
        assert (await client.delete("/v1/models/draft")).status_code == 200
        results = await asyncio.gather(*tasks)
        for r, text in zip(results, expected, strict=True):
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == text
        # A request that did not ask for the draft is served without it (the default hybrid
        # goes on with the host drafters)...
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert r.status_code == 200
        assert r.json()["stats"]["draft_model"] == "prompt_lookup+suffix"
        # ...one that asked for it is told why not.
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4,
                                                                     num_draft_tokens=2))
        assert r.status_code == 400


@pytest.mark.parametrize("source", ["hybrid", "model"])
@pytest.mark.parametrize("unload_after", [0, 20])
def test_a_row_whose_draft_is_unloaded_goes_on_without_it(tiny_pair, source, unload_after):
    """A hybrid row goes on by prompt lookup, a model row without drafting, with the same text;
    the stats name the draft model only if it drafted for the request."""
    kit = pair_kit(tiny_pair)  # its own: it unloads the draft
    name = kit.draft.name
    p = params(kit, 2, k=4, max_tokens=60)
    p = replace(p, speculation=replace(p.speculation, source=source))
    expected = alone(kit, replace(p, speculation=replace(p.speculation, num_draft_tokens=0)))
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16), SpeculationPolicy())
    events = []
    seq = scheduler.submit(p, events.append)
    while len(seq.output) < unload_after:
        scheduler.step()
    proposed_before = seq.counters.proposed
    assert (seq.counters.model_rounds > 0) == (unload_after > 0)
    kit.unload_draft()
    scheduler.draft_changed()
    while seq.phase is not Phase.DONE:
        scheduler.step()
    assert tokens_of(events) == expected
    stats = events[-1].stats
    if source == "hybrid":
        assert seq.drafter == "prompt_lookup" and seq.counters.proposed > proposed_before
        assert stats.draft_model == (f"prompt_lookup+{name}" if unload_after else "prompt_lookup")
        assert stats.num_draft_tokens == 4
    else:
        assert seq.drafter is None and seq.counters.proposed == proposed_before
        assert stats.draft_model == (name if unload_after else None)
        assert stats.num_draft_tokens == (4 if unload_after else 0)
    assert stats.draft_tokens_proposed == seq.counters.proposed


def test_penalties_see_the_prompt_with_and_without_a_draft(kit):
    """A prompt token that is the unpenalised argmax: penalised, every path must avoid it."""
    from mlx_lm.sample_utils import make_logits_processors

    model = kit.target.model
    base = list(kit.target.tokenizer.encode(TEXTS[0]))
    for extra in range(200):
        prompt = base + [extra + 5]
        logits = model(mx.array(prompt)[None])[0, -1]
        argmax = int(mx.argmax(logits).item())
        if argmax in prompt[-20:]:  # mlx_lm's repetition window
            break
    else:
        pytest.fail("no prompt whose next greedy token repeats a prompt token")
    processors = make_logits_processors(repetition_penalty=2.0)
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12,
                                                 logits_processors=processors)]
    assert expected[0] != argmax  # the penalty on the prompt changed the first token
    for k in (0, 1, 4):
        p = GenerationParams(tuple(prompt), 12, sampling=SamplingParams(repetition_penalty=2.0),
                             speculation=SpeculationParams(num_draft_tokens=k))
        assert alone(kit, p) == expected


def test_top_k_of_any_size_is_served(kit):
    vocab = kit.target.vocab_size
    for top_k in (1, vocab - 1, vocab, vocab + 10):
        p = params(kit, 0, k=4, max_tokens=5, temperature=0.8, top_k=top_k, seed=1)
        assert len(alone(kit, p)) == 5


def test_a_prompt_of_no_tokens_is_refused_before_it_can_fail_a_prefill_group(kit):
    """Every route refuses an empty prompt; the scheduler does too (a prefill of none would
    fail the whole group it is in), and the others run on."""
    from server.engine.errors import InvalidRequest

    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4, 1))
    with pytest.raises(InvalidRequest, match="no tokens"):
        scheduler.submit(replace(params(kit, 0), prompt_tokens=()), lambda e: None)
    good = params(kit, 1, max_tokens=4)
    events = []
    seq = scheduler.submit(good, events.append)
    while seq.phase is not Phase.DONE:
        scheduler.step()
    assert tokens_of(events) == alone(kit, good)


def test_forward_times_are_measured_only_while_no_request_waits_or_runs(tiny_pair, tmp_path,
                                                                       monkeypatch):
    """The cost model serves with a prior from the start; its measurement runs one step (one
    forward) at a time while the scheduler is idle, pauses while a request waits or runs (a
    request that arrives waits for one forward at most), resumes where it stopped, and swaps
    the measured tables in when they are complete."""
    kit = pair_kit(tiny_pair)
    scheduler = Scheduler(kit)
    scheduler.use_cost_model(tmp_path, budget_s=None)
    source = scheduler.cost_source
    prior = scheduler.costs
    assert prior.target == source.target.table and source.status()["target"] == "formula"
    steps = []
    step = source.step
    monkeypatch.setattr(source, "step", lambda: steps.append(source.target.levels) or step())
    assert scheduler.step() and len(steps) == 1  # idle: one forward of the measurement
    events = []
    seq = scheduler.submit(params(kit, 0, max_tokens=8), events.append)
    while seq.phase is not Phase.DONE:
        scheduler.step()
    assert len(steps) == 1 and scheduler.costs is prior  # nothing measured while it ran
    while scheduler.step():
        pass
    assert not source.pending and len(steps) > 2
    assert steps == sorted(steps)  # it went on where it stopped: never back to a level before
    assert scheduler.costs is not prior and scheduler.costs.target == source.target.table
    assert source.status()["target"] == source.status()["draft"] == "measured"
    assert not scheduler.step()  # nothing left: the loop sleeps again
