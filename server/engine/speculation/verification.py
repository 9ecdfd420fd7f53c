"""Verification of a draft block: pure functions on one request's (k[+1], V) arrays.

- `count_exact_matches`: `mlx_lm`'s rule (greedy, or `acceptance: exact`): accept while the
  target's own token equals the draft's; the target's tokens are then the output.
- `verify_rejection`: speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a draft
  token x is accepted with probability min(1, p(x)/q(x)); a rejection resamples from
  norm(max(0, p - q)), so the output follows the target's distribution p whatever the draft.

Randomness comes from the caller's key (one per request), never from MLX's global state.
"""

from __future__ import annotations

import mlx.core as mx

# Below this total residual mass a rejection can only come from rounding (p == q): resample p.
RESIDUAL_MASS_EPS = 1e-6


def accept_draft_tokens(p_x: mx.array, q_x: mx.array, u: mx.array) -> mx.array:
    """Speculative sampling's test, u < p(x)/q(x), written without dividing by q(x)."""
    return u * q_x < p_x


def count_exact_matches(target_tokens: list[int], draft_tokens: list[int]) -> int:
    """Accept while the target's own token equals the draft's (`mlx_lm`'s rule)."""
    n = 0
    for target_token, draft_token in zip(target_tokens, draft_tokens, strict=False):
        if target_token != draft_token:
            break
        n += 1
    return n


def verify_rejection(
    target_probs: mx.array,
    draft_probs: mx.array | None,
    draft_tokens: mx.array,
    key: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Speculative sampling: the output follows `target_probs` whatever the draft.

    target_probs (..., k+1, V); draft_probs (..., k, V), or None for a deterministic drafter
    (q one-hot: accept with probability p(x), resample from p with x removed);
    draft_tokens (..., k). Returns (num_accepted (...), tokens (..., k+1)) where
    tokens[..., :n] are the accepted drafts and tokens[..., n] the corrected or bonus token.
    """
    key_u, key_c = mx.random.split(key) if key is not None else (None, None)
    k = draft_tokens.shape[-1]
    if k == 0:
        tokens = mx.random.categorical(mx.log(target_probs), axis=-1, key=key_c)
        return mx.zeros(draft_tokens.shape[:-1], mx.int32), tokens.astype(draft_tokens.dtype)
    drafts = draft_tokens[..., None]
    p_x = mx.take_along_axis(target_probs[..., :k, :], drafts, axis=-1)[..., 0]
    q_x = mx.ones_like(p_x) if draft_probs is None else _take_tokens(draft_probs, drafts)
    u = mx.random.uniform(shape=p_x.shape, key=key_u)
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
    next_token = mx.random.categorical(mx.log(residual), axis=-1, key=key_c)
    next_token = next_token.astype(draft_tokens.dtype)

    positions = mx.arange(k + 1)
    padded = mx.concatenate([draft_tokens, next_token[..., None]], axis=-1)
    tokens = mx.where(positions == num_accepted[..., None], next_token[..., None], padded)
    return num_accepted, tokens


def _take_tokens(probs: mx.array, tokens: mx.array) -> mx.array:
    return mx.take_along_axis(probs, tokens, axis=-1)[..., 0]


def _take_row(probs: mx.array, index: mx.array) -> mx.array:
    """probs (..., R, V), index (...) -> probs[..., index, :] (..., V)."""
    return mx.take_along_axis(probs, index[..., None, None], axis=-2)[..., 0, :]
