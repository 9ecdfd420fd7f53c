"""From logits to the distribution a token is sampled from: one pipeline for target and draft.

Speculative sampling compares the target's probability p(x) with the draft's q(x), which is only
correct when both come out of the same processing: vocabulary alignment, logits processors
(repetition penalty, logit bias) on the same token history, then `mlx_lm`'s filters (top-p,
min-p, XTC, top-k, in `make_sampler`'s order) and the temperature. XTC applies at random (a coin
per step in `mlx_lm`): its distribution is the mixture of the two outcomes, which is what
speculative sampling needs to know. `LogitsPipeline` does that for
both sides. Every method works on rows (`(..., V)`), so a whole draft block, or a batch of
thousands of samples in a test, goes through one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from server.engine.params import SamplingParams

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def align_vocab(logits: mx.array, vocab_size: int) -> mx.array:
    """The first `vocab_size` entries of the last axis; padded with -inf if there are fewer.

    Target and draft embeddings may be padded to different sizes beyond the tokenizer's
    vocabulary (e.g. 152064 vs 151936); ids past the tokenizer are never valid tokens.
    """
    size = logits.shape[-1]
    if size == vocab_size:
        return logits
    if size > vocab_size:
        return logits[..., :vocab_size]
    pad = mx.full((*logits.shape[:-1], vocab_size - size), -mx.inf, dtype=logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)


def normalize(logits: mx.array) -> mx.array:
    """Log-probabilities from logits, as `mlx_lm` yields them."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class LogitsPipeline:
    """Processes raw model logits into what the sampler draws from, identically for both models.

    `process` -> aligned, processed logits (what `mlx_lm` turns into the yielded logprobs);
    `scaled` -> filtered log-probabilities divided by the temperature (temperature > 0 only);
    `probs` / `sample` / `greedy` -> the distribution, a sampled token, the argmax.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        vocab_size: int,
        logits_processors: Sequence[LogitsProcessor] | None = None,
    ):
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.logits_processors = list(logits_processors or ())
        self._filters = _filters(sampling, vocab_size)
        self._top_k = _top_k(sampling, vocab_size)

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    @property
    def needs_history(self) -> bool:
        return bool(self.logits_processors)

    def process(
        self, logits: mx.array, history: mx.array | None = None, extra: mx.array | None = None
    ) -> mx.array:
        """Align `logits` (rows, V_model) and apply the logits processors.

        Row i is conditioned on `history` (all tokens so far, the model's input included)
        followed by `extra[:i]` (the block's own draft tokens), as `mlx_lm` does row by row.
        """
        logits = align_vocab(logits, self.vocab_size)
        if not self.logits_processors:
            return logits
        rows = []
        for i in range(logits.shape[0]):
            tokens = history if extra is None or i == 0 else mx.concatenate([history, extra[:i]])
            row = logits[i : i + 1]
            for processor in self.logits_processors:
                row = processor(tokens, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def scaled(self, processed: mx.array) -> mx.array:
        """`mlx_lm`'s sampler input: filters on the log-probabilities, then 1/temperature
        (with XTC, the log of the mixture of its two outcomes)."""
        s = self.sampling
        logprobs = normalize(processed.astype(mx.float32))
        for apply_filter in self._filters:
            logprobs = apply_filter(logprobs)
        kept = self._top_k(logprobs) * (1.0 / s.temperature)
        if s.xtc_probability <= 0.0:
            return kept
        cut = self._top_k(xtc_cut(logprobs, s.xtc_threshold, s.xtc_special_tokens))
        cut = normalize(cut * (1.0 / s.temperature))
        if s.xtc_probability >= 1.0:
            return cut
        return mx.logaddexp(math.log1p(-s.xtc_probability) + normalize(kept),
                            math.log(s.xtc_probability) + cut)

    @staticmethod
    def probs(scaled: mx.array) -> mx.array:
        return mx.softmax(scaled, axis=-1)

    @staticmethod
    def sample(scaled: mx.array, key: mx.array | None = None) -> mx.array:
        """One token per row; `key` is the request's own (never MLX's global state)."""
        return mx.random.categorical(scaled, axis=-1, key=key)  # uint32, like the token ids

    @staticmethod
    def greedy_tokens(processed: mx.array) -> mx.array:
        return mx.argmax(processed, axis=-1)  # uint32


def apply_mask(processed: mx.array, allowed: mx.array | None) -> mx.array:
    """Tokens outside `allowed` (rows, V) bool get -inf: a grammar, or EOS held back."""
    if allowed is None:
        return processed
    return mx.where(allowed, processed, mx.array(-mx.inf, processed.dtype))


def xtc_cut(logprobs: mx.array, threshold: float, special: Sequence[int] = ()) -> mx.array:
    """`mlx_lm`'s XTC when its coin says apply: every token above `threshold` but the least
    likely of them gets -inf (none with fewer than two above it), `special` tokens excepted."""
    probs = mx.softmax(logprobs, axis=-1)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    cut = probs > least
    if special:
        cut[..., list(special)] = False
    return mx.where(cut, -mx.inf, logprobs)


def _filters(sampling: SamplingParams, vocab_size: int) -> list[Callable[[mx.array], mx.array]]:
    """The filters `mlx_lm.sample_utils.make_sampler` chains before XTC, in its order."""
    filters = []
    if 0.0 < sampling.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, sampling.top_p))
    if sampling.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, sampling.min_p))
    return filters


def _top_k(sampling: SamplingParams, vocab_size: int) -> Callable[[mx.array], mx.array]:
    """`make_sampler`'s last filter (after XTC), or nothing."""
    if 0 < sampling.top_k < vocab_size:
        return lambda x: apply_top_k(x, sampling.top_k)
    return lambda x: x
