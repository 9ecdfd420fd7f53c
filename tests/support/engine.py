"""Drivers of the engine for the tests: a request run alone, requests run as one batch on a
`Scheduler` driven on the test's thread, their tokens, and the comparison that allows fp32
near-ties."""

from __future__ import annotations

import mlx.core as mx

from server.engine.events import Finished, TokenEvent
from server.engine.generation import generate_events
from server.engine.models.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.policy import SpeculationPolicy

TEXTS = [
    "def hello(world):\n    return",
    "import os\nclass Foo:",
    "x = 1\n" * 25,
    "Once upon a time",
    "for i in range(10):\n    print(i)\n" * 4,
    "a",
    "The quick brown fox jumps",
    "while True:\n    pass\n" * 3,
]


NEAR_TIE = 1e-4


def pair_kit(tiny_pair) -> ModelKit:
    """The tiny target with its draft loaded, as the server loads them."""
    kit = ModelKit(load_model(str(tiny_pair[0])))
    kit.load_draft(str(tiny_pair[1]))
    return kit


def params(kit, i: int, *, k: int = 0, max_tokens: int | None = None, **sampling):
    tokens = tuple(kit.target.tokenizer.encode(TEXTS[i % len(TEXTS)]))
    return GenerationParams(tokens, 20 + 3 * i if max_tokens is None else max_tokens,
                            sampling=SamplingParams(**sampling),
                            speculation=SpeculationParams(num_draft_tokens=k))


def alone(kit, p: GenerationParams) -> list[int]:
    return [e.token for e in generate_events(kit, p) if isinstance(e, TokenEvent)]


def run_batch(kit, requests, *, spec_max_batch=8, prefill_chunk=16, cancel_after=None,
              batch_draft_tokens=4):
    """Run `requests` concurrently; returns each one's events. Rows draft up to 4 tokens in a
    batch unless told otherwise (the default policy's 1 would hide ragged acceptance)."""
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=prefill_chunk),
                          SpeculationPolicy(4, spec_max_batch, batch_draft_tokens))
    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
        for i, n in (cancel_after or {}).items():
            if len(seqs[i].output) >= n:
                scheduler.cancel(seqs[i])
    return events, seqs


def tokens_of(events) -> list[int]:
    return [e.token for e in events if isinstance(e, TokenEvent)]


def assert_same_or_near_tie(kit, p: GenerationParams, got: list[int], expected: list[int],
                            near_tie: float = NEAR_TIE):
    """Equal, or the first difference is a near-tie of the target's logits (fp32 batching)."""
    if got == expected:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b)
    context = mx.array(list(p.prompt_tokens) + expected[:j])
    logits = kit.target.model(context[None])[0, -1]
    gap = (logits[expected[j]] - logits[got[j]]).item()
    assert abs(gap) < near_tie, f"token {j} differs with a logit gap of {gap}"


def run_to_end(scheduler: Scheduler, p: GenerationParams):
    """Submit `p` alone and step `scheduler` until it is done: (its tokens, its stats)."""
    events = []
    seq = scheduler.submit(p, events.append)
    while seq.phase is not Phase.DONE:
        scheduler.step()
    assert isinstance(events[-1], Finished), events[-1]
    return tokens_of(events), events[-1].stats
