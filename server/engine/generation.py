"""Generation: prompt tokens in, TokenEvents and one Finished out. Runs on the worker thread.

Mirrors `mlx_lm.stream_generate` (same detokenizer, timing and EOS rules, tested against it)
but takes any token generator yielding (token, logprobs, from_draft), adds stop strings,
logprobs and draft accounting, and stops early when the caller cancels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from server.engine.events import DraftCounters, Finished, GenerationStats, TokenEvent
from server.engine.model_kit import LoadedModel, ModelKit
from server.engine.params import GenerationParams, SamplingParams
from server.engine.speculative import (
    ModelDrafter,
    PromptLookupDrafter,
    speculative_generate_step,
)
from server.engine.stop_sequences import StopMatcher

TokenStream = Iterator[tuple[int, mx.array, bool]]


def make_sampling(sampling: SamplingParams):
    """mlx_lm's sampler and logits processors for these parameters."""
    sampler = make_sampler(
        temp=sampling.temperature,
        top_p=sampling.top_p if sampling.top_p < 1.0 else 0.0,
        min_p=sampling.min_p,
        top_k=sampling.top_k,
    )
    processors = make_logits_processors(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )
    return sampler, processors


def token_stream(
    kit: ModelKit,
    params: GenerationParams,
    counters: DraftCounters,
    draft: LoadedModel | None,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> TokenStream:
    """Plain `mlx_lm` decoding without a drafter, else our speculative decoder."""
    prompt = mx.array(params.prompt_tokens, mx.uint32)
    spec = params.speculation
    sampler, processors = make_sampling(params.sampling)
    if spec.num_draft_tokens == 0:
        steps = generate_step(
            prompt, kit.target.model, max_tokens=params.max_tokens, sampler=sampler,
            logits_processors=processors, prompt_progress_callback=prompt_progress,
        )
        return ((token, logprobs, False) for token, logprobs in steps)
    drafter = PromptLookupDrafter() if spec.source == "prompt_lookup" else ModelDrafter(
        draft.model
    )
    return speculative_generate_step(
        prompt, kit.target.model, drafter, sampling=params.sampling, speculation=spec,
        max_tokens=params.max_tokens, counters=counters, vocab_size=kit.target.vocab_size,
        logits_processors=processors, prompt_progress_callback=prompt_progress,
    )


def _top_logprobs(logprobs: mx.array, token: int, n: int):
    chosen = logprobs[token].item()
    if n <= 0:
        return chosen, None
    top = mx.argpartition(-logprobs, kth=n - 1)[:n]
    vals = logprobs[top]
    order = mx.argsort(-vals)
    pairs = zip(top[order].tolist(), vals[order].tolist(), strict=True)
    return chosen, tuple((int(t), float(v)) for t, v in pairs)


def generate_events(
    kit: ModelKit,
    params: GenerationParams,
    *,
    cancelled: Callable[[], bool] = lambda: False,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> Iterator[TokenEvent | Finished]:
    """One TokenEvent per generated token (EOS included, with no text), then Finished.

    Closing this generator early (client gone) closes the token generator, whose `finally`
    rewinds the caches.
    """
    spec = params.speculation
    draft = kit.draft if spec.num_draft_tokens and spec.source == "model" else None
    tokenizer = kit.target.tokenizer
    if params.sampling.seed is not None:
        mx.random.seed(params.sampling.seed)
    mx.reset_peak_memory()
    counters = DraftCounters()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stops = StopMatcher(params.stop)
    start = time.perf_counter()
    first = start
    n, finish = 0, "length"
    tokens = token_stream(kit, params, counters, draft, prompt_progress)
    try:
        for token, logprobs, from_draft in tokens:
            if n == 0:
                first = time.perf_counter()
            n += 1
            eos = token in tokenizer.eos_token_ids
            if not eos:
                detokenizer.add_token(token)
            last = eos or n == params.max_tokens
            if last:
                detokenizer.finalize()
            text, hit_stop = stops.feed(detokenizer.last_segment, final=last)
            lp, top = (
                _top_logprobs(logprobs, token, params.top_logprobs)
                if params.logprobs else (None, None)
            )
            yield TokenEvent(token, text, from_draft, lp, top)
            if eos or hit_stop:
                finish = "stop"
                break
            if last or cancelled():
                break
    finally:
        tokens.close()
    end = time.perf_counter()
    yield Finished(finish, _stats(kit, params, counters, draft, n, start, first, end))


def _stats(kit, params, counters, draft, n, start, first, end) -> GenerationStats:
    prompt_n = len(params.prompt_tokens)
    speculating = params.speculation.num_draft_tokens > 0
    drafter_name = (
        (draft.name if draft is not None else params.speculation.source) if speculating else None
    )
    return GenerationStats(
        prompt_tokens=prompt_n,
        generation_tokens=n,
        ttft_s=first - start,
        prompt_tps=prompt_n / max(first - start, 1e-9),
        generation_tps=n / max(end - first, 1e-9) if n > 1 else 0.0,
        total_s=end - start,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        draft_model=drafter_name,
        num_draft_tokens=params.speculation.num_draft_tokens,
        draft_tokens_proposed=counters.proposed,
        draft_tokens_accepted=counters.accepted,
        acceptance_rate=counters.accepted / counters.proposed if counters.proposed else None,
        from_draft_fraction=counters.accepted / n if n else 0.0,
        mean_accepted_length=counters.accepted / counters.rounds if counters.rounds else None,
        k_histogram=dict(sorted(counters.k_histogram.items())) if speculating else None,
    )
