"""What a decoding round costs on this machine, and how many tokens each row should draft.

A round feeds the target (rows, 1 + K): every row its last token plus K positions, padded to the
longest draft. Its time depends on rows x tokens and on the machine (a 2-core CPU's matmuls grow
with every token fed; a GPU's barely do until the batch is large), so it is measured, not
guessed: `measure_forward_times` times the target's forward on a small grid of (rows, tokens)
(`ForwardTimes.at` interpolates between grid points), once per model and machine, and
`cached_forward_times` keeps the table in a file.

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

import hashlib
import json
import logging
import math
import os
import platform
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

PROFILE_ROWS = (1, 2, 4, 8, 16, 32)
PROFILE_TOKENS = (1, 2, 3, 5)
PROFILE_CONTEXT = 64  # tokens already in each row's cache while timing
PROFILE_REPS = 3  # timed forwards per cell (after one warm-up); the fastest is kept
# A stored table is checked at start on these cells (`measured_busy`), and measured again when
# all of them now take less than BUSY_RATIO of its times.
SPOT_CHECK_ROWS = (1, 8)
SPOT_CHECK_TOKENS = (1, 2)
BUSY_RATIO = 0.75
# A row whose drafter has not been seen yet is expected to accept at this rate, weighted as
# this many trials, until its own rounds say otherwise.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) \
    / "mlx-spec-server" / "forward-times"


@dataclass(frozen=True)
class ForwardTimes:
    """Seconds of one forward of (rows, tokens) inputs, measured on a grid and interpolated
    (bilinearly; linearly past the last grid point, flat below the first)."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # seconds[i][j]: rows[i] x tokens[j]

    def at(self, rows: int, tokens: int) -> float:
        i, u = _segment(self.rows, rows)
        j, v = _segment(self.tokens, tokens)
        s = self.seconds
        top = s[i][j] + (s[i][j + 1] - s[i][j]) * v
        bottom = s[i + 1][j] + (s[i + 1][j + 1] - s[i + 1][j]) * v
        return max(top + (bottom - top) * u, 0.0)

    def per_token(self) -> float:
        """Seconds per token of the largest forward measured: about what prefill costs per token
        (larger prefill forwards cost a little less per token)."""
        return self.seconds[-1][-1] / (self.rows[-1] * self.tokens[-1])

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "tokens": list(self.tokens),
                "seconds": [list(r) for r in self.seconds]}

    @classmethod
    def from_json(cls, data: dict) -> ForwardTimes:
        return cls(tuple(data["rows"]), tuple(data["tokens"]),
                   tuple(tuple(float(x) for x in r) for r in data["seconds"]))


def _segment(grid: tuple[int, ...], x: int) -> tuple[int, float]:
    """(i, t): x lies at fraction t between grid[i] and grid[i + 1] (t > 1 past the end; t = 0
    before the start)."""
    if len(grid) == 1:
        raise ValueError("a forward-time grid needs at least two points per axis")
    i = min(max(bisect_right(grid, x) - 1, 0), len(grid) - 2)
    t = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, max(t, 0.0)


def monotone(seconds: list[list[float]]) -> list[list[float]]:
    """The table made non-decreasing along both axes (more rows or tokens never cost less; a
    noisy machine sometimes measures so)."""
    out = [list(r) for r in seconds]
    for i, row in enumerate(out):
        for j in range(len(row)):
            if j:
                row[j] = max(row[j], row[j - 1])
            if i:
                row[j] = max(row[j], out[i - 1][j])
    return out


def measure_forward_times(model: nn.Module, rows=PROFILE_ROWS, tokens=PROFILE_TOKENS,
                          context: int = PROFILE_CONTEXT, reps: int = PROFILE_REPS) -> ForwardTimes:
    """The table of `model`'s forward times (`time_forwards`)."""
    return time_forwards(model, rows, tokens, context, reps)


def time_forwards(model: nn.Module, rows, tokens, context: int = PROFILE_CONTEXT,
                  reps: int = PROFILE_REPS) -> ForwardTimes:
    """Time `model`'s forward of (r, t) inputs after `context` cached tokens, for every r, t.

    The cells take turns, rep after rep, and each keeps its fastest time: a machine shared
    with other work slows some forwards down, and then slows every cell alike, not the ones
    measured while it was busy."""
    from server.engine.kv.batch import new_cache, prefill_rows
    from server.engine.kv.layers import kv_leaves, state_leaves

    caches = {r: prefill_rows(model, [new_cache(model) for _ in range(r)],
                              [[1 + (i + n) % 7 for n in range(context)] for i in range(r)])[1]
              for r in rows}
    best = {(r, t): float("inf") for r in rows for t in tokens}
    for rep in range(reps + 1):  # the first is a warm-up
        for r in rows:
            for t in tokens:
                x = mx.ones((r, t), mx.uint32)
                states = [(c, c.snapshot()) for c in state_leaves(caches[r])]
                start = time.perf_counter()
                mx.eval(model(x, cache=caches[r]))
                elapsed = time.perf_counter() - start
                for c in kv_leaves(caches[r]):
                    c.trim(t)
                for c, state in states:  # a recurrent state cannot be trimmed: put it back
                    c.restore(state)
                if rep:
                    best[r, t] = min(best[r, t], elapsed)
    table = [[best[r, t] for t in tokens] for r in rows]
    return ForwardTimes(tuple(rows), tuple(tokens), tuple(map(tuple, monotone(table))))


def measured_busy(model: nn.Module, table: ForwardTimes) -> bool:
    """Whether `table` was measured while the machine was busy: a spot check of a few of its
    cells now (`SPOT_CHECK_ROWS` x `SPOT_CHECK_TOKENS`) is faster in every one by more than
    `BUSY_RATIO`. A table measured beside two busy processes put forwards at 2-7x their time
    and made extra positions look nearly free: the server drafted in batches of 16 and 32 rows
    where that made 0.8x the tokens per second of not drafting. A check slower than the table
    keeps it (the machine is busy now; the table is the better measurement)."""
    check = time_forwards(model, SPOT_CHECK_ROWS, SPOT_CHECK_TOKENS, reps=2)
    return all(check.at(r, t) < BUSY_RATIO * table.at(r, t)
               for r in SPOT_CHECK_ROWS for t in SPOT_CHECK_TOKENS)


def machine_key(model_path: str, variant: str = "") -> str:
    """Which model (loaded how: `variant`) on which machine a table belongs to."""
    facts = [str(Path(model_path).resolve()), variant, platform.node(), platform.machine(),
             platform.processor(), str(os.cpu_count()), mx.__version__, str(mx.default_device())]
    weights = Path(model_path) / "model.safetensors"
    if weights.exists():
        facts.append(str(weights.stat().st_mtime_ns))
    return hashlib.sha256("|".join(facts).encode()).hexdigest()[:16]


def cached_forward_times(model: nn.Module, model_path: str, variant: str = "",
                         cache_dir: Path | None = DEFAULT_CACHE_DIR) -> ForwardTimes:
    """The model's table from `cache_dir`, measured (and stored) when missing, or when a spot
    check finds the stored one measured while the machine was busy (`measured_busy`)."""
    key = machine_key(model_path, variant)
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            cached = ForwardTimes.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable forward-time table %s", path)
        else:
            if not measured_busy(model, cached):
                return cached
            log.info("%s's stored forward times are slower than the machine is now (measured"
                     " while it was busy): measuring them again", model_path)
    start = time.perf_counter()
    times = measure_forward_times(model)
    log.info("measured %s's forward times in %.1f s", model_path, time.perf_counter() - start)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")  # readers never see half
            partial.write_text(json.dumps(times.to_json()))
            partial.replace(path)
        except OSError:
            log.warning("could not store the forward-time table in %s", path)
    return times


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


def kit_costs(kit, cache_dir: Path | None = DEFAULT_CACHE_DIR) -> StepCosts:
    """The forward times of a `ModelKit`'s target and draft (cached per model and machine)."""
    def times(loaded):
        variant = f"{kit.dtype}|fused={kit.fuse}"
        return cached_forward_times(loaded.model, loaded.path, variant, cache_dir)

    return StepCosts(times(kit.target), times(kit.draft) if kit.draft is not None else None)


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
                         costs: StepCosts) -> dict[int, int]:
    """Each row's k (keyed by `RowOption.key`): the (K, M) with the most expected tokens per
    second, where lookup rows draft min(K, cap), model rows min(M, cap) and forced rows their
    cap. `batch_rows` rows take part in the target forward, `draft_rows` in the draft's.

    In a batch of `MARGIN_FROM_ROWS` or more, drafting must beat plain decoding by
    `BATCH_DRAFT_MARGIN`: it has costs a round's time does not show (the draft's prefill and
    catch-ups, its cache), and the calibrated round times are themselves a few percent off on
    a busy machine."""
    chosen, _, _ = _best_round(options, batch_rows, draft_rows, costs)
    return {o.key: k for o, k in zip(options, chosen, strict=True) if k > 0}


def _best_round(options: list[RowOption], batch_rows: int, draft_rows: int,
                costs: StepCosts) -> tuple[list[int], float, float]:
    """`choose_draft_lengths`' choice as each row's k, with its expected tokens per second and
    those of the round with width 0 (plain decoding, but for forced rows)."""
    gains = [[expected_accepted(o.acceptance, k) for k in range(o.cap + 1)] for o in options]
    most = max((o.cap for o in options), default=0)
    best, best_rate, best_score, plain = [], 0.0, -1.0, 0.0
    for width in range(most + 1):
        for model_k in range(width + 1):
            ks = _lengths(options, width, model_k)
            rate = _tokens_per_second(options, gains, ks, batch_rows, draft_rows, costs)
            score = rate
            if width == 0:
                plain = rate
                if batch_rows >= MARGIN_FROM_ROWS:
                    score *= 1 + BATCH_DRAFT_MARGIN
            if score > best_score + 1e-12:
                best, best_rate, best_score = ks, rate, score
    return best, best_rate, plain


def _lengths(options: list[RowOption], width: int, model_k: int) -> list[int]:
    return [o.cap if o.forced else min(model_k if o.by_model else width, o.cap) for o in options]


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
    [--remeasure]`:
    print the forward-time tables the server uses (measuring and caching them if needed)."""
    import argparse

    from server.engine.models.model_kit import ModelKit, load_model

    p = argparse.ArgumentParser(prog="python -m server.engine.speculation.cost_model",
                                description=main.__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--remeasure", action="store_true", help="Measure again; replace the cache.")
    args = p.parse_args(argv)
    kit = ModelKit(load_model(args.model, dtype=args.dtype), dtype=args.dtype)
    if args.draft_model:
        kit.load_draft(args.draft_model)
    if args.remeasure:
        for loaded in filter(None, (kit.target, kit.draft)):
            key = machine_key(loaded.path, f"{kit.dtype}|fused={kit.fuse}")
            (DEFAULT_CACHE_DIR / f"{key}.json").unlink(missing_ok=True)
    costs = kit_costs(kit)
    _print_table("target", costs.target)
    if costs.draft is not None:
        _print_table("draft", costs.draft)


if __name__ == "__main__":
    main()
