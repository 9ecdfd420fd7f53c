"""The one decoding path: a round for every decoding request at once.

Plain decoding is speculation with k = 0. Each round:

1. drafts: the draft model proposes for every row that drafts with it this round, in one
   batched forward per draft position (rows whose pending context differs in length are fed
   right-padded and realigned; rows of the draft batch that do not draft with it this round
   catch up on their context then); prompt lookup and suffix drafting propose on the host; a
   grammar masks every drafted token;
2. one target forward over every row's last token plus its drafts, (B, 1 + K);
3. per row, the same logits pipeline (vocabulary alignment, penalties on prompt + output,
   grammar and EOS masks, top-k/top-p/min-p, temperature) and verification: exact matching
   when greedy (or `acceptance: exact`), speculative sampling otherwise, with the request's own
   random key; greedy rows with nothing between logits and argmax share one argmax over the
   batch; one host sync for the whole batch;
4. caches keep what each row accepted; each row emits its tokens.

Penalties (repetition, presence, frequency, logit bias) see the prompt and every token
generated so far, plus the block's own earlier drafts when verifying: one rule for all paths,
the one `mlx_lm.generate_step` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from server.engine.kv.batch import ModelBatch
from server.engine.scheduling.sampling import align_vocab, apply_mask, normalize
from server.engine.scheduling.sequence import Sequence
from server.engine.speculation.candidates import HOST_DRAFTERS
from server.engine.speculation.cost_model import DrafterRates
from server.engine.speculation.drafting import confident_count
from server.engine.speculation.verification import count_exact_matches, verify_rejection

# The most pending context a row feeds the draft per round. A row the draft fell behind on
# (15 rows that had not drafted for 90 tokens, when their batch shrank) was fed all of it in
# one forward: every stream stalled 0.68 s, against a 0.065 s round (generated pair).
CATCH_UP_WIDTH = 8


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: mx.array | None = None  # (count, V) draft distribution q; None: deterministic
    masks: list[np.ndarray | None] | None = None  # grammar masks at positions 0..count
    by_model: bool = False  # drafted by the draft model (whose cache then holds the tokens)


@dataclass
class RoundResult:
    """What one row got from a round (for metrics)."""

    proposed: int
    accepted: int
    drafter: str = ""  # whose tokens they were: model, prompt_lookup, prediction or forced
    emitted: int = 0  # tokens the row got: accepted + 1, less those past its end


# -- masks -----------------------------------------------------------------------------------


def _allowed_rows(seq: Sequence, positions: int, grammar: list | None, vocab: int,
                  ahead: int = 0):
    """(positions, V) bool mask, or None: grammar masks and ending tokens held back (ignore_eos,
    min_tokens), for the positions that start `ahead` tokens after the output so far."""
    start = len(seq.output) + ahead
    banned = [seq.banned_at(start + j) for j in range(positions)]
    if grammar is not None and all(g is None for g in grammar):
        grammar = None  # a constraint that masks nothing here (a lazy grammar not yet on)
    if grammar is None and not any(banned):
        return None
    rows = np.ones((positions, vocab), dtype=bool)
    for j in range(positions):
        if grammar is not None and grammar[j] is not None:
            g = grammar[j][:vocab]
            rows[j, : len(g)] = g
            rows[j, len(g):] = False
        for e in banned[j]:
            if e < vocab:
                rows[j, e] = False
    return mx.array(rows)


def _history(seq: Sequence) -> mx.array | None:
    return mx.array(seq.context, mx.uint32) if seq.pipeline.needs_history else None


def _choose(seq: Sequence, processed: mx.array, want_probs: bool):
    """(token (1,), q (1, V) or None) from one processed row, with the request's key."""
    pipeline = seq.pipeline
    if pipeline.greedy:
        return pipeline.greedy_tokens(processed), None
    scaled = pipeline.scaled(processed)
    token = pipeline.sample(scaled, seq.next_key())
    return token, (pipeline.probs(scaled) if want_probs else None)


# -- drafting --------------------------------------------------------------------------------


def _draft_with_model(draft: ModelBatch, ks: dict[int, int]) -> tuple[dict[int, Proposal], int]:
    """Batched drafting for every row of the draft batch; rows with k = 0 just catch up.

    The first forward feeds each row's pending context, at most `CATCH_UP_WIDTH` tokens of it:
    a row further behind (it did not draft for many rounds) is fed that much of its backlog
    and drafts in a later round. Each row's `draft_pending` is left with what was not fed."""
    rows = draft.rows
    pending = [r.draft_pending for r in rows]
    width = min(max(len(p) for p in pending), CATCH_UP_WIDTH)
    ks = {id(r): ks.get(id(r), 0) if len(p) <= width else 0
          for r, p in zip(rows, pending, strict=True)}
    steps = max(ks.values())
    fed = [p[:width] for p in pending]
    inputs = mx.array([f + [0] * (width - len(f)) for f in fed], mx.uint32)
    logits = draft.forward(inputs, valid=[len(f) for f in fed])  # kept whole: not drafts
    last = mx.array([len(f) - 1 for f in fed])
    logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # (B, V)
    for r, f in zip(rows, fed, strict=True):
        r.draft_pending = r.draft_pending[len(f):]

    vocab = rows[0].pipeline.vocab_size
    tokens = [[] for _ in rows]
    probs = [[] for _ in rows]
    masks: list[list | None] = [[] if r.constraint is not None else None for r in rows]
    consumed = [0] * len(rows)
    confidence = [[] for _ in rows]  # the draft's top probability per step (draft_p_min)
    run = 0
    for step in range(steps):
        chosen = []
        for i, seq in enumerate(rows):
            want_probs = (not seq.pipeline.greedy
                          and seq.params.speculation.acceptance == "rejection")
            history = _history(seq)
            if history is not None and tokens[i]:
                history = mx.concatenate([history, mx.concatenate(tokens[i])])
            processed = seq.pipeline.process(logits[i : i + 1], history)
            grammar = None
            if seq.constraint is not None:
                grammar = [seq.constraint.allowed()]
                masks[i].append(grammar[0])
            allowed = _allowed_rows(seq, 1, grammar, vocab, ahead=step)
            processed = apply_mask(processed, allowed)
            token, q = _choose(seq, processed, want_probs)
            if _p_min(seq) > 0:
                confidence[i].append(_top_probability(seq, processed))
            if seq.constraint is not None:
                mx.eval(token)
                consumed[i] += seq.constraint.consume(token.tolist())
            tokens[i].append(token.astype(mx.uint32))
            probs[i].append(q)
            chosen.append(tokens[i][-1])
        run = step + 1
        if step + 1 < steps:
            if _all_stopped(rows, ks, confidence, run):
                break
            logits = draft.forward(mx.concatenate(chosen)[:, None])[:, -1]
    flat = [t for row in tokens for t in row] + [c for row in confidence for c in row]
    if flat:
        mx.eval(flat)
    proposals = {}
    for i, seq in enumerate(rows):
        k = _confident(seq, confidence[i], min(ks.get(id(seq), 0), run))
        drafted = [int(t.item()) for t in tokens[i][:k]]
        if seq.constraint is not None:
            masks[i] = masks[i][:k]
            seq.constraint.rollback(consumed[i])
        q = mx.concatenate(probs[i][:k]) if k and probs[i][0] is not None else None
        proposals[id(seq)] = Proposal(drafted, q, masks[i], by_model=True)
    return proposals, run


def _confident(seq: Sequence, confidence: list[mx.array], k: int) -> int:
    """How many of the row's first k draft tokens it proposes: those before the first one the
    draft gives less than its draft_p_min (all k without a cut-off)."""
    return confident_count((c.item() for c in confidence), k, _p_min(seq))


def _all_stopped(rows: list[Sequence], ks: dict[int, int], confidence: list[list],
                 drafted: int) -> bool:
    """True when no row keeps what another draft step would give it: each has its k tokens or
    one under its draft_p_min. Reads the confidences back (a sync per step), so only when some
    row has a draft_p_min."""
    if not any(_p_min(seq) > 0 for seq in rows):
        return False
    mx.eval([c[-1] for c in confidence if c])
    return all(_confident(seq, confidence[i], ks.get(id(seq), 0)) <= drafted
               for i, seq in enumerate(rows))


def _p_min(seq: Sequence) -> float:
    return seq.params.speculation.draft_p_min


def _top_probability(seq: Sequence, processed: mx.array) -> mx.array:
    if seq.pipeline.greedy:
        return mx.exp(normalize(processed.astype(mx.float32)).max())
    return seq.pipeline.probs(seq.pipeline.scaled(processed)).max()


def _lookup(seq: Sequence, k: int) -> Proposal:
    """The first k tokens of what `Sequence.plan_round` found (prompt lookup's, suffix
    drafting's, a prediction's, forced ones), as far as a grammar allows."""
    drafted = seq.looked_up[:k]
    masks = None
    if seq.constraint is not None and drafted:
        masks = []
        valid = 0
        for token in drafted:
            masks.append(seq.constraint.allowed())
            if seq.constraint.consume([token]) != 1:
                masks.pop()
                break
            valid += 1
        seq.constraint.rollback(valid)
        drafted = drafted[:valid]
    return Proposal(drafted, None, masks)


def _finish_grammar_masks(seq: Sequence, proposal: Proposal) -> list | None:
    """The grammar's masks at every verified position: along the draft, then after it."""
    if seq.constraint is None:
        return None
    masks = list(proposal.masks or [])
    consumed = seq.constraint.consume(proposal.tokens) if proposal.tokens else 0
    masks = masks[: len(proposal.tokens)]
    masks.append(seq.constraint.allowed() if consumed == len(proposal.tokens) else None)
    seq.constraint.rollback(consumed)
    return masks


# -- the round -------------------------------------------------------------------------------


def decode_round(target: ModelBatch, draft: ModelBatch | None,
                 ks: dict[int, int], rates: DrafterRates | None = None) -> dict[int, RoundResult]:
    """One round for every row of `target`; `ks[id(seq)]` is how many tokens each drafts;
    each drafting row's acceptance is recorded (on the row, and in `rates` when given).

    Returns each row's proposed/accepted counts; rows that finished have `finish_reason`.
    """
    rows = target.rows
    proposals: dict[int, Proposal] = {}
    draft_steps = 0
    if draft is not None and len(draft):
        model_ks = {id(r): ks.get(id(r), 0) for r in draft.rows if r.round_drafter == "model"}
        if any(model_ks.values()):
            proposals, draft_steps = _draft_with_model(draft, model_ks)
    for seq in rows:
        if seq.round_drafter in HOST_DRAFTERS and seq.drafter is not None:
            proposals[id(seq)] = _lookup(seq, ks.get(id(seq), 0))
    props = [proposals.get(id(seq), Proposal()) for seq in rows]

    width = max(len(p.tokens) for p in props)
    inputs = mx.array(
        [[seq.last_token, *p.tokens] + [0] * (width - len(p.tokens))
         for seq, p in zip(rows, props, strict=True)],
        mx.uint32,
    )
    logits = target.forward(inputs)

    pending = _verify_rows(rows, props, logits)

    results, kept, draft_kept = {}, [], {}
    for seq, p, v in zip(rows, props, pending, strict=True):
        n, tokens = v.outcome(p.tokens)
        emit = tokens[: n + 1][: max(seq.remaining, 0)]
        if ks.get(id(seq), 0) > 0:
            seq.counters.record_round(len(p.tokens), by_model=p.by_model)
            seq.schedule.update(ks.get(id(seq), 0), len(p.tokens), n)
            if p.tokens:
                tried = seq.record_acceptance(len(p.tokens), n)
                if rates is not None:
                    rates.record(seq.drafted_by, *tried)
            for j in range(n):
                seq.accepted_per_position[j] += 1
        results[id(seq)] = RoundResult(len(p.tokens), n, seq.drafted_by if p.tokens else "")
        emitted = 0
        for j, token in enumerate(emit):
            if seq.constraint is not None:  # before `emit`, which asks if the grammar is done
                seq.constraint.consume([token])
            from_draft = j < n
            if from_draft:
                seq.count_accepted()
            emitted += 1
            if seq.emit(token, from_draft, v.logprobs[j] if v.logprobs is not None else None):
                break
        results[id(seq)].emitted = emitted
        # The cache keeps the round's input and the emitted drafts: exactly the context but
        # its last token (a row that stopped early drops the drafts past its end).
        kept.append(emitted)
        _settle_draft(seq, draft, draft_steps, n if p.by_model else 0, emit[:emitted],
                      draft_kept)
    target.keep(width + 1, kept)
    if draft_steps:
        fed = draft_steps - 1
        draft.keep(fed, [draft_kept[id(r)] for r in draft.rows])
    return results


def _verify_rows(rows: list[Sequence], props: list[Proposal], logits: mx.array) -> list:
    """Every row's `_Verified`, read back with one host sync. Plain greedy rows (no penalties,
    grammar, EOS mask or logprobs) share one argmax over their logits; the others get their own
    pipeline graph (`_verify_row`)."""
    plain = [i for i, seq in enumerate(rows) if _plain_greedy(seq)]
    pending: list = [None] * len(rows)
    if plain:
        index = mx.array(plain) if len(plain) < len(rows) else None
        chosen = logits if index is None else logits[index]
        shared = _SharedArgmax(mx.argmax(align_vocab(chosen, rows[0].pipeline.vocab_size), -1))
        for j, i in enumerate(plain):
            pending[i] = _Verified(shared=shared, shared_row=j)
    for i, (seq, p) in enumerate(zip(rows, props, strict=True)):
        if pending[i] is None:
            pending[i] = _verify_row(seq, p, logits[i, : len(p.tokens) + 1])
    arrays = [a for v in pending if v.shared is None for a in v.arrays()]
    mx.eval([shared.tokens, *arrays] if plain else arrays)
    return pending


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy with nothing between the logits and the argmax: no logits processors, grammar,
    logprobs, or EOS held back at the next position (the next `k + 1` follow: min_tokens only
    ever holds back a prefix of the output)."""
    pipeline = seq.pipeline
    return (pipeline.greedy and not pipeline.needs_history and seq.constraint is None
            and not seq.params.logprobs and not seq.banned_at(len(seq.output)))


class _SharedArgmax:
    """The argmax (rows, width) of a round's plain greedy rows, read back once."""

    def __init__(self, tokens: mx.array):
        self.tokens = tokens
        self._host: list | None = None

    def row(self, j: int) -> list[int]:
        if self._host is None:
            self._host = self.tokens.tolist()
        return self._host[j]


def first_token(seq: Sequence, logits: mx.array) -> bool:
    """The request's first token from its prefill's last logits (V,); True when finished."""
    verified = _verify_row(seq, Proposal(), logits[None])
    mx.eval(verified.arrays())
    _, tokens = verified.outcome([])
    if seq.constraint is not None:
        seq.constraint.consume(tokens[:1])
    logprobs = verified.logprobs[0] if verified.logprobs is not None else None
    return seq.emit(tokens[0], False, logprobs)


def _settle_draft(seq, draft, draft_steps, n, emit, draft_kept) -> None:
    """Bring the row's draft bookkeeping up to date with what the round emitted; `n` counts
    the accepted tokens the draft model proposed (and so has in its cache)."""
    if not seq.uses_draft_model or draft is None or seq not in draft:
        return  # the draft never saw this row: it catches up on the whole context if it drafts
    keep_drafts = 0
    if draft_steps:
        # The draft's cache now holds what it was fed of `pending` (the rest is still pending)
        # and the drafts it fed after (all but the last).
        keep_drafts = min(n, draft_steps - 1, len(emit))
        draft_kept[id(seq)] = keep_drafts
    seq.draft_pending = seq.draft_pending + emit[keep_drafts:]


@dataclass
class _Verified:
    """One row's lazily computed verification, read back after the round's single eval."""

    greedy_tokens: mx.array | None = None
    num_accepted: mx.array | None = None
    tokens: mx.array | None = None
    logprobs: mx.array | None = None
    draft_tokens: mx.array | None = None
    shared: _SharedArgmax | None = None  # a plain greedy row's tokens: row `shared_row` of it
    shared_row: int = 0

    def arrays(self):
        return [a for a in (self.greedy_tokens, self.num_accepted, self.tokens, self.logprobs)
                if a is not None]

    def outcome(self, drafted: list[int]) -> tuple[int, list[int]]:
        if self.shared is not None:
            own = self.shared.row(self.shared_row)[: len(drafted) + 1]
            return count_exact_matches(own, drafted), own
        if self.greedy_tokens is not None:
            own = self.greedy_tokens.tolist()
            return count_exact_matches(own, drafted), own
        return int(self.num_accepted.item()), self.tokens.tolist()


def _verify_row(seq: Sequence, proposal: Proposal, logits: mx.array) -> _Verified:
    count = len(proposal.tokens)
    drafts = mx.array(proposal.tokens, mx.uint32)
    history = _history(seq)
    processed = seq.pipeline.process(logits, history, drafts if count else None)
    grammar = _finish_grammar_masks(seq, proposal)
    allowed = _allowed_rows(seq, count + 1, grammar, seq.pipeline.vocab_size)
    processed = apply_mask(processed, allowed)
    logprobs = normalize(processed) if seq.params.logprobs else None
    pipeline = seq.pipeline
    exact = pipeline.greedy or seq.params.speculation.acceptance == "exact"
    if pipeline.greedy:
        return _Verified(greedy_tokens=pipeline.greedy_tokens(processed), logprobs=logprobs)
    if exact:
        own = pipeline.sample(pipeline.scaled(processed), seq.next_key())
        return _Verified(greedy_tokens=own, logprobs=logprobs)
    probs = pipeline.probs(pipeline.scaled(processed))
    n, tokens = verify_rejection(probs, proposal.probs, drafts, seq.next_key())
    return _Verified(num_accepted=n, tokens=tokens, logprobs=logprobs)
