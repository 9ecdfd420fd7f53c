"""What a decoding round costs on this machine, and how many tokens each row should draft.

A round feeds the target (rows, 1 + K): every row its last token plus K positions, padded to the
longest draft. Its time is read from the target's and the draft's forward times as a function
of rows x tokens (`forward_times.ForwardTimes`): a prior at start, then the tables measured in
idle moments, once per model and machine (`forward_source`).

`choose_draft_lengths` then picks the round's draft lengths: for each candidate width K (and
draft-model length M <= K) each row drafts min(K, its cap) (min(M, cap) with the draft model),
is expected to gain `expected_accepted(a, k)` tokens from its acceptance rate a, and the round
takes T_target(rows, 1 + width) + M x T_draft(draft rows, 1), times what measured rounds of the
kind (plain or drafting) took against that estimate (`RoundCalibration`). The choice with the
most expected tokens per second wins; k = 0 everywhere (plain decoding) is one of the
candidates. Prompt lookup costs no draft forward, so a repetitive row pays for its positions at
any batch size when the target's extra positions are cheap enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.speculation.forward_times import ForwardTimes

if TYPE_CHECKING:
    from server.engine.speculation.yield_learner import YieldLearner

# A row whose drafter has not been seen yet is expected to accept at this rate, weighted as
# this many trials, until its own rounds say otherwise.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0


def batch_bucket(rows: int) -> int:
    """The power of two at or below `rows` (1, 2, 4, 8, ...): batch sizes learned together."""
    return 1 << (max(rows, 1).bit_length() - 1)


class RoundCalibration:
    """How long rounds really take against the tables' estimate: per batch-size bucket and kind
    (drafting or plain), a decayed mean of measured / estimated seconds, shrunk towards 1 (the
    table) by `PRIOR_WEIGHT` pseudo-rounds. A round is more than its forwards (verification,
    sampling, the draft's cache, the host), and a drafting round more so: generated pair, 16
    rows, in process: plain rounds took 1.15x the table, drafting ones 1.30x, and drafting lost
    10% where the tables alone said it gained 2%.

    Every round decays both kinds' sums in its bucket, so a kind no longer chosen drifts back
    towards its prior and is tried again now and then: a factor measured at a busy moment does
    not rule a kind out for good."""

    DECAY = 0.995  # per round in the bucket: about the last two hundred count
    PRIOR_WEIGHT = 2.0

    def __init__(self):
        self._sums: dict[tuple[int, bool], list[float]] = {}  # [sum of ratios, rounds]

    def record(self, rows: int, drafting: bool, measured_s: float, estimated_s: float) -> None:
        if estimated_s <= 0:
            return
        bucket = batch_bucket(rows)
        for kind in (False, True):
            sums = self._sums.setdefault((bucket, kind), [0.0, 0.0])
            sums[0] *= self.DECAY
            sums[1] *= self.DECAY
        sums = self._sums[(bucket, drafting)]
        sums[0] += measured_s / estimated_s
        sums[1] += 1.0

    def factor(self, rows: int, drafting: bool) -> float:
        """Plain rounds' factor is shrunk towards the table (1), drafting rounds' towards plain
        rounds' factor: a machine slower than its table now is slower for both kinds. Towards
        1, drafting rounds not measured for a while looked cheap beside plain ones measured at
        1.5x (default pair, 31 rows: lookup rounds of 0.49 s against 0.24 s plain ones).

        Where drafting rounds run faster than the table says, the table is too slow for both
        kinds (measured while the machine was busy): plain rounds' prior is then drafting
        rounds' factor, not 1. With a table measured beside two busy processes, 16 rows
        drafted every round at 0.23x its time while plain rounds, never tried, kept 1x: 0.82x
        the tokens per second of not drafting."""
        prior = min(1.0, self._shrunk(rows, True, 1.0))
        plain = self._shrunk(rows, False, prior)
        return self._shrunk(rows, True, plain) if drafting else plain

    def _shrunk(self, rows: int, drafting: bool, prior: float) -> float:
        ratios, rounds = self._sums.get((batch_bucket(rows), drafting), (0.0, 0.0))
        return (ratios + self.PRIOR_WEIGHT * prior) / (rounds + self.PRIOR_WEIGHT)


@dataclass(frozen=True)
class StepCosts:
    """The tables a round's cost is read from: the target's, and the draft model's if any;
    and how far measured rounds are from them (`calibration`, updated as rounds run)."""

    target: ForwardTimes
    draft: ForwardTimes | None = None
    calibration: RoundCalibration = field(default_factory=RoundCalibration)

    def table_seconds(self, rows: int, width: int, model_k: int, draft_rows: int) -> float:
        """A round's forwards from the tables: the target's (rows, 1 + width), and model_k
        draft forwards of `draft_rows` rows."""
        seconds = self.target.at(rows, 1 + width)
        if model_k and self.draft is not None:
            seconds += model_k * self.draft.at(max(draft_rows, 1), 1)
        return seconds

    def round_seconds(self, rows: int, width: int, model_k: int, draft_rows: int) -> float:
        """What such a round is expected to take: its table time, calibrated."""
        return self.table_seconds(rows, width, model_k, draft_rows) * \
            self.calibration.factor(rows, width > 0)


# -- acceptance and the choice ---------------------------------------------------------------


def expected_accepted(a: float, k: int) -> float:
    """Expected accepted tokens of a k-token draft when each is accepted with probability a
    (given the ones before it were): a + a^2 + ... + a^k."""
    return sum(a ** j for j in range(1, k + 1))


def acceptance_rate(accepted: int, trials: int, prior: float = PRIOR_ACCEPTANCE,
                    weight: float = PRIOR_WEIGHT) -> float:
    """A row's per-token acceptance: accepted tokens over tokens tried (accepted ones, plus
    one per round that rejected), shrunk towards `prior` by `weight` pseudo-trials."""
    return (accepted + prior * weight) / (trials + weight)


def decision_rate(accepted: int, trials: int, prior: float, batch_rows: int) -> float:
    """The rate a row's k is chosen with: `hopeful_rate` alone (trying costs only this row),
    `acceptance_rate` in a batch, where every row pays for the widest draft's verify positions:
    there, 32 rows each hoping one standard error high made drafting look worth it when it was
    not (in-process, 32 streams: decoding 0.86x of plain decoding)."""
    rate = hopeful_rate if batch_rows <= 1 else acceptance_rate
    return rate(accepted, trials, prior)


def hopeful_rate(accepted: int, trials: int, prior: float = PRIOR_ACCEPTANCE,
                 weight: float = PRIOR_WEIGHT) -> float:
    """The rate decisions use: `acceptance_rate` plus one standard error (at most 0.99). A row
    with few rounds behind it gets the benefit of the doubt, so it drafts and gets measured;
    judged by its prior alone, a row that never drafted would never learn otherwise."""
    a = acceptance_rate(accepted, trials, prior, weight)
    return min(a + math.sqrt(a * (1 - a) / (trials + weight)), 0.99)


@dataclass(frozen=True)
class RowOption:
    """One row's drafting options this round."""

    key: int
    cap: int  # the most tokens it may draft (its adaptive k, the remaining tokens, the caps)
    acceptance: float
    by_model: bool  # drafts with the draft model (else prompt lookup: no draft forward)
    forced: bool = False  # drafts exactly `cap` whatever the cost (seeded sampling)
    fixed: bool = False  # drafts exactly `cap` in every round that drafts ("adaptive": false)
    requested: int = 0  # its cap before prompt lookup's match length limited it


# Generated pair, 16 rows, through the server: the calibrated tables put drafting 2.6% ahead
# of plain decoding, while its rounds really made 7% fewer tokens per second (0.118 s for 1.7
# tokens a row against 0.065 s for 1); at 4 and 8 rows the tables put it 18-30% ahead.
BATCH_DRAFT_MARGIN = 0.10
# From this many rows on. At 2 rows drafting made 9% more tokens per second than not drafting
# (two servers of the same engine, through HTTP, one run: 51.3 against 46.9 tok/s), but the
# margin turned it off whenever a row's measured acceptance dipped (2% of tokens drafted).
MARGIN_FROM_ROWS = 8


def choose_draft_lengths(options: list[RowOption], batch_rows: int, draft_rows: int,
                         costs: StepCosts, learner: YieldLearner | None = None
                         ) -> dict[int, int]:
    """Each row's k (keyed by `RowOption.key`): the (K, M) with the most expected tokens per
    second, where lookup rows draft min(K, cap), model rows min(M, cap) and forced rows their
    cap (fixed rows theirs, when the round drafts). `batch_rows` rows take part in the target
    forward, `draft_rows` in the draft's. With a `learner`, the expected tokens per second are
    its estimates (what each round shape measurably yielded), the tables' only its prior.

    In a batch of `MARGIN_FROM_ROWS` or more, drafting must beat plain decoding by
    `BATCH_DRAFT_MARGIN`, in the tables and in what the learner measured alike: it has costs a
    round's time does not show (the draft's prefill and catch-ups, its cache), and the
    calibrated round times are themselves a few percent off on a busy machine."""
    shapes = _round_shapes(options, batch_rows, draft_rows, costs)
    margin = _plain_margin(batch_rows)
    if learner is None:
        arm = _best_shape(shapes, margin)
    else:
        kind = "model" if any(o.by_model for o in options) else "lookup"
        arm = learner.choose(batch_bucket(batch_rows), kind,
                             {a: score for a, (_, score) in shapes.items()}, plain_margin=margin)
    chosen = shapes[arm][0]
    if learner is not None and any(k and (o.forced or o.fixed)
                                   for o, k in zip(options, chosen, strict=True)):
        learner.not_this_round()  # its yield is partly a row's own k's, not the arm's
    return {o.key: k for o, k in zip(options, chosen, strict=True) if k > 0}


PLAIN = (0, 0, 0)  # the shape of a round in which no row drafts


def round_shape(options: list[RowOption], ks: list[int]) -> tuple[int, int, int]:
    """A round's shape (an arm of `YieldLearner`): the width K and draft-model length M of the
    rows whose k is chosen (not forced or fixed), and whether any row drafts at all."""
    free = [(o, k) for o, k in zip(options, ks, strict=True) if not (o.forced or o.fixed)]
    return (max((k for _, k in free), default=0),
            max((k for o, k in free if o.by_model), default=0), int(any(ks)))


def _round_shapes(options: list[RowOption], batch_rows: int, draft_rows: int,
                  costs: StepCosts) -> dict[tuple[int, int, int], tuple[list[int], float]]:
    """Every distinct round the options allow (its shape -> each row's k, and its expected
    tokens per second from the tables)."""
    gains = [[expected_accepted(o.acceptance, k) for k in range(o.cap + 1)] for o in options]
    most = max((o.cap for o in options), default=0)
    shapes = {}
    for width in range(most + 1):
        for model_k in range(width + 1):
            ks = _lengths(options, width, model_k)
            shape = round_shape(options, ks)
            if shape not in shapes:
                shapes[shape] = (ks, _tokens_per_second(options, gains, ks, batch_rows,
                                                        draft_rows, costs))
    return shapes


def _plain_margin(batch_rows: int) -> float:
    """How much more plain decoding's tokens per second weigh in a batch this large."""
    return BATCH_DRAFT_MARGIN if batch_rows >= MARGIN_FROM_ROWS else 0.0


def _best_shape(shapes: dict, margin: float) -> tuple[int, int, int]:
    """The shape with the most tokens per second, plain decoding's raised by `margin`."""
    return max(shapes, key=lambda a: shapes[a][1] * (1 + margin if a == PLAIN else 1.0))


def _best_round(options: list[RowOption], batch_rows: int, draft_rows: int,
                costs: StepCosts) -> tuple[list[int], float, float]:
    """The tables' choice as each row's k, with its expected tokens per second and those of
    plain decoding (but for forced rows)."""
    shapes = _round_shapes(options, batch_rows, draft_rows, costs)
    plain = shapes[round_shape(options, _lengths(options, 0, 0))][1]
    ks, rate = shapes[_best_shape(shapes, _plain_margin(batch_rows))]
    return ks, rate, plain


def _lengths(options: list[RowOption], width: int, model_k: int) -> list[int]:
    return [o.cap if o.forced or (o.fixed and width > 0)
            else min(model_k if o.by_model else width, o.cap) for o in options]


def _tokens_per_second(options, gains, ks, batch_rows, draft_rows, costs: StepCosts) -> float:
    width = max(ks, default=0)
    model_k = max((k for o, k in zip(options, ks, strict=True) if o.by_model), default=0)
    tokens = batch_rows + sum(g[k] for g, k in zip(gains, ks, strict=True))
    return tokens / costs.round_seconds(batch_rows, width, model_k, draft_rows)


class DrafterRates:
    """The engine-wide acceptance of each drafter (decayed sums over every row's rounds): the
    prior a new row starts from, so that rows which have not drafted yet are judged by what
    their drafter achieves for the others."""

    DECAY = 0.99  # per recorded round: about the last hundred rounds count

    def __init__(self):
        self._sums: dict[str, list[float]] = {}

    def record(self, drafter: str, accepted: int, trials: int) -> None:
        sums = self._sums.setdefault(drafter, [0.0, 0.0])
        sums[0] = sums[0] * self.DECAY + accepted
        sums[1] = sums[1] * self.DECAY + trials

    def prior(self, drafter: str) -> float:
        accepted, trials = self._sums.get(drafter, (0.0, 0.0))
        return acceptance_rate(accepted, trials)


class DraftingShare:
    """How often the draft model drafted in recent rounds, per batch-size bucket: the share of
    rounds with a row that could draft with it in which some row did. A new row's draft
    prefill is repaid only in the rounds that draft (`prefill_repaid`'s `share`).

    Where drafting barely pays (generated pair, 16 rows: 5% faster rounds at k = 1), the
    choice flips with each row's measured acceptance: through HTTP, a wave of 16 got the
    draft's prefill (0.37 s of a 10 s run) and then drafted in 2 of its 96 rounds. With no
    rounds yet, rows are taken to draft (`PRIOR_WEIGHT` pseudo-rounds that did)."""

    DECAY = 0.98  # per recorded round in the bucket: about the last fifty count
    PRIOR_WEIGHT = 2.0

    def __init__(self):
        self._sums: dict[int, list[float]] = {}  # bucket: [rounds that drafted, rounds]

    def record(self, rows: int, drafted: bool) -> None:
        sums = self._sums.setdefault(batch_bucket(rows), [0.0, 0.0])
        sums[0] = sums[0] * self.DECAY + drafted
        sums[1] = sums[1] * self.DECAY + 1.0

    def share(self, rows: int) -> float:
        drafted, rounds = self._sums.get(batch_bucket(rows), (0.0, 0.0))
        return (drafted + self.PRIOR_WEIGHT) / (rounds + self.PRIOR_WEIGHT)


def prefill_repaid(saving: float | None, costs: StepCosts, prompt_tokens: int = 0,
                   max_tokens: int | None = None, share: float = 1.0) -> bool:
    """Whether a new row's draft prefill is likely to be repaid: drafting in its batch saves
    `saving` seconds per token (`drafting_saving`; None: the batch would not draft at all), and
    that, over the row's `max_tokens`, exceeds the draft's prefill of its `prompt_tokens`.

    Each row of the batch pays its own prefill (B x P x c seconds) to make the batch's tokens
    cheaper (B x R x (1/plain - 1/drafting) seconds for R tokens per row), so B cancels out.
    Generated pair at 32 rows: the tables expected drafting to gain about 7%, which over 96
    tokens saved less than the prefill of a 100-token prompt cost. Only the `share` of rounds
    that draft (`DraftingShare`) save anything."""
    if saving is None or max_tokens is None or costs.draft is None:
        return saving is not None
    return share * max_tokens * saving > prompt_tokens * costs.draft.per_token()


def drafting_saving(batch_rows: int, k: int, acceptance: float,
                    costs: StepCosts) -> float | None:
    """Seconds per token that `batch_rows` rows drafting up to k tokens with the draft model at
    `acceptance` save over plain decoding (`choose_draft_lengths`' choice); None when they
    would not draft at all. The same for every row of a batch: computed once per round."""
    options = [RowOption(i, k, acceptance, True) for i in range(batch_rows)]
    chosen, drafting, plain = _best_round(options, batch_rows, batch_rows, costs)
    return 1 / plain - 1 / drafting if any(chosen) else None


def _print_table(name: str, times: ForwardTimes) -> None:
    print(f"{name}: ms per forward (rows x tokens); plain decoding's limit, rows / t(rows, 1)")
    print("  rows " + "".join(f"{t:>9}" for t in times.tokens) + "   limit tok/s")
    for r, line in zip(times.rows, times.seconds, strict=True):
        cells = "".join(f"{s * 1e3:9.1f}" for s in line)
        print(f"  {r:>4} {cells}   {r / line[0]:9.1f}")


def main(argv: list[str] | None = None) -> None:
    """`python -m server.engine.speculation.cost_model --model DIR [--draft-model DIR]
    [--dtype D] [--dequantize auto|true|false] [--budget-s S] [--remeasure]`: print the
    forward-time tables the server uses, measuring (and storing) them now where none is
    stored; a stored one is spot-checked as at a start."""
    import argparse

    import yaml

    from server.engine.models.model_kit import ModelKit, load_model
    from server.engine.speculation.forward_source import CostSource, kit_variant
    from server.engine.speculation.forward_store import TableStore, machine_key

    p = argparse.ArgumentParser(prog="python -m server.engine.speculation.cost_model",
                                description=main.__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dequantize", default="auto", type=yaml.safe_load,
                   help="auto, true or false, as models.dequantize.")
    p.add_argument("--budget-s", type=float, default=None,
                   help="Machine time the measurement may take (default: no bound, the whole"
                   " grid; the server's is engine.cost_model_budget_s).")
    p.add_argument("--remeasure", action="store_true", help="Measure again; replace the cache.")
    args = p.parse_args(argv)
    kit = ModelKit(load_model(args.model, dtype=args.dtype, dequantize=args.dequantize),
                   dtype=args.dtype, dequantize=args.dequantize)
    if args.draft_model:
        kit.load_draft(args.draft_model)
    if args.remeasure:
        for loaded in filter(None, (kit.target, kit.draft)):
            path = TableStore().path(machine_key(loaded.path, kit_variant(kit, loaded)))
            path.unlink(missing_ok=True)
    source = CostSource(kit, budget_s=args.budget_s)
    source.finish()
    for times in source.models:
        _print_table(f"{times.role} ({times.origin.value})", times.table)


if __name__ == "__main__":
    main()
