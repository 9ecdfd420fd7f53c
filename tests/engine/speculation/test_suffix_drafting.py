"""Suffix drafting through the engine: a repeated request drafts the first one's answer and is
mlx_lm's text token for token; hybrid drafts it by suffix; tenants, `cache_prompt: false`
and a new target keep texts out of the index."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from support.engine import TEXTS, pair_kit, run_to_end

from server.engine.events import Finished, TokenEvent
from server.engine.generation import generate_events
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerObserver
from server.engine.speculation.policy import LOOKUP_DRAFT_TOKENS, SpeculationPolicy
from server.engine.speculation.suffix import PROMPT_TAIL, SuffixIndex

MAX_TOKENS = 60
PROMPT = TEXTS[3]  # its greedy answer repeats nothing of itself for ~60 tokens


@pytest.fixture(scope="module")
def kit(tiny_pair):
    return pair_kit(tiny_pair)


@pytest.fixture(scope="module")
def reference(loaded_pair, kit):
    """mlx_lm's greedy answer to PROMPT, without a draft."""
    model = loaded_pair[0]
    prompt = mx.array(kit.target.tokenizer.encode(PROMPT))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=MAX_TOKENS)]


def request(kit, source="suffix", k=4, **fields) -> GenerationParams:
    spec = SpeculationParams(num_draft_tokens=k, source=source,
                             lookup_draft_tokens=LOOKUP_DRAFT_TOKENS if k else 0)
    return GenerationParams(tuple(kit.target.tokenizer.encode(PROMPT)), MAX_TOKENS,
                            speculation=spec, ignore_eos=True, **fields)


def generate(kit, params, index):
    """(tokens, from_draft flags, stats) of one request through the engine's whole path."""
    events = list(generate_events(kit, params, suffix=index))
    assert isinstance(events[-1], Finished)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return [e.token for e in tokens], [e.from_draft for e in tokens], events[-1].stats


def test_a_repeated_request_drafts_the_first_answer(kit, reference):
    """The first time (plain decoding) the answer goes to the index; the second time suffix
    drafting drafts it: mlx_lm's text, nearly every token from the draft, in few rounds."""
    index = SuffixIndex(10**7)
    first, _, _ = generate(kit, request(kit, k=0), index)
    assert first == reference and len(index) == 1 and index.tokens == len(
        kit.target.tokenizer.encode(PROMPT)[-PROMPT_TAIL:]) + MAX_TOKENS
    alone, _, own = generate(kit, request(kit), SuffixIndex(10**7))  # its own text only
    tokens, flags, stats = generate(kit, request(kit), index)
    assert alone == tokens == reference
    assert stats.draft_model == "suffix" and sum(flags) == stats.draft_tokens_accepted
    assert stats.draft_tokens_accepted >= 0.9 * (MAX_TOKENS - 1)
    assert sum(stats.k_histogram.values()) <= MAX_TOKENS // 4
    assert own.draft_tokens_accepted < 0.5 * stats.draft_tokens_accepted


class DrafterCounts(SchedulerObserver):
    def __init__(self):
        self.accepted = {}

    def on_round(self, batch_size, results):
        for r in results.values():
            if r.drafter:
                self.accepted[r.drafter] = self.accepted.get(r.drafter, 0) + r.accepted


def test_hybrid_drafts_a_repeat_by_suffix(kit, reference):
    """A hybrid request (the draft model, prompt lookup and suffix drafting) repeated: its
    rounds draft by suffix, and the stats name all three."""
    counts = DrafterCounts()
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(), counts)
    scheduler.suffix_index = SuffixIndex(10**7)
    run_to_end(scheduler, request(kit, source="hybrid"))
    counts.accepted.clear()
    tokens, stats = run_to_end(scheduler, request(kit, source="hybrid"))
    assert tokens == reference
    assert stats.draft_model == f"prompt_lookup+suffix+{kit.draft.name}"
    assert counts.accepted["suffix"] >= 0.8 * MAX_TOKENS
    assert stats.draft_tokens_accepted == sum(counts.accepted.values())


def test_one_tenants_answer_never_drafts_anothers(kit, reference):
    """Tenant b's repeat of tenant a's request drafts exactly as a first request does (its own
    text only), while a's own repeat drafts nearly all of it."""
    index = SuffixIndex(10**7)
    _, first_flags, _ = generate(kit, request(kit, tenant="a"), index)
    tokens, flags, _ = generate(kit, request(kit, tenant="b"), index)
    assert tokens == reference and flags == first_flags
    _, again, _ = generate(kit, request(kit, tenant="a"), index)
    assert sum(again) > 2 * sum(flags)


def test_answers_kept_out_of_the_index(kit):
    """`cache_prompt: false` keeps its text out; a new target empties the index; a new draft
    does not (the answers are the target's)."""
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy())
    index = scheduler.suffix_index = SuffixIndex(10**7)
    run_to_end(scheduler, request(kit, cache_prompt=False))
    assert len(index) == 0
    run_to_end(scheduler, request(kit))
    assert len(index) == 1
    scheduler.draft_changed()
    assert len(index) == 1
    scheduler.target_changed()
    assert len(index) == 0 and scheduler.suffix_index is index


def test_a_cancelled_answer_drafts_its_retry(kit, reference):
    """A client that gave up (a timeout) retries: what it was sent drafts the retry."""
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy())
    index = scheduler.suffix_index = SuffixIndex(10**7)
    events = []
    seq = scheduler.submit(request(kit, k=0), events.append)
    while len(seq.output) < 30:
        scheduler.step()
    scheduler.cancel(seq)
    scheduler.step()
    assert len(index) == 1
    tokens, stats = run_to_end(scheduler, request(kit))
    assert tokens == reference and stats.draft_tokens_accepted >= 25


@pytest.mark.parametrize("source", ["suffix", "hybrid"])
def test_a_seeded_sampled_request_drafts_from_its_own_text_only(kit, source):
    """Its drafts decide how its randomness is drawn, so other requests' answers (and the
    engine's acceptance figures) never draft for it: the same seed gives the same text whatever
    the index holds."""
    from server.engine.params import SamplingParams

    sampled = replace(request(kit, source=source),
                      sampling=SamplingParams(temperature=1.0, seed=3))
    texts = []
    for served in (False, True):
        index = SuffixIndex(10**7)
        if served:
            for seed in range(4):  # answers to the same prompt: what a repeat would draft
                generate(kit, replace(sampled, sampling=SamplingParams(1.0, seed=seed)), index)
        texts.append(generate(kit, sampled, index)[0])
    assert texts[0] == texts[1]
