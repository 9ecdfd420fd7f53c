"""Speculative decoding: a drafter proposes tokens, the target verifies them in one forward pass.

Goes beyond `mlx_lm.generate.speculative_generate_step` while yielding the same
`(token, logprobs, from_draft)` tuples:

- speculative sampling (Leviathan et al. 2023; Chen et al. 2023): at temperature > 0 a draft
  token x is accepted with probability min(1, p(x)/q(x)), a rejection resamples from
  norm(max(0, p - q)), so the output follows the target's distribution while accepting more
  than `mlx_lm`'s rule (accept iff the target's own sample equals the draft);
- an adaptive draft length, and a draft that stops when its own confidence drops (`draft_p_min`);
- drafting from the prompt (`PromptLookupDrafter`), with no draft model at all.

A round: the drafter proposes k tokens (lazily, no host sync), the target runs on the last token
plus the k drafts, and a single `mx.eval` brings back what to yield: the target's own tokens,
compared with the drafts on the host (`count_exact_matches`, `mlx_lm`'s rule), or the accepted
prefix and one more token that `verify_rejection` picks on the device. The next round's draft is
queued before this round's tokens are yielded, so the device drafts while the caller consumes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from server.engine.events import DraftCounters
from server.engine.params import SamplingParams, SpeculationParams
from server.engine.prompt_lookup import (
    DEFAULT_MAX_NGRAM,
    DEFAULT_MIN_NGRAM,
    as_token_buffer,
    find_continuation,
)
from server.engine.sampling import LogitsPipeline, normalize

DEFAULT_PREFILL_STEP_SIZE = 512
# Below this total residual mass a rejection can only come from rounding (p == q): resample p.
RESIDUAL_MASS_EPS = 1e-6


# --- verification: pure functions on (..., k[+1], V) arrays, batched for tests ----------------


def accept_draft_tokens(p_x: mx.array, q_x: mx.array, u: mx.array) -> mx.array:
    """Speculative sampling's test, u < p(x)/q(x), written without dividing by q(x)."""
    return u * q_x < p_x


def count_exact_matches(target_tokens: list[int], draft_tokens: list[int]) -> int:
    """`mlx_lm`'s rule, on the host as there: accept while the target's own token equals the
    draft's. The target's tokens are then the output: the accepted drafts and one more."""
    n = 0
    for target_token, draft_token in zip(target_tokens, draft_tokens, strict=False):
        if target_token != draft_token:
            break
        n += 1
    return n


def verify_rejection(
    target_probs: mx.array, draft_probs: mx.array | None, draft_tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling: the output follows `target_probs` whatever the draft.

    target_probs (..., k+1, V); draft_probs (..., k, V), or None for a deterministic drafter
    (q one-hot: accept with probability p(x), resample from p with x removed);
    draft_tokens (..., k). Returns (num_accepted (...), tokens (..., k+1)) where
    tokens[..., :n] are the accepted drafts and tokens[..., n] the corrected or bonus token.
    """
    k = draft_tokens.shape[-1]
    if k == 0:
        return mx.zeros(draft_tokens.shape[:-1], mx.int32), _sample_probs(target_probs)
    drafts = draft_tokens[..., None]
    p_x = mx.take_along_axis(target_probs[..., :k, :], drafts, axis=-1)[..., 0]
    q_x = mx.ones_like(p_x) if draft_probs is None else _take_tokens(draft_probs, drafts)
    u = mx.random.uniform(shape=p_x.shape)
    accepted = accept_draft_tokens(p_x, q_x, u).astype(mx.int32)
    num_accepted = mx.cumprod(accepted, axis=-1).sum(axis=-1)

    p_n = _take_row(target_probs, num_accepted)
    if draft_probs is None:
        no_token = mx.full((*p_x.shape[:-1], 1), -1, dtype=mx.int32)
        padded = mx.concatenate([draft_tokens.astype(mx.int32), no_token], axis=-1)
        x_n = mx.take_along_axis(padded, num_accepted[..., None], axis=-1)
        vocab = mx.arange(target_probs.shape[-1])
        residual = mx.where(vocab == x_n, 0.0, p_n)
    else:
        q_n = _take_row(draft_probs, mx.minimum(num_accepted, k - 1))
        q_n = q_n * (num_accepted < k)[..., None]  # after k acceptances: the bonus token, from p
        residual = mx.maximum(p_n - q_n, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > RESIDUAL_MASS_EPS, residual, p_n)
    next_token = mx.random.categorical(mx.log(residual), axis=-1).astype(draft_tokens.dtype)

    positions = mx.arange(k + 1)
    padded = mx.concatenate([draft_tokens, next_token[..., None]], axis=-1)
    tokens = mx.where(positions == num_accepted[..., None], next_token[..., None], padded)
    return num_accepted, tokens


def _take_tokens(probs: mx.array, tokens: mx.array) -> mx.array:
    return mx.take_along_axis(probs, tokens, axis=-1)[..., 0]


def _take_row(probs: mx.array, index: mx.array) -> mx.array:
    """probs (..., R, V), index (...) -> probs[..., index, :] (..., V)."""
    return mx.take_along_axis(probs, index[..., None, None], axis=-2)[..., 0, :]


def _sample_probs(probs: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs), axis=-1)


# --- caches ---------------------------------------------------------------------------------


class _CacheCursor:
    """A trimmable cache: `settled` entries are context, `unsettled` ones were fed speculatively.

    Counts are relative to the start of this generation (a caller's cache may hold more).
    """

    def __init__(self, cache: list, settled: int = 0):
        self.cache = cache
        self.settled = settled
        self.unsettled = 0

    def feed(self, model: nn.Module, tokens: mx.array, rows: int) -> mx.array:
        """The logits (rows, V) of the last `rows` positions."""
        self.unsettled += tokens.size
        return model(tokens[None], cache=self.cache)[0, -rows:]

    def settle(self, keep: int) -> None:
        """Keep the first `keep` unsettled entries as context; trim the rest."""
        trim_prompt_cache(self.cache, self.unsettled - keep)
        self.settled += keep
        self.unsettled = 0

    def truncate(self, limit: int) -> None:
        """Hold at most `limit` entries, all of them settled (the `finally:` rewind)."""
        keep = max(0, min(self.unsettled, limit - self.settled))
        self.settle(keep)
        if self.settled > limit:
            trim_prompt_cache(self.cache, self.settled - limit)
            self.settled = limit


def _prefill(
    model: nn.Module, cache: list, tokens: mx.array, step_size: int, progress=None
) -> mx.array:
    """Process all but the last token in chunks (as `mlx_lm` does); return the last token.

    `progress(done, total)` is called after each chunk, like mlx_lm's prompt_progress_callback.
    """
    total, done = tokens.size, 0
    if progress is not None:
        progress(0, total)
    while tokens.size > 1:
        n = min(step_size, tokens.size - 1)
        model(tokens[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[n:]
        done += n
        if progress is not None and tokens.size > 1:
            progress(done, total)
        mx.clear_cache()
    if progress is not None:
        progress(total, total)
    return tokens


# --- drafters -------------------------------------------------------------------------------


@dataclass
class Proposal:
    """A round's draft: `count` tokens (known on the host; the tokens themselves may be lazy)."""

    tokens: mx.array  # (count,) uint32
    count: int
    probs: mx.array | None = None  # (count, V): the draft's q; None means one-hot (deterministic)


def _no_proposal() -> Proposal:
    return Proposal(mx.array([], dtype=mx.uint32), 0)


class DraftSession(ABC):
    """One generation's drafting state."""

    @abstractmethod
    def propose(self, num_tokens: int, history: mx.array | None) -> Proposal:
        """Draft up to `num_tokens` tokens after the context (`history` when processors need it)."""

    @abstractmethod
    def commit(self, accepted: list[int], token: int) -> None:
        """The context grew by the accepted drafts and the target's token."""

    def close(self, context_entries: int) -> None:  # noqa: B027 - nothing to rewind by default
        """Rewind: keep at most `context_entries` settled cache entries."""


class Drafter(ABC):
    """Makes a `DraftSession` per generation; holds no per-generation state."""

    def make_cache(self) -> list:
        """The drafter's part of a combined prompt cache (target's layers first, like mlx_lm)."""
        return []

    @abstractmethod
    def start(
        self,
        prompt: mx.array,
        *,
        cache: list | None,
        pipeline: LogitsPipeline,
        speculation: SpeculationParams,
        prefill_step_size: int,
    ) -> DraftSession: ...


class ModelDrafter(Drafter):
    """Drafts with a small model that shares the target's tokenizer."""

    def __init__(self, model: nn.Module):
        self.model = model

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def start(self, prompt, *, cache, pipeline, speculation, prefill_step_size):
        cache = cache if cache else self.make_cache()
        if not can_trim_prompt_cache(cache):
            raise ValueError("Speculative decoding requires a trimmable draft cache.")
        last = _prefill(self.model, cache, prompt, prefill_step_size)
        cursor = _CacheCursor(cache, settled=prompt.size - last.size)
        return _ModelDraftSession(self.model, cursor, last.tolist(), pipeline, speculation)


class _ModelDraftSession(DraftSession):
    def __init__(self, model, cursor: _CacheCursor, pending: list[int], pipeline, speculation):
        self.model = model
        self.cursor = cursor
        self.pending = pending  # context tokens not yet in the draft's cache (1 or 2)
        self.pipeline = pipeline
        self.p_min = speculation.draft_p_min if speculation.adaptive else 0.0
        self.want_probs = not pipeline.greedy and speculation.acceptance == "rejection"
        self.fed_drafts = 0

    def propose(self, num_tokens, history):
        self.fed_drafts = 0
        if num_tokens <= 0:
            return _no_proposal()
        y = mx.array(self.pending, dtype=mx.uint32)
        tokens, probs = [], []
        count, confidence = num_tokens, None
        for i in range(num_tokens):
            if i > 0:
                self.fed_drafts += 1
            logits = self.cursor.feed(self.model, y, 1)
            context = history if history is None or i == 0 else mx.concatenate([history, *tokens])
            y, q, top = self._next(self.pipeline.process(logits, context))
            mx.async_eval(*(a for a in (y, q, top) if a is not None))
            tokens.append(y)
            probs.append(q)
            # Read the previous step's confidence while this step runs on the device.
            if confidence is not None and confidence.item() < self.p_min:
                count = i - 1
                break
            confidence = top
        else:
            if confidence is not None and confidence.item() < self.p_min:
                count = num_tokens - 1
        if count == 0:
            return _no_proposal()
        draft_probs = mx.concatenate(probs[:count]) if self.want_probs else None
        return Proposal(mx.concatenate(tokens[:count]), count, draft_probs)

    def _next(self, processed: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """(token, q if the acceptance needs it, top probability if draft_p_min needs it)."""
        pipeline, track = self.pipeline, self.p_min > 0
        if pipeline.greedy:
            token = pipeline.greedy_tokens(processed)
            top = mx.exp(normalize(processed.astype(mx.float32)).max()) if track else None
            return token, None, top
        scaled = pipeline.scaled(processed)
        token = pipeline.sample(scaled)
        q = pipeline.probs(scaled) if self.want_probs or track else None
        return token, (q if self.want_probs else None), (q.max() if track else None)

    def commit(self, accepted, token):
        # The draft's cache holds the pending inputs and the drafts it fed; the fed drafts
        # that were accepted are context now, the rest are trimmed.
        keep = len(self.pending) + min(len(accepted), self.fed_drafts)
        self.cursor.settle(keep)
        self.pending = (self.pending + accepted + [token])[keep:]
        self.fed_drafts = 0

    def close(self, context_entries):
        self.cursor.truncate(min(self.cursor.settled, context_entries))


class PromptLookupDrafter(Drafter):
    """Drafts the continuation of the last n-gram's earlier occurrence in prompt + output."""

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, prompt, *, cache, pipeline, speculation, prefill_step_size):
        return _PromptLookupSession(as_token_buffer(prompt.tolist()), self)


class _PromptLookupSession(DraftSession):
    def __init__(self, context, drafter: PromptLookupDrafter):
        self.context = context
        self.drafter = drafter

    def propose(self, num_tokens, history):
        tokens = find_continuation(
            self.context,
            num_tokens,
            max_ngram=self.drafter.max_ngram,
            min_ngram=self.drafter.min_ngram,
        )
        if not tokens:
            return _no_proposal()
        return Proposal(mx.array(tokens, dtype=mx.uint32), len(tokens))

    def commit(self, accepted, token):
        self.context.extend(accepted)
        self.context.append(token)


# --- draft length ---------------------------------------------------------------------------


class DraftSchedule:
    """How many tokens to draft next round.

    Fixed: `num_draft_tokens` every round. Adaptive: one more after a round that accepted a
    full block, half as many after a rejection in the first half of the block, one fewer after
    a later rejection; always within [1, num_draft_tokens].
    """

    def __init__(self, speculation: SpeculationParams):
        self.max_k = max(0, speculation.num_draft_tokens)
        self.adaptive = speculation.adaptive
        self.k = self.max_k

    def next(self, remaining: float) -> int:
        return int(min(self.k, remaining))

    def update(self, requested: int, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            if proposed == requested == self.k:
                self.k = min(self.max_k, self.k + 1)
        elif accepted < proposed // 2:
            self.k = max(1, self.k // 2)
        else:
            self.k = max(1, self.k - 1)


# --- the generator --------------------------------------------------------------------------


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    drafter: Drafter,
    *,
    sampling: SamplingParams,
    speculation: SpeculationParams,
    max_tokens: int,
    counters: DraftCounters,
    vocab_size: int,
    logits_processors: list | None = None,
    prompt_cache: list | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_progress_callback=None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield `(token, logprobs, from_draft)` for up to `max_tokens` tokens (-1: no limit).

    `logprobs` are the target's processed log-probabilities over the first `vocab_size` ids,
    as `mlx_lm` yields them (lazy: computed only if the caller reads them). `prompt_cache`,
    if given, is the target's cache followed by `drafter.make_cache()`'s, updated in place; on
    exit the target's part holds the prompt and every yielded token but the last, the draft's
    part a prefix of that. Seeding `mx.random` is the caller's business.
    """
    if prompt.size == 0:
        raise ValueError("The prompt must contain at least one token.")
    pipeline = LogitsPipeline(sampling, vocab_size, logits_processors)
    target_cache, draft_cache = _split_prompt_cache(model, prompt_cache)
    prompt = prompt.astype(mx.uint32)
    remaining = math.inf if max_tokens < 0 else max_tokens
    schedule = DraftSchedule(speculation)
    exact = pipeline.greedy or speculation.acceptance == "exact"

    with mx.stream(generation_stream):
        session = drafter.start(
            prompt,
            cache=draft_cache,
            pipeline=pipeline,
            speculation=speculation,
            prefill_step_size=prefill_step_size,
        )
        y = _prefill(model, target_cache, prompt, prefill_step_size, prompt_progress_callback)
        target = _CacheCursor(target_cache, settled=prompt.size - 1)
        history = prompt if pipeline.needs_history else None
        context_length = prompt.size
        try:
            requested = schedule.next(remaining)
            proposal = session.propose(requested, history) if remaining > 0 else None
            while proposal is not None:
                inputs = mx.concatenate([y, proposal.tokens])
                logits = target.feed(model, inputs, proposal.count + 1)
                processed = pipeline.process(logits, history, proposal.tokens)
                n, tokens = _verify(processed, proposal, pipeline, exact)
                counters.record_round(proposal.count)
                emit = tokens[: int(min(n + 1, remaining))]
                remaining -= len(emit)

                # Settle the round and queue the next draft before the caller sees any token.
                target.settle(n + 1)
                session.commit(tokens[:n], tokens[n])
                schedule.update(requested, proposal.count, n)
                if history is not None:
                    history = mx.concatenate([history, mx.array(tokens[: n + 1], mx.uint32)])
                proposal = None
                if remaining > 0:
                    y = mx.array(tokens[n : n + 1], mx.uint32)
                    requested = schedule.next(remaining)
                    proposal = session.propose(requested, history)

                logprobs = normalize(processed)
                for i, token in enumerate(emit):
                    context_length += 1
                    if i < n:
                        counters.accepted += 1
                    yield token, logprobs[i], i < n
        finally:
            target.truncate(context_length - 1)
            session.close(context_length - 1)


def _split_prompt_cache(model: nn.Module, prompt_cache: list | None) -> tuple[list, list | None]:
    """(target's cache, drafter's cache or None): the target's layers come first, as in mlx_lm."""
    if prompt_cache is None:
        target_cache, draft_cache = make_prompt_cache(model), None
    else:
        target_cache = prompt_cache[: len(model.layers)]
        draft_cache = prompt_cache[len(model.layers) :]
    if not can_trim_prompt_cache(target_cache):
        types = {type(c).__name__ for c in target_cache if not c.is_trimmable()}
        raise ValueError(f"Speculative decoding requires a trimmable prompt cache (got {types}).")
    return target_cache, draft_cache


def _verify(
    processed: mx.array, proposal: Proposal, pipeline: LogitsPipeline, exact: bool
) -> tuple[int, list[int]]:
    """The round's one host sync: (accepted drafts n, tokens whose first n + 1 are the output)."""
    if exact:
        if pipeline.greedy:
            target_tokens = pipeline.greedy_tokens(processed)
        else:
            target_tokens = pipeline.sample(pipeline.scaled(processed))
        mx.eval(target_tokens, proposal.tokens)
        tokens = target_tokens.tolist()
        return count_exact_matches(tokens, proposal.tokens.tolist()), tokens
    target_probs = pipeline.probs(pipeline.scaled(processed))
    num_accepted, tokens = verify_rejection(target_probs, proposal.probs, proposal.tokens)
    mx.eval(num_accepted, tokens)
    return num_accepted.item(), tokens.tolist()
