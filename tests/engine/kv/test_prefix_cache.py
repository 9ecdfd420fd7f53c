"""The prefix cache: a hit changes no output, only the work done; bounded; dropped on change."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from support.engine import run_to_end
from support.servers import served

from server.engine.events import TokenEvent
from server.engine.generation import generate_events
from server.engine.kv.prefix_cache import PrefixCache
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase

pytestmark = pytest.mark.anyio
SYSTEM = "You are a careful assistant. " * 12


def cached_scheduler(kit, budget=1 << 30) -> Scheduler:
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=32))
    scheduler.prefix_cache = PrefixCache(budget)
    return scheduler


def request(kit, text, *, k=0, max_tokens=16, **sampling):
    return GenerationParams(tuple(kit.target.tokenizer.encode(text)), max_tokens,
                            sampling=SamplingParams(**sampling),
                            speculation=SpeculationParams(num_draft_tokens=k))


def uncached(kit, p):
    return [e.token for e in generate_events(kit, p) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("k", [0, 1, 4])
def test_full_and_partial_hits_change_no_output(kit, k):
    scheduler = cached_scheduler(kit)
    first = request(kit, SYSTEM + "Question one?", k=k)
    tokens, stats = run_to_end(scheduler, first)
    assert stats.cached_tokens == 0 and tokens == uncached(kit, first)

    again, stats = run_to_end(scheduler, first)  # full hit: the prompt but its last token, less one
    # (mlx_lm's LRUPromptCache leaves one token to process when it trims a longer entry)
    assert again == tokens and stats.cached_tokens >= len(first.prompt_tokens) - 2

    other = request(kit, SYSTEM + "A different question, longer than the first?", k=k)
    out, stats = run_to_end(scheduler, other)  # partial hit: the shared system prompt
    assert out == uncached(kit, other)
    shared = len(kit.target.tokenizer.encode(SYSTEM))
    assert shared - 2 <= stats.cached_tokens < len(other.prompt_tokens) - 1


@pytest.mark.parametrize("k", [0, 4])
def test_a_prompt_longer_than_a_prefill_step_still_finds_its_prefix(kit, k):
    """A prompt that must be prefilled in chunks consults the prefix cache (and, drafting,
    gets the draft's cache) before its first chunk, like one that fits a step."""
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16, idle_prefill_chunk=16))
    scheduler.prefix_cache = PrefixCache(1 << 30)
    first = request(kit, SYSTEM + "Question one?", k=k)
    assert len(first.prompt_tokens) > 16
    tokens, stats = run_to_end(scheduler, first)
    assert stats.cached_tokens == 0 and tokens == uncached(kit, first)
    again, stats = run_to_end(scheduler, first)
    assert again == tokens and stats.cached_tokens >= len(first.prompt_tokens) - 2
    assert (stats.draft_tokens_proposed > 0) == (k > 0)


@pytest.mark.parametrize("k", [0, 4])
def test_next_turn_hits_the_whole_history_inside_the_chat_template(kit, k):
    tokenizer = kit.target.tokenizer
    scheduler = cached_scheduler(kit)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"}]
    turn1 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    p1 = GenerationParams(tuple(turn1), 12, speculation=SpeculationParams(num_draft_tokens=k))
    answer, _ = run_to_end(scheduler, p1)
    messages += [{"role": "assistant", "content": tokenizer.decode(answer)},
                 {"role": "user", "content": "And then?"}]
    turn2 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    p2 = GenerationParams(tuple(turn2), 12, speculation=SpeculationParams(num_draft_tokens=k))
    out, stats = run_to_end(scheduler, p2)
    assert out == uncached(kit, p2)
    common = next((i for i, (a, b) in enumerate(zip(turn1, turn2, strict=False)) if a != b),
                  len(turn1))
    assert stats.cached_tokens >= common - 1  # up to where the template's tail differs
    assert stats.cached_tokens >= len(turn1) - 8


@pytest.mark.parametrize("first_k, then_k", [(4, 0), (0, 4)])
def test_an_entry_serves_rows_that_draft_differently(kit, first_k, then_k):
    """A drafting row's entry (both models' caches) serves a row that does not draft; a plain
    row's (the target's alone) serves a row that would draft, which then starts without the
    draft (as a row does that joined a batch too large to draft). Outputs are those of no
    cache."""
    scheduler = cached_scheduler(kit)
    first = request(kit, SYSTEM + "Question one?", k=first_k)
    run_to_end(scheduler, first)
    then = request(kit, SYSTEM + "Question two, another one?", k=then_k)
    out, stats = run_to_end(scheduler, then)
    assert out == uncached(kit, then)
    shared = len(kit.target.tokenizer.encode(SYSTEM))
    assert stats.cached_tokens >= shared - 2
    again = request(kit, SYSTEM + "Question three?", k=then_k)
    _, stats = run_to_end(scheduler, again)  # now an entry like its own serves it (ties prefer it)
    assert stats.cached_tokens >= shared - 2
    assert (stats.draft_tokens_proposed > 0) == (then_k > 0)


def test_lookup_takes_the_longest_hit_of_its_keys_and_the_first_on_a_tie():
    from mlx_lm.models.cache import KVCache

    def entry(length):
        row = KVCache()
        row.update_and_fetch(mx.zeros((1, 1, length, 4)), mx.zeros((1, 1, length, 4)))
        return [[row]]

    cache = PrefixCache(max_bytes=1 << 30)
    cache.store(("t",), list(range(10)), entry(10))
    cache.store(("t", "d"), list(range(6)), entry(6))
    prompt = list(range(20))
    assert cache.lookup([("t", "d"), ("t",)], prompt)[1:] == (10, ("t",))
    cache.store(("t", "d"), list(range(10)), entry(10))
    assert cache.lookup([("t", "d"), ("t",)], prompt)[1:] == (10, ("t", "d"))
    assert cache.lookup([("t",), ("t", "d")], prompt)[1:] == (10, ("t",))
    assert cache.lookup([("x",)], prompt) == (None, 0, None)
    assert (cache.queried_tokens, cache.hit_tokens) == (80, 30)


@pytest.mark.parametrize("k", [0, 4])
def test_a_prompt_cancelled_part_way_leaves_what_it_prefilled(kit, k):
    """A client that times out during a long prefill and retries: the retry resumes where the
    first attempt stopped, and its output is that of no cache."""
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=16, idle_prefill_chunk=16))
    scheduler.prefix_cache = PrefixCache(1 << 30)
    p = request(kit, SYSTEM * 2 + "Long question?", k=k)
    seq = scheduler.submit(p, lambda event: None)
    while seq.prefilled < 48:
        scheduler.step()
    done = seq.prefilled
    assert done < len(p.prompt_tokens) - 16  # still part way
    scheduler.cancel(seq)
    scheduler.step()
    assert seq.phase is Phase.DONE
    out, stats = run_to_end(scheduler, p)
    assert out == uncached(kit, p)
    assert done - 1 <= stats.cached_tokens < len(p.prompt_tokens)


def test_seeded_sampling_equals_the_uncached_output(kit):
    scheduler = cached_scheduler(kit)
    p = request(kit, SYSTEM + "Tell me more", k=4, temperature=0.9, seed=3)
    first, _ = run_to_end(scheduler, p)
    second, stats = run_to_end(scheduler, p)
    assert stats.cached_tokens > 0
    assert first == second == uncached(kit, p)


def test_cache_prompt_false_skips_reuse(kit):
    scheduler = cached_scheduler(kit)
    p = request(kit, SYSTEM + "Q?")
    run_to_end(scheduler, p)
    from dataclasses import replace

    _, stats = run_to_end(scheduler, replace(p, cache_prompt=False))
    assert stats.cached_tokens == 0


def test_eviction_keeps_bytes_under_the_budget(kit):
    probe = cached_scheduler(kit)
    run_to_end(probe, request(kit, SYSTEM + "one"))
    one_entry = probe.prefix_cache.info()["bytes"]
    budget = int(one_entry * 2.5)
    scheduler = cached_scheduler(kit, budget)
    for i in range(6):
        run_to_end(scheduler, request(kit, f"Prompt number {i}: " + "words " * 40))
        assert scheduler.prefix_cache.info()["bytes"] <= budget
    assert 1 <= scheduler.prefix_cache.info()["entries"] < 6  # some were evicted


def test_the_cache_gives_way_to_the_running_requests_kv(kit):
    """The budget is shared: while a request runs, the cache keeps at most what its KV leaves
    (`mlx_lm.server` trims its prompt cache to its byte budget less its batch's)."""
    probe = cached_scheduler(kit)
    run_to_end(probe, request(kit, SYSTEM + "one"))
    one_entry = probe.prefix_cache.info()["bytes"]
    budget = int(one_entry * 1.5)
    scheduler = cached_scheduler(kit, budget)
    run_to_end(scheduler, request(kit, SYSTEM + "one"))
    assert scheduler.prefix_cache.info()["entries"] == 1 and scheduler.kv_bytes() == 0

    seq = scheduler.submit(request(kit, "A new prompt, nothing like the first one.",
                                   max_tokens=12), lambda event: None)
    evicted = False
    while seq.phase is not Phase.DONE:
        scheduler.step()
        running = scheduler.kv_bytes()
        cached = scheduler.prefix_cache.info()["bytes"]
        assert cached <= max(budget - running, 0), (cached, running, budget)
        evicted |= running > budget - one_entry
    assert evicted  # the running request's KV did not leave room for the first entry
    assert scheduler.kv_bytes() == 0 and scheduler.prefix_cache.info()["entries"] >= 1


def test_give_way_keeps_the_most_recent_entries_that_fit(kit):
    probe = cached_scheduler(kit)
    run_to_end(probe, request(kit, SYSTEM + "one"))
    size = probe.prefix_cache.info()["bytes"]
    scheduler = cached_scheduler(kit, budget=size * 10)
    for i in range(3):
        run_to_end(scheduler, request(kit, SYSTEM + f"Question {i}"))
    cache = scheduler.prefix_cache
    total = cache.info()["bytes"]
    cache.give_way(0)
    assert cache.info()["bytes"] == total  # nothing running: the whole budget is the cache's
    cache.give_way(size * 10 - total + 1)  # one byte short: the least recent entry goes
    assert cache.info()["entries"] == 2
    newest = request(kit, SYSTEM + "Question 2")
    _, stats = run_to_end(scheduler, newest)
    assert stats.cached_tokens >= len(newest.prompt_tokens) - 2  # the newest stayed: a full hit
    cache.give_way(size * 10)
    assert cache.info() | {"max_bytes": 0} == {"entries": 0, "bytes": 0, "max_bytes": 0,
                                                 "disk_entries": 0, "disk_bytes": 0,
                                                 "disk_max_bytes": 0}


def test_concurrent_requests_sharing_a_prefix_do_not_corrupt_each_other(kit):
    scheduler = cached_scheduler(kit)
    requests = [request(kit, SYSTEM + f"Question {i}?", k=4 if i % 2 else 0) for i in range(4)]
    events = [[] for _ in requests]
    seqs = [scheduler.submit(requests[0], events[0].append)]
    scheduler.step()  # the first is prefilled and decodes while the others arrive
    seqs += [scheduler.submit(p, events[i].append) for i, p in enumerate(requests) if i]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, ev in zip(requests, events, strict=True):
        assert [e.token for e in ev if isinstance(e, TokenEvent)] == uncached(kit, p)
    # The first request's prompt served the other plain one (entries of drafting requests
    # hold both models' caches: plain and drafting requests share none).
    assert seqs[2].cached_tokens > 0


async def test_http_usage_health_and_admin_clear(tiny_pair, padded_draft):
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "hello"}],
            "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    async with served(*tiny_pair, model_roots=[padded_draft.parent]) as (client, engine):
        await client.post("/v1/chat/completions", json={**body, "stream": False})
        r = await client.post("/v1/chat/completions", json={**body, "stream": False})
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == r.json()["stats"]["cached_tokens"] > 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as s:
            lines = [x async for x in s.aiter_lines() if x.startswith("data: {")]
        import json

        usage = json.loads(lines[-1][6:])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == cached
        health = (await client.get("/health")).json()
        assert health["cache_entries"] >= 1 and health["cache_bytes"] > 0
        metrics = (await client.get("/metrics")).text
        assert "mlx_spec_prefix_cache_hits_total" in metrics

        # Replacing the draft drops every entry.
        r = await client.post("/v1/models/draft", json={"model": str(padded_draft)})
        assert r.status_code == 200
        assert (await client.get("/health")).json()["cache_entries"] == 0
        await client.post("/v1/chat/completions", json={**body, "stream": False})
        r = await client.delete("/v1/cache")
        assert r.status_code == 200 and r.json()["entries"] >= 1
        assert (await client.get("/health")).json()["cache_bytes"] == 0
        await asyncio.sleep(0)


def test_a_stored_row_does_not_keep_its_batchs_buffers_alive():
    """Rows extracted from a batch are lazy slices of the whole batch's KV buffers; the cache
    must hold copies of their own, or every entry keeps a batch's worth of memory alive."""
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    gc.collect()
    before = mx.get_active_memory()
    batch = mx.random.normal((32, 4, 256, 64))  # 32 rows' keys (and values): 8 MB
    mx.eval(batch)
    row = KVCache()
    row.keys, row.values = mx.contiguous(batch[3:4]), mx.contiguous(batch[5:6])
    row.offset = 256
    cache = PrefixCache(max_bytes=1 << 30)
    cache.store(("target",), list(range(256)), [[row]])
    del batch, row
    gc.collect()
    held = mx.get_active_memory() - before
    assert held <= 2 * 4 * 256 * 64 * 4 * 1.5  # the two rows, not the 32 (8 MB)
    found, hit, _ = cache.lookup([("target",)], list(range(256)))
    assert hit == 256 and found is not None
