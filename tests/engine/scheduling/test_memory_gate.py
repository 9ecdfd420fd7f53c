"""Admission and preemption by memory (`memory_gate`, the scheduler's use of it): within a
budget the KV caches never outgrow it, requests wait or are paused instead, and every
request's greedy text is the one it gets alone."""

from __future__ import annotations

import pytest
from support.engine import alone, assert_same_or_near_tie, tokens_of

from server.engine.errors import MemoryBudgetExceeded
from server.engine.events import Finished
from server.engine.kv.kv_size import kv_layout
from server.engine.kv.prefix_cache import PrefixCache
from server.engine.memory import MemoryBudget, MemoryLimit
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.decoder import CATCH_UP_WIDTH
from server.engine.scheduling.memory_gate import (
    ADMISSION_GROWTH_TOKENS,
    MemoryGate,
    gate_for,
    prefill_transient,
)
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.policy import SpeculationPolicy

PROMPT_TOKENS = 40


def request(kit, i: int, max_tokens: int, k: int = 0) -> GenerationParams:
    """A greedy request of `PROMPT_TOKENS` distinct tokens that runs to `max_tokens`."""
    vocab = kit.target.vocab_size
    prompt = tuple((7 * i + 3 * j + 11) % (vocab - 10) + 5 for j in range(PROMPT_TOKENS))
    return GenerationParams(prompt, max_tokens, ignore_eos=True,
                            speculation=SpeculationParams(num_draft_tokens=k))


def gated(kit, budget_bytes: int, *, cache: PrefixCache | None = None) -> Scheduler:
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=64, idle_prefill_chunk=256),
                          SpeculationPolicy(4, 8, 4))
    scheduler.memory = MemoryGate(MemoryBudget(budget_bytes, None), kv_layout(kit.target.model),
                                  kv_layout(kit.draft.model))
    scheduler.prefix_cache = cache
    return scheduler


def run(scheduler: Scheduler, requests: list[GenerationParams]):
    """Step until every request is done; each one's events, and the most rows that ran at
    once. After every step the caches (running and prefix) must be within the budget."""
    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    most = 0
    budget = scheduler.memory.budget_bytes
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
        most = max(most, scheduler.batch_size)
        cached = scheduler.prefix_cache.info()["bytes"] if scheduler.prefix_cache else 0
        assert scheduler.kv_bytes() + cached <= budget, (scheduler.kv_bytes(), cached, budget)
    for e in events:
        assert isinstance(e[-1], Finished), e[-1]
    return events, most


def row_bytes(kit, tokens: int, rows: int = 1, draft: bool = False) -> int:
    need = kv_layout(kit.target.model).bytes(tokens, rows)
    return need + (kv_layout(kit.draft.model).bytes(tokens, rows) if draft else 0)


def test_requests_wait_for_memory_and_run_as_alone(kit):
    """Room for two rows with their growth: four requests run two at a time, none paused."""
    max_tokens = 30
    width = PROMPT_TOKENS + max_tokens + 1
    requests = [request(kit, i, max_tokens) for i in range(4)]
    scheduler = gated(kit, row_bytes(kit, width, rows=2))
    events, most = run(scheduler, requests)
    assert most == 2 and scheduler.preemptions == 0
    for p, e in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(e), alone(kit, p))


@pytest.mark.parametrize("k", [0, 3], ids=["no-draft", "draft-k3"])
@pytest.mark.parametrize("caching", [False, True], ids=["re-prefill", "prefix-cache"])
def test_rows_that_outgrow_the_budget_are_paused_and_resume_with_the_same_text(kit, k,
                                                                               caching):
    """Three rows are admitted with room to grow `ADMISSION_GROWTH_TOKENS`, then grow past
    it: the newest is paused (its KV released) and resumes once the two others end, from the
    prefix cache (which kept its context: the others ended before they needed that memory)
    or by prefilling its context again; every text is the one it gets alone."""
    lengths = [ADMISSION_GROWTH_TOKENS + 40, ADMISSION_GROWTH_TOKENS + 40,
               2 * ADMISSION_GROWTH_TOKENS + 100]
    grown = PROMPT_TOKENS + ADMISSION_GROWTH_TOKENS + 1 + k
    budget = row_bytes(kit, grown, rows=3, draft=k > 0)
    requests = [request(kit, i, n, k) for i, n in enumerate(lengths)]
    cache = PrefixCache(budget) if caching else None
    scheduler = gated(kit, budget, cache=cache)
    paused_at = []  # the context each paused row had
    scheduler.observer.on_preempted = lambda: paused_at.append(len(scheduler.paused[-1].context))
    events, _ = run(scheduler, requests)
    assert paused_at and not scheduler.paused
    for p, e in zip(requests, events, strict=True):
        got = tokens_of(e)
        assert len(got) == p.max_tokens
        assert_same_or_near_tie(kit, p, got, alone(kit, p))
    stats = [e[-1].stats for e in events]
    assert all(s.prompt_tokens == PROMPT_TOKENS and s.generation_tokens == n
               and s.cached_tokens == 0 for s, n in zip(stats, lengths, strict=True))
    if k:
        assert all(s.draft_tokens_proposed > 0 for s in stats)
    if caching:  # the resumed row found its context (prompt and output so far) in the cache,
        # the draft's at most a round behind (the entry holds what both models have)
        assert cache.hit_tokens >= paused_at[-1] - 1 - CATCH_UP_WIDTH


def test_the_newest_row_is_paused_first(kit):
    max_tokens = 2 * ADMISSION_GROWTH_TOKENS
    budget = row_bytes(kit, PROMPT_TOKENS + ADMISSION_GROWTH_TOKENS + 1, rows=2)
    scheduler = gated(kit, budget)
    paused = []
    scheduler.observer.on_preempted = lambda: paused.append(scheduler.paused[-1])
    requests = [request(kit, i, max_tokens) for i in range(2)]
    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    while not paused and seqs[1].phase is not Phase.DONE:
        scheduler.step()
    assert paused and paused[0] is seqs[1] and seqs[0].phase is Phase.DECODE
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    assert [len(tokens_of(e)) for e in events] == [max_tokens, max_tokens]


def test_a_request_that_could_never_fit_is_refused_naming_the_limit(kit):
    room_tokens = 300
    budget = kv_layout(kit.target.model).bytes(room_tokens)
    scheduler = gated(kit, budget)
    room = scheduler.memory.room()
    assert kv_layout(kit.target.model).bytes(room) <= budget < \
        kv_layout(kit.target.model).bytes(room + 1)
    with pytest.raises(MemoryBudgetExceeded) as refused:
        scheduler.submit(request(kit, 0, room - PROMPT_TOKENS + 1), lambda e: None)
    assert refused.value.param == "max_tokens"
    assert f"max_tokens may be at most {room - PROMPT_TOKENS}" in str(refused.value)
    assert f"{budget / 1e9:.3g} GB" in str(refused.value)
    with pytest.raises(MemoryBudgetExceeded) as refused:
        scheduler.submit(GenerationParams(tuple(range(5, room + 6)), 1), lambda e: None)
    assert refused.value.param == "prompt"
    assert scheduler.queue_depth == 0
    events, _ = run(scheduler, [request(kit, 0, room - PROMPT_TOKENS)])  # just fits: runs
    assert len(tokens_of(events[0])) == room - PROMPT_TOKENS


def test_the_prefix_cache_gives_way_to_running_rows(kit):
    """A cache allowed the whole budget holds only what the running rows leave of it."""
    max_tokens = 20
    budget = row_bytes(kit, PROMPT_TOKENS + max_tokens + 1, rows=2)
    cache = PrefixCache(budget)
    scheduler = gated(kit, budget, cache=cache)
    run(scheduler, [request(kit, i, max_tokens) for i in range(6)])  # `run` checks the sum
    assert cache.info()["entries"] >= 1


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "nemotron_h"])
def test_every_cache_kind_is_paused_and_resumed_within_the_budget(zoo, arch):
    """Sliding windows, recurrent states and layers of several caches (tiny models of mlx_lm's
    own architectures, drafting with their 2-layer drafts): the batch's caches stay within
    the budget their layouts price, and the paused row's text is its text alone."""
    from support.engine import pair_kit

    kit = pair_kit(zoo[arch])
    k = 3
    lengths = [ADMISSION_GROWTH_TOKENS + 40, ADMISSION_GROWTH_TOKENS + 40,
               2 * ADMISSION_GROWTH_TOKENS + 100]
    budget = row_bytes(kit, PROMPT_TOKENS + ADMISSION_GROWTH_TOKENS + 1 + k, rows=3, draft=True)
    requests = [request(kit, i, n, k) for i, n in enumerate(lengths)]
    scheduler = gated(kit, budget)
    events, _ = run(scheduler, requests)
    assert scheduler.preemptions >= 1
    for p, e in zip(requests, events, strict=True):
        assert_same_or_near_tie(kit, p, tokens_of(e), alone(kit, p))


def test_what_steps_allocate_beyond_the_margin_comes_off_a_derived_budget(kit):
    layout = kv_layout(kit.target.model)
    derived = MemoryGate(MemoryBudget(1000, MemoryLimit(2000, "physical memory"), 500, 100),
                         layout)
    configured = MemoryGate(MemoryBudget(1000, None), layout)
    for gate in (derived, configured):
        for transient in (50, 300, 200):  # the largest counts
            gate.observe(transient)
    assert derived.budget_bytes == 1000 - (300 - 100) and configured.budget_bytes == 1000
    assert derived.room() == layout.max_tokens(800)
    assert derived._source().endswith("3e-07 GB of margin")  # the 300 bytes seen


def test_a_derived_budget_shrinks_by_what_a_wave_allocates_for_a_moment(kit):
    """A real step's transient (its forwards' scores and activations) is seen by the gate."""
    scheduler = gated(kit, 10**9)
    scheduler.memory = MemoryGate(MemoryBudget(10**9, MemoryLimit(2 * 10**9, "test"), 0, 0),
                                  kv_layout(kit.target.model), kv_layout(kit.draft.model))
    run(scheduler, [request(kit, i, 8) for i in range(3)])
    assert 0 < scheduler.memory.transient_bytes < 10**9
    assert scheduler.memory.budget_bytes == 10**9 - scheduler.memory.transient_bytes


def test_a_cpu_gate_expects_a_prefill_chunks_transient_from_the_start(kit):
    """A layer's scores and softmax over twice the chunk, and its MLP's activations, in float32,
    before any step has run (the first wave's transient would come too late to count)."""
    args = kit.target.model.args
    chunk = 256
    expected = 4 * (2 * chunk * 2 * chunk * args.num_attention_heads
                    + 3 * chunk * args.intermediate_size)
    assert prefill_transient(kit.target.model, chunk) == expected
    budget = MemoryBudget(10**9, MemoryLimit(2 * 10**9, "test"), 0, 0)
    assert gate_for(kit, budget, chunk).budget_bytes == 10**9 - expected
