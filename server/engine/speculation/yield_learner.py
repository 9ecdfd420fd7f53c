"""The draft length a round should use, learned from what each length actually yielded.

The cost model prices a round from forward-time tables and each row's acceptance; real rounds
cost more than that and unevenly so (verification, sampling, the draft's cache, the host:
generated pair, one stream, the tables chose k = 1-2 where k = 4 made 1.3x their tokens per
second). So the choice is learned from measured rounds: for each batch-size bucket and kind
of round (drafting with the draft model, or by lookup only), each arm - the round's width K
and draft-model length M (`cost_model.round_shape`; plain decoding is (0, 0, 0)) - keeps
decayed sums of the tokens its
last rounds committed and the seconds they took. Its estimate is that rate, shrunk towards the cost
model's estimate (`PRIOR_ROUNDS` pseudo-rounds): the tables are the prior, measured rounds the
evidence. The round takes the arm with the highest estimate; every `EXPLORE_EVERY`-th round
of a bucket takes the best arm not taken for the longest instead, so an arm measured at a busy
moment, or plain decoding after drafting stopped paying (and drafting after plain decoding
took over), is tried again now and then. Plain decoding, the baseline every other arm must
beat, is measured in a bucket's second round: the tables misjudge it too (hybrid pair, 16
streams: they put plain rounds at 140 tokens per second, which made 246, and a burst's hundred
rounds drafted at 160 before the 32nd round would have tried plain).

What was learned is kept per model and machine, beside the forward-time tables, and read back
at the next start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from server.engine.speculation.cost_model import PLAIN
from server.engine.speculation.forward_source import kit_variant
from server.engine.speculation.forward_store import machine_key

log = logging.getLogger(__name__)

DECAY = 0.95  # per round of the arm: about its last twenty rounds count
PRIOR_ROUNDS = 2.0  # the cost model's estimate weighs as much as this many measured rounds
EXPLORE_EVERY = 32  # rounds of a bucket per exploring round
SAVE_EVERY = 256  # rounds between writes of what was learned
Arm = tuple[int, int, int]  # (width K, draft-model length M, drafts at all): `round_shape`


class YieldLearner:
    def __init__(self, path: Path | None = None):
        self.path = path
        # (bucket, kind) -> arm -> [committed tokens, seconds, rounds], decayed
        self._sums: dict[tuple[int, str], dict[Arm, list[float]]] = {}
        self._rounds: dict[tuple[int, str], int] = {}
        self._last_taken: dict[tuple[int, str], dict[Arm, int]] = {}
        self._since_save = 0
        self._pending: tuple[int, str, Arm] | None = None  # the choice of the round under way
        self._load()

    def choose(self, bucket: int, kind: str, priors: dict[Arm, float],
               plain_margin: float = 0.0) -> Arm:
        """The arm this round takes among `priors` (arm -> the cost model's tokens per
        second): the best estimate, plain decoding's raised by `plain_margin` (drafting's costs
        outside its rounds), or now and then the one left untried longest."""
        key = (bucket, kind)
        rounds = self._rounds.get(key, 0)
        self._rounds[key] = rounds + 1

        def score(arm: Arm) -> float:
            raised = 1 + plain_margin if arm == PLAIN else 1.0
            return self.estimate(bucket, kind, arm, priors[arm]) * raised

        ranked = sorted(priors, key=lambda arm: -score(arm))
        chosen = ranked[0]
        if rounds == 1 and PLAIN in priors and PLAIN not in self._sums.get(key, {}):
            chosen = PLAIN  # the baseline, measured early
        elif rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1 and len(ranked) > 1:
            taken = self._last_taken.get(key, {})
            chosen = min(ranked[1:], key=lambda arm: (taken.get(arm, -1), ranked.index(arm)))
        self._last_taken.setdefault(key, {})[chosen] = rounds
        self._pending = (bucket, kind, chosen)
        return chosen

    def not_this_round(self) -> None:
        """The round of the last `choose` is not the arm's to learn from: a row that drafts
        its own k (`num_draft_tokens` with `"adaptive": false`, a seeded sampled request)
        makes it (the arm (0, 0, 1), the other rows not drafting, learned what a fixed k = 4
        yielded, 1.4x plain decoding, and was then taken for rows left to the server, which
        did not draft)."""
        self._pending = None

    def round_done(self, tokens: int, seconds: float) -> None:
        """The round of the last `choose` committed `tokens` in `seconds`."""
        if self._pending is not None:
            self.record(*self._pending, tokens, seconds)
        self._pending = None

    def estimate(self, bucket: int, kind: str, arm: Arm, prior: float) -> float:
        """Tokens per second the arm is expected to yield: measured, shrunk to `prior`."""
        sums = self._sums.get((bucket, kind), {}).get(arm)
        if sums is None or sums[1] <= 0 or sums[2] <= 0:
            return prior
        mean_seconds = sums[1] / sums[2]
        weight = PRIOR_ROUNDS * mean_seconds
        return (sums[0] + prior * weight) / (sums[1] + weight)

    def record(self, bucket: int, kind: str, arm: Arm, tokens: int, seconds: float) -> None:
        """A round of `arm` committed `tokens` in `seconds`."""
        if seconds <= 0:
            return
        sums = self._sums.setdefault((bucket, kind), {}).setdefault(arm, [0.0, 0.0, 0.0])
        sums[0] = sums[0] * DECAY + tokens
        sums[1] = sums[1] * DECAY + seconds
        sums[2] = sums[2] * DECAY + 1.0
        self._since_save += 1
        if self._since_save >= SAVE_EVERY:
            self.save()

    def measured(self, bucket: int, kind: str) -> dict[Arm, float]:
        """Each measured arm's own tokens per second (no prior): for logs and tests."""
        return {arm: s[0] / s[1] for arm, s in self._sums.get((bucket, kind), {}).items()
                if s[1] > 0}

    # -- kept across restarts -------------------------------------------------------------------
    def save(self) -> None:
        self._since_save = 0
        if self.path is None:
            return
        data = [{"bucket": b, "kind": k, "arm": list(arm), "sums": sums}
                for (b, k), arms in self._sums.items() for arm, sums in arms.items()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError as e:  # a read-only cache folder: learn again next time
            log.warning("draft lengths: cannot keep what was learned in %s: %s", self.path, e)

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            for item in json.loads(self.path.read_text()):
                arms = self._sums.setdefault((int(item["bucket"]), str(item["kind"])), {})
                arms[tuple(int(v) for v in item["arm"])] = [float(v) for v in item["sums"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("draft lengths: %s is unreadable (%s): learning again", self.path, e)
            self._sums = {}


def learned_path(kit, cache_dir: Path | None) -> Path | None:
    """Where what was learned for `kit`'s target and draft (as loaded) on this machine is
    kept, beside the forward-time tables (`cache_dir`; None: nowhere)."""
    if cache_dir is None:
        return None
    keys = [machine_key(m.path, kit_variant(kit, m)) for m in (kit.target, kit.draft)
            if m is not None]
    return cache_dir / "draft-lengths" / f"{'-'.join(keys)}.json"
