"""Our speculative generator against mlx_lm, and speculative sampling against the target's law."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.generate import speculative_generate_step as mlx_speculative_generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from scipy.stats import chisquare

from server.engine.events import Finished, TokenEvent
from server.engine.generation import generate_events
from server.engine.models.model_kit import LoadedModel, ModelKit
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.engine.scheduling import decoder
from server.engine.scheduling.sampling import LogitsPipeline
from server.engine.speculation import verification
from server.engine.speculation.candidates import best_candidate
from server.engine.speculation.drafting import DraftSchedule
from server.engine.speculation.verification import count_exact_matches, verify_rejection
from server.model_files.synthetic import Preset, model_config, random_target

PROMPTS = ("def hello(world):\n    return", "import os\nclass Foo:")
MAX_TOKENS = 32
NUM_SAMPLES = 20_000

MODES = {
    "exact": dict(acceptance="exact", adaptive=False),
    "rejection": dict(acceptance="rejection", adaptive=False),
    "exact-adaptive": dict(acceptance="exact", adaptive=True),
    # The tiny draft's top probability hovers around 0.01: this stops some drafts early.
    "rejection-adaptive-p-min": dict(acceptance="rejection", adaptive=True, draft_p_min=0.009),
    "prompt-lookup": dict(source="prompt_lookup", acceptance="rejection", adaptive=False),
    "prompt-lookup-adaptive": dict(source="prompt_lookup", acceptance="exact", adaptive=True),
    "hybrid": dict(source="hybrid", acceptance="rejection", adaptive=False),
    "hybrid-adaptive": dict(source="hybrid", acceptance="exact", adaptive=True),
}


# --- helpers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(loaded_pair):
    target, tokenizer, draft = loaded_pair
    TOKENIZER.append(tokenizer)
    prompts = [mx.array(tokenizer.encode(text)) for text in PROMPTS]
    return target, draft, tokenizer.vocab_size, prompts


TOKENIZER: list = []  # the pair's tokenizer, set by the `pair` fixture


@pytest.fixture(scope="module")
def references(pair):
    """mlx_lm's greedy output without a draft, per prompt."""
    target, _, _, prompts = pair
    return [greedy_reference(target, prompt, MAX_TOKENS) for prompt in prompts]


def greedy_reference(model, prompt, max_tokens, **kwargs) -> list[int]:
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=max_tokens, **kwargs)]


def kit_of(target, draft) -> ModelKit:
    tokenizer = TOKENIZER[-1]
    kit = ModelKit(LoadedModel("target", "target", target, tokenizer, {}))
    if draft is not None:
        kit.draft = LoadedModel("draft", "draft", draft, tokenizer, {})
    return kit


def run_events(model, draft, prompt, *, max_tokens=MAX_TOKENS, sampling=None, logprobs=0,
               **spec):
    """Our engine's whole path (scheduler, prefill, batched decoder) for one request."""
    params = GenerationParams(
        tuple(prompt.tolist()), max_tokens, sampling=sampling or SamplingParams(),
        speculation=SpeculationParams(**spec), logprobs=bool(logprobs), top_logprobs=logprobs,
    )
    events = list(generate_events(kit_of(model, draft), params))
    assert isinstance(events[-1], Finished)
    return [e for e in events if isinstance(e, TokenEvent)], events[-1].stats


def run(model, draft, prompt, *, vocab_size=None, **kwargs):
    events, stats = run_events(model, draft, prompt, **kwargs)
    flags = [e.from_draft for e in events]
    assert 0 <= stats.draft_tokens_accepted <= stats.draft_tokens_proposed
    assert sum(flags) == stats.draft_tokens_accepted
    histogram = stats.k_histogram or {}
    assert stats.draft_tokens_proposed == sum(k * c for k, c in histogram.items())
    return [e.token for e in events], flags, stats


def drafter_for(spec: dict, draft_model):
    return None if spec.get("source") == "prompt_lookup" else draft_model


# --- greedy: token for token what mlx_lm produces without a draft ---------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_output_equals_mlx_lm_without_draft(pair, references, mode, k):
    target, draft, vocab, prompts = pair
    spec = MODES[mode]
    for prompt, expected in zip(prompts, references, strict=True):
        tokens, flags, counters = run(
            target, drafter_for(spec, draft), prompt, vocab_size=vocab, num_draft_tokens=k, **spec
        )
        assert tokens == expected
        assert max(counters.k_histogram or {0: 0}) <= k


def test_greedy_with_a_padded_draft_vocabulary(pair, references, padded_draft):
    target, _, vocab, prompts = pair
    draft, _ = load(str(padded_draft))
    assert draft.args.vocab_size > vocab
    for prompt, expected in zip(prompts, references, strict=True):
        tokens, _, counters = run(target, draft, prompt, vocab_size=vocab, num_draft_tokens=4)
        assert tokens == expected
        assert counters.draft_tokens_accepted > 0


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("sizes", [{}, {"repetition_context_size": 3,
                                        "frequency_context_size": 50}], ids=["20", "3-50"])
def test_greedy_with_logits_processors_equals_mlx_lm(pair, k, sizes):
    """Penalties see prompt + output with and without a draft (mlx_lm's rule), over the last
    context-size tokens."""
    target, draft, vocab, prompts = pair
    processors = make_logits_processors(repetition_penalty=1.3, logit_bias={7: 2.0},
                                        frequency_penalty=0.5, **sizes)
    sampling = SamplingParams(repetition_penalty=1.3, logit_bias=((7, 2.0),),
                              frequency_penalty=0.5, **sizes)
    for prompt in prompts:
        expected = greedy_reference(target, prompt, 24, logits_processors=processors)
        tokens, _, _ = run(target, draft, prompt, max_tokens=24, sampling=sampling,
                           num_draft_tokens=k)
        assert tokens == expected


@pytest.mark.parametrize("k", [2, 4])
def test_target_as_its_own_draft_accepts_every_draft_like_mlx_lm(pair, k):
    target, _, vocab, prompts = pair
    for acceptance in ("exact", "rejection"):
        tokens, flags, counters = run(
            target,
            target,
            prompts[0],
            vocab_size=vocab,
            num_draft_tokens=k,
            acceptance=acceptance,
            adaptive=False,
        )
        theirs = list(
            mlx_speculative_generate_step(
                prompts[0], target, target, num_draft_tokens=k, max_tokens=MAX_TOKENS
            )
        )
        assert tokens == [int(t) for t, _, _ in theirs]
        # Every draft accepted: rounds of k drafts and the target's bonus token. Our first token
        # comes from the prefill's logits (mlx_lm's speculative loop drafts it), so our rounds
        # start one token later than theirs.
        assert flags == ([False] + ([True] * k + [False]) * MAX_TOKENS)[:MAX_TOKENS]
        assert [f for _, _, f in theirs] == (([True] * k + [False]) * MAX_TOKENS)[:MAX_TOKENS]
        assert counters.draft_tokens_accepted == counters.draft_tokens_proposed > 0


@pytest.mark.parametrize("k", [0, 4])
def test_logprobs_are_the_targets_as_mlx_lm_yields_them(pair, k):
    target, draft, vocab, prompts = pair
    steps = list(generate_step(prompts[0], target, max_tokens=12))
    events, _ = run_events(target, draft, prompts[0], max_tokens=12, logprobs=5,
                           num_draft_tokens=k)
    for event, (token, reference) in zip(events, steps, strict=True):
        assert event.token == int(token)
        assert abs(event.logprob - reference[event.token].item()) < 1e-4
        top = mx.argsort(-reference)[:5].tolist()
        assert [t for t, _ in event.top_logprobs] == top
        for t, lp in event.top_logprobs:
            assert abs(lp - reference[t].item()) < 1e-4


# --- max_tokens, early close, caches -------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 5, 7])
def test_never_yields_more_than_max_tokens(pair, references, max_tokens):
    target, draft, vocab, prompts = pair
    for spec in (MODES["exact"], MODES["prompt-lookup"]):
        tokens, _, _ = run(
            target,
            drafter_for(spec, draft),
            prompts[1],
            vocab_size=vocab,
            max_tokens=max_tokens,
            num_draft_tokens=4,
            **spec,
        )
        assert tokens == references[1][:max_tokens]


# --- drafting policy ------------------------------------------------------------------------


def test_adaptive_schedule_grows_after_full_acceptance_and_shrinks_after_rejection():
    schedule = DraftSchedule(SpeculationParams(num_draft_tokens=8, adaptive=True))
    assert schedule.next(100) == 8 and schedule.next(3) == 3
    schedule.update(requested=8, proposed=8, accepted=8)
    assert schedule.k == 8  # bounded by num_draft_tokens
    schedule.update(requested=8, proposed=8, accepted=1)  # early rejection: halve
    assert schedule.k == 4
    schedule.update(requested=4, proposed=4, accepted=3)  # late rejection: one fewer
    assert schedule.k == 3
    schedule.update(requested=3, proposed=3, accepted=3)
    assert schedule.k == 4
    schedule.update(requested=4, proposed=2, accepted=2)  # draft stopped itself: keep
    assert schedule.k == 4
    for _ in range(5):
        schedule.update(requested=schedule.k, proposed=schedule.k, accepted=0)
    assert schedule.k == 1  # never below one

    fixed = DraftSchedule(SpeculationParams(num_draft_tokens=5, adaptive=False))
    fixed.update(requested=5, proposed=5, accepted=0)
    assert fixed.next(100) == 5


def test_adaptive_length_runs_within_bounds(pair, references):
    target, draft, vocab, prompts = pair
    tokens, _, counters = run(
        target, draft, prompts[0], vocab_size=vocab, num_draft_tokens=6
    )
    assert tokens == references[0]
    assert set(counters.k_histogram) <= set(range(1, 7))


def test_draft_stops_below_draft_p_min(pair, references):
    target, draft, vocab, prompts = pair
    tokens, _, counters = run(
        target,
        draft,
        prompts[0],
        vocab_size=vocab,
        num_draft_tokens=4,
        max_tokens=16,
        draft_p_min=1.01,  # no probability reaches it: never draft
    )
    assert tokens == references[0][:16]
    assert counters.draft_tokens_proposed == 0 and set(counters.k_histogram) == {0}

    fixed_tokens, _, fixed = run(
        target,
        draft,
        prompts[0],
        vocab_size=vocab,
        num_draft_tokens=4,
        max_tokens=16,
        draft_p_min=1.01,
        adaptive=False,  # a fixed k is cut by draft_p_min alike
    )
    assert fixed_tokens == references[0][:16]
    assert fixed.draft_tokens_proposed == 0 and set(fixed.k_histogram) == {0}


@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_stops_at_the_first_token_it_is_not_confident_about(pair, monkeypatch, adaptive):
    target, draft, vocab, prompts = pair
    # The first token comes from the prefill; the first draft follows it.
    first = greedy_reference(target, prompts[1], 1)
    context = mx.concatenate([prompts[1], mx.array(first, mx.uint32)])
    steps = list(generate_step(context, draft, max_tokens=8))  # the draft's own greedy run
    tops = [mx.exp(logprobs.max()).item() for _, logprobs in steps]
    stop = next(j for j in range(1, 8) if tops[j] < min(tops[:j]))
    p_min = (min(tops[:stop]) + tops[stop]) / 2
    proposals, runs = [], []
    real = decoder._draft_with_model

    def spy(batch, ks):
        result = real(batch, ks)
        proposals.append(next(iter(result[0].values())))
        runs.append(result[1])
        return result

    monkeypatch.setattr(decoder, "_draft_with_model", spy)
    run(target, draft, prompts[1], max_tokens=12, num_draft_tokens=8, draft_p_min=p_min,
        adaptive=adaptive)
    assert proposals[0].tokens == [int(t) for t, _ in steps[:stop]]
    # ... and drafts no further than that token: stop + 1 draft steps of the 8 it could take
    assert runs[0] == stop + 1


def test_prompt_lookup_drafts_the_continuation_the_prompt_contains(pair):
    target, _, vocab, prompts = pair
    # The tiny model's greedy output for this prompt settles into a cycle; a prompt that
    # already holds a few periods of it makes every lookup a correct guess.
    cycle = greedy_reference(target, prompts[1], 80)
    prompt = mx.concatenate([prompts[1], mx.array(cycle, mx.uint32)])
    expected = greedy_reference(target, prompt, 20)
    tokens, flags, counters = run(
        target,
        None,
        prompt,
        vocab_size=vocab,
        max_tokens=20,
        num_draft_tokens=4,
        source="prompt_lookup",
        adaptive=False,
    )
    assert tokens == expected
    assert 0 < counters.draft_tokens_accepted == counters.draft_tokens_proposed
    assert flags[:5] == [False] + [True] * 4  # the first token comes from the prefill


def test_prompt_lookup_without_a_match_drafts_nothing(pair):
    target, _, vocab, _ = pair
    prompt = mx.array([10, 11, 12, 13, 14])
    _, flags, counters = run(
        target,
        None,
        prompt,
        vocab_size=vocab,
        max_tokens=2,
        num_draft_tokens=4,
        source="prompt_lookup",
    )
    assert flags == [False, False]
    assert counters.draft_tokens_proposed == 0 and dict(counters.k_histogram) == {0: 1}


@pytest.fixture
def drafting_rounds(monkeypatch):
    """(context, drafter) of every round that drafted, as the decoder runs them."""
    rounds = []
    real_lookup, real_model = decoder._lookup, decoder._draft_with_model

    def lookup(seq, k):
        rounds.append((list(seq.context), "prompt_lookup"))
        return real_lookup(seq, k)

    def with_model(batch, ks):
        rounds.extend((list(r.context), "model") for r in batch.rows if ks.get(id(r)))
        return real_model(batch, ks)

    monkeypatch.setattr(decoder, "_lookup", lookup)
    monkeypatch.setattr(decoder, "_draft_with_model", with_model)
    return rounds


def run_hybrid(pair, **spec) -> None:
    """A hybrid request whose output repeats nothing for a while, then settles into a cycle
    (the tiny model's greedy output does): both drafters get rounds. Greedy: mlx_lm's output."""
    target, draft, _, prompts = pair
    tokens, _, _ = run(target, draft, prompts[1], max_tokens=80, source="hybrid", **spec)
    assert tokens == greedy_reference(target, prompts[1], 80)


@pytest.fixture
def hybrid_offers(monkeypatch):
    """(context, offers, chosen drafter) of every hybrid round that chose among drafters."""
    from server.engine.scheduling.sequence import Sequence

    seen = []
    real = Sequence._candidates

    def candidates(self, rates):
        offers = real(self, rates)
        seen.append((list(self.context), offers, self))
        return offers

    monkeypatch.setattr(Sequence, "_candidates", candidates)
    return seen


@pytest.mark.parametrize("min_match", [1, 2])
def test_hybrid_drafts_with_the_candidate_expected_to_gain_most(pair, drafting_rounds,
                                                                  hybrid_offers, min_match):
    """Each round, prompt lookup offers a draft exactly where the context's last
    `hybrid_min_match` tokens occurred earlier in it, the draft model always; the round drafts
    with the offer `best_candidate` picks (the most expected accepted tokens), and the decoder
    drafts with that drafter."""
    run_hybrid(pair, num_draft_tokens=3, adaptive=False, hybrid_min_match=min_match)
    assert len(hybrid_offers) == len(drafting_rounds) > 0
    for (context, offers, _), (drafted_context, drafter) in zip(
            hybrid_offers, drafting_rounds, strict=True):
        assert drafted_context == context
        tail = context[-min_match:]
        before = any(context[i: i + min_match] == tail for i in range(len(context) - min_match))
        by_source = {o.source: o for o in offers}
        assert bool(by_source["prompt_lookup"].tokens) == before
        assert by_source["model"].forwards == 3 and len(by_source["model"].confidence) == 3
        assert drafter == best_candidate(offers).source


def old_rule(monkeypatch):
    """Hybrid's choice before candidates were weighed: prompt lookup wherever it found a
    match, the draft model elsewhere (for tests of what each drafter's rounds do)."""
    from server.engine.scheduling import sequence

    def lookup_first(offers, forward_cost=0.0):
        return next((o for o in offers if o.source == "prompt_lookup" and o.tokens),
                    next(o for o in offers if o.source == "model"))

    monkeypatch.setattr(sequence, "best_candidate", lookup_first)


def test_hybrid_keeps_one_adaptive_k_per_drafter(pair, drafting_rounds, monkeypatch):
    """Each drafter's rounds ask for the k its own schedule holds, moved only by its rounds:
    with every lookup draft's last token made wrong, the lookup k shrinks round by round while
    the draft model, which the tiny pair accepts in full here, keeps k = 4."""
    vocab = pair[2]
    updates = []  # (schedule, its k, k the round asked for), in round order
    real_update, spied_lookup = DraftSchedule.update, decoder._lookup

    def update(self, requested, proposed, accepted):
        updates.append((id(self), self.k, requested))
        real_update(self, requested, proposed, accepted)

    def wrong_last(seq, k):
        proposal = spied_lookup(seq, k)
        if proposal.tokens:
            proposal.tokens[-1] = (proposal.tokens[-1] + 1) % vocab
        return proposal

    monkeypatch.setattr(DraftSchedule, "update", update)
    monkeypatch.setattr(decoder, "_lookup", wrong_last)
    old_rule(monkeypatch)  # lookup keeps its rounds however it does
    run_hybrid(pair, num_draft_tokens=4, adaptive=True)
    assert len(updates) == len(drafting_rounds)
    ks = {"model": [], "prompt_lookup": []}
    owner = {}
    for i, ((schedule, k, requested), (_, drafter)) in enumerate(
            zip(updates, drafting_rounds, strict=True)):
        assert owner.setdefault(drafter, schedule) == schedule
        # (only the last rounds may ask for fewer: what max_tokens leaves)
        assert requested == k or requested < k and i >= len(updates) - 3
        ks[drafter].append(k)
    assert set(ks["model"]) == {4}
    assert ks["prompt_lookup"][:4] == [4, 3, 2, 1]


# --- temperature > 0 ------------------------------------------------------------------------


def test_rejection_sampling_accepts_more_than_exact_matching(pair):
    target, draft, vocab, prompts = pair
    rates = {}
    for acceptance in ("exact", "rejection"):
        proposed = accepted = 0
        for prompt in prompts:
            for seed in (0, 1):
                _, _, counters = run(
                    target,
                    draft,
                    prompt,
                    vocab_size=vocab,
                    max_tokens=16,
                    sampling=SamplingParams(temperature=0.8, seed=seed),
                    num_draft_tokens=4,
                    acceptance=acceptance,
                    adaptive=False,
                )
                proposed += counters.draft_tokens_proposed
                accepted += counters.draft_tokens_accepted
        rates[acceptance] = accepted / proposed
    assert rates["rejection"] > rates["exact"] + 0.05, rates


@pytest.mark.parametrize("padded", [False, True], ids=["same-vocab", "padded-draft"])
def test_verification_gets_the_target_and_draft_distributions_of_each_position(
    pair, padded_draft, monkeypatch, padded
):
    """Every round's p and q rows equal a fresh, cache-free forward pass of both models."""
    target, draft, vocab, prompts = pair
    if padded:
        draft, _ = load(str(padded_draft))
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=0.95)
    pipeline = LogitsPipeline(sampling, vocab)
    rounds = []

    def spy(p, q, d, key=None):
        result = verify_rejection(p, q, d, key)
        rounds.append((p, q, d, result[0]))
        return result

    monkeypatch.setattr(decoder, "verify_rejection", spy)
    tokens, _, _ = run(
        target,
        draft,
        prompts[0],
        vocab_size=vocab,
        max_tokens=16,
        sampling=SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=3),
        num_draft_tokens=3,
    )

    def probs(model, sequence, rows):
        logits = model(sequence[None])[0, -rows:]
        return pipeline.probs(pipeline.scaled(pipeline.process(logits)))

    context = prompts[0].tolist()
    for p, q, d, n in rounds:
        k = d.size
        sequence = mx.array(context + d.tolist())
        assert mx.allclose(p, probs(target, sequence, k + 1), atol=1e-4).item()
        if k:
            assert mx.allclose(q, probs(draft, sequence[:-1], k), atol=1e-4).item()
        context += tokens[len(context) - prompts[0].size :][: n.item() + 1]
    assert len(context) - prompts[0].size == len(tokens)


# --- distributions: the production verification, batched over many samples --------------------

SMALL = Preset(16, 32, 2, 2, 1, 64, 1, 0)
SMALL_PROMPT = [1, 5, 7, 3]


@pytest.fixture(scope="module")
def small_pair():
    """A 16-token target and an unrelated 1-layer draft: their distributions differ a lot."""
    target = random_target(model_config(SMALL, num_layers=2, vocab_size=16, eos_id=0), 0, 1)
    draft = random_target(model_config(SMALL, num_layers=1, vocab_size=16, eos_id=0), 1, 1)
    return target, draft


def scaled_tables(model, pipeline: LogitsPipeline):
    """The sampler's scaled logits after the prompt, after prompt+x, after prompt+x+y."""
    v, length = pipeline.vocab_size, len(SMALL_PROMPT)
    pairs = mx.array([[x, y] for x in range(v) for y in range(v)])
    sequences = mx.concatenate([mx.broadcast_to(mx.array(SMALL_PROMPT), (v * v, length)), pairs], 1)
    logits = model(sequences)

    def scaled(rows):
        return pipeline.scaled(pipeline.process(rows))

    return (
        scaled(logits[:1, length - 1])[0],
        scaled(logits[::v, length]),
        scaled(logits[:, length + 1]).reshape(v, v, v),
    )


def chi_square_p(samples: mx.array, probs: mx.array) -> float:
    """Goodness of fit of `samples` to `probs`; categories expected < 5 times are pooled."""
    probs = np.asarray(probs, dtype=np.float64)
    probs /= probs.sum()
    counts = np.bincount(np.asarray(samples), minlength=probs.size)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the target's support"
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    return chisquare(observed[keep], expected[keep]).pvalue


def simulate_two_tokens(target, draft, sampling: SamplingParams, k: int = 2):
    """NUM_SAMPLES independent generations of two tokens with a k-token draft (k <= 2).

    Round one drafts from the draft model's tables and verifies with `verify_rejection`; where
    it yields only one token, round two drafts one token after it and verifies again.
    """
    pipeline = LogitsPipeline(sampling, SMALL.vocab_size)
    p0, p1, p2 = (pipeline.probs(t) for t in scaled_tables(target, pipeline))
    s0, s1, _ = scaled_tables(draft, pipeline)
    q0, q1 = pipeline.probs(s0), pipeline.probs(s1)
    b = NUM_SAMPLES
    d1 = pipeline.sample(mx.broadcast_to(s0, (b, s0.size)))
    d2 = pipeline.sample(s1[d1])
    drafts = mx.stack([d1, d2], axis=1)[:, :k]
    p = mx.stack([mx.broadcast_to(p0, (b, p0.size)), p1[d1], p2[d1, d2]], axis=1)[:, : k + 1]
    q = mx.stack([mx.broadcast_to(q0, (b, q0.size)), q1[d1]], axis=1)[:, :k]
    n, out = verify_rejection(p, q, drafts)
    first = out[:, 0]

    e1 = pipeline.sample(s1[first])  # round two, after the first token
    n2, out2 = verify_rejection(
        mx.stack([p1[first], p2[first, e1]], axis=1), q1[first][:, None], e1[:, None]
    )
    second = mx.where(n >= 1, out[:, 1], out2[:, 0]) if k >= 1 else out2[:, 0]
    return first, second, p0, p0 @ p1


XTC = SamplingParams(temperature=0.8, top_k=10, xtc_probability=0.5, xtc_threshold=0.02,
                     xtc_special_tokens=(3,))


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10, top_p=0.9), XTC],
    ids=["plain", "top-k-top-p", "xtc"],
)
def test_rejection_sampling_follows_the_target_distribution(small_pair, sampling):
    mx.random.seed(0)
    first, second, p_first, p_second = simulate_two_tokens(*small_pair, sampling)
    assert chi_square_p(first, p_first) > 1e-3
    assert chi_square_p(second, p_second) > 1e-3


BROKEN_RULES = {
    "always-accept": lambda p_x, q_x, u: p_x >= 0,
    "ignores-q": lambda p_x, q_x, u: u < p_x,
    "inverted-ratio": lambda p_x, q_x, u: u * p_x < q_x,
}


@pytest.mark.parametrize("rule", sorted(BROKEN_RULES))
def test_a_broken_acceptance_rule_is_detected(small_pair, monkeypatch, rule):
    monkeypatch.setattr(verification, "accept_draft_tokens", BROKEN_RULES[rule])
    mx.random.seed(0)
    first, second, p_first, p_second = simulate_two_tokens(*small_pair, SamplingParams(1.0))
    assert chi_square_p(first, p_first) < 1e-9
    assert chi_square_p(second, p_second) < 1e-9


def test_deterministic_drafts_follow_the_target_distribution(small_pair):
    """Prompt lookup's case: q is one-hot, the draft tokens are fixed."""
    target, _ = small_pair
    pipeline = LogitsPipeline(SamplingParams(temperature=1.0), SMALL.vocab_size)
    p0, p1, p2 = (pipeline.probs(t) for t in scaled_tables(target, pipeline))
    a, b = int(mx.argmax(p0)), 3
    p = mx.broadcast_to(mx.stack([p0, p1[a], p2[a, b]]), (NUM_SAMPLES, 3, SMALL.vocab_size))
    mx.random.seed(1)
    n, out = verify_rejection(p, None, mx.broadcast_to(mx.array([a, b]), (NUM_SAMPLES, 2)))
    assert chi_square_p(out[:, 0], p0) > 1e-3
    after_a = np.asarray(out[:, 1])[np.asarray(n) >= 1]  # the second token, given first == a
    assert len(after_a) > 2000
    assert chi_square_p(mx.array(after_a), p1[a]) > 1e-3


def test_target_distribution_is_what_mlx_lm_samples_from(small_pair):
    target, _ = small_pair
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=10, min_p=0.02)
    pipeline = LogitsPipeline(sampling, SMALL.vocab_size)
    logits = target(mx.array([SMALL_PROMPT]))[0, -1:]
    probs = pipeline.probs(pipeline.scaled(pipeline.process(logits)))[0]
    sampler = make_sampler(temp=0.7, top_p=0.9, top_k=10, min_p=0.02)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(2)
    samples = sampler(mx.broadcast_to(logprobs, (NUM_SAMPLES, SMALL.vocab_size)))
    assert (probs == 0).sum().item() > 0  # the filters did cut something
    assert chi_square_p(samples, probs) > 1e-3


def test_xtc_is_the_mixture_of_what_mlx_lm_samples_from_with_and_without_its_cut(small_pair):
    """mlx_lm flips XTC's coin once per step: its distribution is (1 - p) times the sampler's
    without the cut plus p times with it. Each side against mlx_lm's sampler (a coin of 0 or 1
    is certain), the mixture exactly."""
    target, _ = small_pair
    logits = target(mx.array([SMALL_PROMPT]))[0, -1:]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)  # mlx_lm's compiled XTC cannot take a graph as its input

    def ours(p):
        pipeline = LogitsPipeline(replace(XTC, xtc_probability=p), SMALL.vocab_size)
        return pipeline.probs(pipeline.scaled(pipeline.process(logits)))[0]

    assert mx.abs(ours(0.0) - ours(1.0)).max().item() > 0.05  # the cut changes something
    for p, seed in ((0.0, 3), (1.0, 4)):
        sampler = make_sampler(temp=XTC.temperature, top_k=XTC.top_k, xtc_probability=p,
                               xtc_threshold=XTC.xtc_threshold,
                               xtc_special_tokens=list(XTC.xtc_special_tokens))
        mx.random.seed(seed)
        samples = sampler(mx.broadcast_to(logprobs, (NUM_SAMPLES, SMALL.vocab_size)))
        assert chi_square_p(samples, ours(p)) > 1e-3
    mixed = 0.7 * ours(0.0) + 0.3 * ours(1.0)
    assert mx.allclose(ours(0.3), mixed, atol=1e-6).item()


def test_xtc_cut_is_mlx_lms(small_pair):
    from mlx_lm.sample_utils import apply_xtc

    from server.engine.scheduling.sampling import xtc_cut

    target, _ = small_pair
    logits = target(mx.array([SMALL_PROMPT]))[0, -3:]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)  # mlx_lm's compiled XTC cannot take a graph as its input
    for threshold, special in ((0.02, [3]), (0.1, []), (0.5, [])):
        want = apply_xtc(logprobs, 1.0, threshold, special)  # a coin of 1: always cut
        assert mx.array_equal(xtc_cut(logprobs, threshold, special), want).item()


def test_exact_matching_and_rejection_on_known_values():
    assert count_exact_matches([4, 5, 9, 1], [4, 5, 6]) == 2
    assert count_exact_matches([4, 5, 6, 1], [4, 5, 6]) == 3
    assert count_exact_matches([3], []) == 0

    drafts = mx.array([[4, 5, 6]], mx.uint32)

    one_hot = mx.zeros((1, 4, 8))
    one_hot[:, 0, 4] = 1.0
    one_hot[:, 1, 5] = 1.0
    one_hot[:, 2, 7] = 1.0  # the target is sure of 7 where the draft said 6
    one_hot[:, 3, 2] = 1.0
    n, out = verify_rejection(one_hot, None, drafts)
    assert n.tolist() == [2] and out.tolist()[0][:3] == [4, 5, 7]
    n, out = verify_rejection(one_hot[:, :1], None, drafts[:, :0])
    assert n.tolist() == [0] and out.tolist() == [[4]]
