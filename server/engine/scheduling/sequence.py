"""One request inside the engine: its sampling state, its drafting state and its output.

A `Sequence` is created when a request is submitted and lives on the MLX thread from then on.
The scheduler moves it WAITING -> PREFILL -> DECODE -> DONE; the decoder appends tokens with
`emit`, which detokenizes, applies stop strings and limits, and hands `TokenEvent`s and one
`Finished` to the request's sink (the HTTP side's queue, or a list in the demo).
"""

from __future__ import annotations

import os
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from enum import Enum

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from server.engine.errors import RequestCancelled
from server.engine.events import DraftCounters, Finished, GenerationStats, TokenEvent
from server.engine.memory import peak_bytes
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.sampling import LogitsPipeline
from server.engine.scheduling.stop_sequences import StopMatcher
from server.engine.speculation.candidates import (
    MODEL,
    PROMPT_LOOKUP,
    SUFFIX,
    DraftCandidate,
    best_candidate,
    counted_candidate,
    rate_candidate,
)
from server.engine.speculation.cost_model import PRIOR_ACCEPTANCE
from server.engine.speculation.drafting import DraftSchedule, lookup_match
from server.engine.speculation.prediction import PredictionDraft
from server.engine.speculation.prompt_lookup import DEFAULT_MIN_NGRAM
from server.engine.speculation.suffix import SuffixCalibration, SuffixIndex

Sink = Callable[[object], None]
ROUND_DRAFTERS = (MODEL, PROMPT_LOOKUP, SUFFIX)
NOTHING: frozenset[int] = frozenset()
PREDICTION = "prediction"  # the acceptance and k of rounds drafted from a prediction
FORCED = "forced"  # ... and of rounds drafted from the tokens a constraint forces


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


def request_key(seed: int | None) -> mx.array:
    """The request's own random key: from its seed, else from the OS (never global state)."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    return mx.random.key(seed % 2**64)


class Sequence:
    def __init__(self, params: GenerationParams, *, tokenizer, vocab_size: int, sink: Sink,
                 draft_name: str | None, suffix: SuffixIndex | None = None):
        self.params = params
        self.prompt = list(params.prompt_tokens)
        self.output: list[int] = []
        self._buffer = array("I", self.prompt)  # the context, for the host drafters' searches
        self.phase = Phase.WAITING
        self.sink = sink
        self.cancelled = False
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.started_at = self.first_token_at = self.submitted_at
        # Prefill state (scheduler): caches being filled, and how far they got. A request
        # prefills its prompt; one resumed after a preemption, its context but the last token.
        self.prefill_tokens: list[int] = self.prompt
        self.target_cache: list | None = None
        self.draft_cache: list | None = None
        self.prefilled = 0
        self.cached_tokens = 0
        self.prefill_begun = False  # drafting decided and the prefix cache consulted
        self.prefill_passed_over = 0  # prefill groups that went before this older request
        self.admitted = 0  # the scheduler's admission order (the newest is preempted first)
        self.preemptions = 0
        # Preempted after its first token: its prefill restores its context, and its next
        # token comes from decoding.
        self.resumed = False
        # Decoding state (decoder).
        self.pipeline = LogitsPipeline(params.sampling, vocab_size, _processors(params))
        self.key = request_key(params.sampling.seed)
        # One adaptive k per drafter: a hybrid row's lookup and model rounds accept differently;
        # lookup and prediction rounds cost no draft forward, so they may draft longer runs.
        spec = params.speculation
        self._schedules = {MODEL: DraftSchedule(spec), PROMPT_LOOKUP: _lookup_schedule(spec),
                           SUFFIX: _lookup_schedule(spec), PREDICTION: _lookup_schedule(spec),
                           FORCED: _lookup_schedule(spec)}
        # The served texts suffix drafting continues (the scheduler's index; None: off), and
        # the drafters this request may draft with (a hybrid row chooses each round).
        self.suffix_index = suffix
        self.sources = drafter_sources(spec.source, suffix is not None)
        self.candidate: DraftCandidate | None = None  # what this round's drafter offered
        self.calibration = SuffixCalibration(suffix.calibration if suffix is not None else None)
        self.prediction = PredictionDraft(params.prediction) if params.prediction else None
        self.predicting = False  # this round drafts from the prediction
        self.forcing = False  # this round drafts the tokens its constraint forces
        self.round_drafter = self.sources[0]  # who drafts this round (`plan_round`)
        self.looked_up: list[int] = []  # prompt lookup's continuation this round (`plan_round`)
        self.draft_name = draft_name
        self._lost_k = 0  # the k it had when a draft model that drafted for it was unloaded
        self.draft_pending: list[int] = []  # context tokens the draft's cache has not seen
        self.constraint = params.constraint() if params.constraint is not None else None
        self.counters = DraftCounters()
        # Per drafter (a prediction's rounds apart from other lookups): [accepted, trials].
        self.tried = {d: [0, 0] for d in (*ROUND_DRAFTERS, PREDICTION, FORCED)}
        self.accepted_per_position: Counter = Counter()
        # Output (emit).
        self._tokenizer = tokenizer
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids) - self._eos
        self._detokenizer = tokenizer.detokenizer
        self._stops = StopMatcher(params.stop)
        self.finish_reason: str | None = None

    # -- what the decoder needs -----------------------------------------------------------
    @property
    def drafter(self) -> str | None:
        """"model", "prompt_lookup", "hybrid" or None: how this request drafts (fixed for its
        life, unless the draft model is unloaded)."""
        spec = self.params.speculation
        return spec.source if spec.num_draft_tokens > 0 else None

    @property
    def uses_draft_model(self) -> bool:
        """Whether the draft model must follow this request's context."""
        return self.drafter is not None and MODEL in self.sources

    def plan_round(self, rates=None, draft_cost: float = 0.0) -> None:
        """Choose this round's drafter, and what a host drafter proposes (as many tokens as k
        can be; the round proposes its first k): the tokens the constraint forces, when there
        are any; the prediction's, when the request has one and it continues the answer
        (whatever the drafter); else its drafter's, and for a hybrid row the candidate expected
        to emit the most tokens per unit of round time (`candidates.best_candidate`) among
        prompt lookup (where the context's last `hybrid_min_match` tokens occurred before),
        suffix drafting (when the server keeps an index) and the draft model. `rates`
        (`cost_model.DrafterRates`): the engine-wide acceptance each drafter starts a row from;
        `draft_cost`: a draft forward's time over the target's (0: unknown). `candidate` is
        the chosen drafter's offer (its expected accepted tokens per k), whatever the drafter.

        A seeded sampled row's drafts decide how its randomness is drawn, so they come from
        its own text and rounds only (no other request's answers, acceptance or timing): its
        text does not depend on what else the server did (`policy.speculates_at_own_k`)."""
        drafter = self.drafter
        if drafter is None:
            return
        self.predicting = False
        self.candidate = None
        self.forcing = self._plan_forced()
        if self.forcing:
            return
        spec = self.params.speculation
        min_match = spec.hybrid_min_match if drafter == "hybrid" else DEFAULT_MIN_NGRAM
        self.looked_up, matched = lookup_match(
            self._buffer, self._schedules[PROMPT_LOOKUP].max_k, min_match) \
            if PROMPT_LOOKUP in self.sources else ([], 0)
        self.predicting = self._plan_prediction(matched)
        if self.predicting:
            return
        if self._reproducible:
            rates, draft_cost = None, 0.0
        offers = self._candidates(rates)
        best = best_candidate(offers, draft_cost) if len(offers) > 1 else \
            next(iter(offers), None)
        self.candidate = best
        self.round_drafter = best.source if best is not None else self.sources[0]
        if self.round_drafter != MODEL:
            self.looked_up = list(best.tokens) if best is not None else []

    @property
    def _reproducible(self) -> bool:
        sampling = self.params.sampling
        return sampling.seed is not None and not sampling.greedy

    def _candidates(self, rates) -> list[DraftCandidate]:
        """What each of the row's drafters offers this round (`plan_round`)."""
        offers = []
        for source in self.sources:
            k = self._schedules[source].next(self.remaining)
            if source == SUFFIX and self.suffix_index is None:
                continue  # the server keeps no index: a request cannot ask for it
            if source == SUFFIX:
                proposal = self.suffix_index.propose(self.params.tenant, self._buffer,
                                                     self._schedules[SUFFIX].max_k,
                                                     stored=not self._reproducible)
                offers.append(counted_candidate(proposal.tokens, proposal.confidence, k,
                                                self.calibration.factor(not self._reproducible)))
                continue
            accepted, trials = self.tried[source]
            prior = rates.prior(source) if rates is not None else PRIOR_ACCEPTANCE
            offers.append(rate_candidate(source, self.looked_up, k, accepted, trials, prior))
        return offers

    def _plan_forced(self) -> bool:
        """Whether this round drafts the tokens the constraint forces (a schema's next key):
        they come with no alternative, so they go first."""
        forced = getattr(self.constraint, "forced", None)
        tokens = forced()[: self._schedules[FORCED].max_k] if forced is not None else []
        if not tokens:
            return False
        self.looked_up, self.round_drafter = tokens, "prompt_lookup"
        return True

    def _plan_prediction(self, looked_up: int) -> bool:
        """Whether this round drafts from the request's prediction: when it continues the
        answer, unless prompt lookup (for a row that looks up) matched a longer n-gram
        (`looked_up` tokens long)."""
        if self.prediction is None:
            return False
        k = self._schedules[PREDICTION].max_k
        guess, n = self.prediction.propose(self.output, k,
                                           self.params.speculation.hybrid_min_match)
        if not guess or looked_up > n:
            return False
        self.looked_up, self.round_drafter = guess, "prompt_lookup"
        return True

    def lose_draft_model(self) -> None:
        """The draft model is gone: a hybrid row goes on with prompt lookup, a model row without
        drafting. The stats name the draft model only if it drafted for this request."""
        spec = self.params.speculation
        drafted = self.counters.model_rounds > 0
        if self.drafter == "hybrid":
            self.sources = tuple(s for s in self.sources if s != MODEL)
            # with suffix drafting a hybrid row goes on combining the host drafters
            new = spec if len(self.sources) > 1 else replace(spec, source=PROMPT_LOOKUP)
            if not drafted:
                self.draft_name = drafter_name(new.source, None, self.suffix_index is not None)
        else:
            new = replace(spec, num_draft_tokens=0)
            if drafted:
                self._lost_k = spec.num_draft_tokens
        self.params = replace(self.params, speculation=new)
        self.round_drafter = PROMPT_LOOKUP

    def record_acceptance(self, proposed: int, accepted: int) -> tuple[int, int]:
        """Count a verified round of this round's drafter: (accepted, trials), where trials
        are the accepted tokens plus the rejected one, if any."""
        trials = accepted + (accepted < proposed)
        tried = self.tried[self.drafted_by]
        tried[0] += accepted
        tried[1] += trials
        if self.drafted_by == SUFFIX and self.candidate is not None:
            self.calibration.record(self.candidate.expected_accepted(proposed), accepted)
        return accepted, trials

    def count_accepted(self) -> None:
        """One more drafted token the target accepted (and emitted)."""
        self.counters.accepted += 1
        self.counters.prediction_accepted += self.predicting

    @property
    def drafted_by(self) -> str:
        """Whose acceptance and k this round's are: the round's drafter's, or the
        prediction's or the forced tokens' (their rounds are lookup rounds, which accept
        differently)."""
        if self.forcing:
            return FORCED
        return PREDICTION if self.predicting else self.round_drafter

    @property
    def schedule(self) -> DraftSchedule:
        """The adaptive k of this round's drafter."""
        return self._schedules[self.drafted_by]

    @property
    def last_token(self) -> int:
        """The context's last token: the next input of the target."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    @property
    def unprefilled(self) -> int:
        """Prompt tokens not in the cache yet (before `_begin`: not counting a restored prefix)."""
        return len(self.prefill_tokens) - self.prefilled

    @property
    def round_tokens(self) -> int:
        """The most tokens a decoding round feeds this row: its last token and a draft."""
        if self.drafter is None:
            return 1
        return 1 + max(schedule.max_k for schedule in self._schedules.values())

    def pause(self) -> None:
        """Preempted: its caches are gone. It waits to prefill again what they held (its
        context but the last token, the next round's input), then decodes on: its sampling,
        drafting and output state are untouched, so its text goes on as it would have."""
        self.phase = Phase.WAITING
        self.resumed = bool(self.output)
        self.prefill_tokens = self.context[:-1] if self.resumed else self.prompt
        self.target_cache = self.draft_cache = None
        self.prefilled = 0
        self.prefill_begun = False
        self.prefill_passed_over = 0
        self.draft_pending = []
        self.preemptions += 1

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def eos_allowed_at(self, position: int) -> bool:
        """May the token at output index `position` be EOS (ignore_eos, min_tokens)?"""
        return not self.params.ignore_eos and position >= self.params.min_tokens

    def banned_at(self, position: int) -> frozenset[int]:
        """The ending tokens the token at output index `position` may not be: EOS unless
        `eos_allowed_at`, the `stop_token_ids` before `min_tokens` (`ignore_eos` leaves them,
        as in vLLM)."""
        banned = NOTHING if self.eos_allowed_at(position) else self._eos
        return banned | self._stop_ids if position < self.params.min_tokens else banned

    def ends_at(self, token: int, position: int) -> bool:
        """Whether `token` at output index `position` ends the output (EOS or a stop id)."""
        return (token in self._eos or token in self._stop_ids) and \
            token not in self.banned_at(position)

    # -- output ---------------------------------------------------------------------------
    def emit(self, token: int, from_draft: bool, logprobs: mx.array | None) -> bool:
        """Append one token and deliver its event; True when the request is now finished."""
        if not self.output:
            self.first_token_at = time.perf_counter()
        self.output.append(token)
        self._buffer.append(token)
        n = len(self.output)
        eos = self.ends_at(token, n - 1)
        if not eos:
            self._detokenizer.add_token(token)
        finished_by_grammar = self.constraint is not None and self.constraint.is_finished()
        last = eos or n >= self.params.max_tokens or finished_by_grammar
        if last:
            self._detokenizer.finalize()
        text, hit_stop = self._stops.feed(self._detokenizer.last_segment, final=last)
        if hit_stop and n < self.params.min_tokens:
            hit_stop, self._stops.matched = False, None
        self.sink(TokenEvent(token, text, from_draft, *self._logprobs(logprobs, token)))
        if eos or hit_stop or finished_by_grammar:
            self.finish_reason = "stop"
        elif last:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _logprobs(self, logprobs: mx.array | None, token: int):
        if logprobs is None or not self.params.logprobs:
            return None, None
        chosen = _finite(logprobs[token].item())
        n = self.params.top_logprobs
        if n <= 0:
            return chosen, None
        top = mx.argpartition(-logprobs, kth=n - 1)[:n]
        values = logprobs[top]
        order = mx.argsort(-values)
        pairs = zip(top[order].tolist(), values[order].tolist(), strict=True)
        return chosen, tuple((int(t), _finite(v)) for t, v in pairs)

    def finish(self, reason: str | None = None) -> None:
        """Deliver `Finished` (or the error) exactly once."""
        if self.phase is Phase.DONE:
            return
        self.phase = Phase.DONE
        if self.error is not None:
            self.sink(self.error)
            return
        if self.cancelled and self.finish_reason is None:
            self.sink(RequestCancelled())
            return
        stop_sequence = self._stops.matched if self.finish_reason == "stop" else None
        self.sink(Finished(self.finish_reason or reason or "length", self.stats(), stop_sequence))

    def stats(self) -> GenerationStats:
        end = time.perf_counter()
        n, c = len(self.output), self.counters
        k = self.params.speculation.num_draft_tokens or self._lost_k
        speculating = k > 0
        prefill_s = max(self.first_token_at - self.started_at, 1e-9)
        return GenerationStats(
            prompt_tokens=len(self.prompt),
            generation_tokens=n,
            ttft_s=self.first_token_at - self.submitted_at,
            prompt_tps=(len(self.prompt) - self.cached_tokens) / prefill_s,
            generation_tps=n / max(end - self.first_token_at, 1e-9) if n > 1 else 0.0,
            total_s=end - self.submitted_at,
            peak_memory_gb=peak_bytes() / 1e9,
            draft_model=self.draft_name if speculating else None,
            num_draft_tokens=k,
            draft_tokens_proposed=c.proposed,
            draft_tokens_accepted=c.accepted,
            acceptance_rate=c.accepted / c.proposed if c.proposed else None,
            from_draft_fraction=c.accepted / n if n else 0.0,
            mean_accepted_length=c.accepted / c.rounds if c.rounds else None,
            k_histogram=dict(sorted(c.k_histogram.items())) if speculating else None,
            cached_tokens=self.cached_tokens,
            **self._prediction_stats(),
        )

    def _prediction_stats(self) -> dict:
        if self.prediction is None:
            return {}
        accepted = self.counters.prediction_accepted
        return {"accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": max(len(self.prediction) - accepted, 0)}


def drafter_sources(source: str, suffix: bool) -> tuple[str, ...]:
    """The drafters a request drafting from `source` chooses among, each round (a hybrid
    row's: prompt lookup, suffix drafting where the server keeps an index, the draft model);
    the first is its drafter before any round."""
    if source != "hybrid":
        return (str(source),)
    return (PROMPT_LOOKUP, *((SUFFIX,) if suffix else ()), MODEL)


def drafter_name(source: str, draft_model: str | None, suffix: bool) -> str:
    """How `stats.draft_model` names a request's drafter: the draft model's name, "suffix",
    "prompt_lookup", or a hybrid's sources joined by "+" (the draft model last, by name)."""
    if source == MODEL:
        return draft_model or MODEL
    if source != "hybrid":
        return str(source)
    names = [s for s in drafter_sources(source, suffix) if s != MODEL]
    return "+".join(names + ([draft_model] if draft_model else []))


def _lookup_schedule(spec: SpeculationParams) -> DraftSchedule:
    """k of prompt lookup's (or a prediction's) rounds: up to `lookup_draft_tokens`, doubling
    after a fully accepted round, when that is more than the request's k."""
    k = max(spec.lookup_draft_tokens, spec.num_draft_tokens)
    return DraftSchedule(replace(spec, num_draft_tokens=k), doubling=k > spec.num_draft_tokens)


def _processors(params: GenerationParams) -> list:
    """`mlx_lm`'s logits processors for the request's penalties and logit bias."""
    s = params.sampling
    return make_logits_processors(
        logit_bias=dict(s.logit_bias) or None,
        repetition_penalty=s.repetition_penalty,
        repetition_context_size=s.repetition_context_size,
        presence_penalty=s.presence_penalty, presence_context_size=s.presence_context_size,
        frequency_penalty=s.frequency_penalty, frequency_context_size=s.frequency_context_size,
    )


# JSON has no -inf: a token the processors ruled out gets OpenAI's floor instead.
LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR
