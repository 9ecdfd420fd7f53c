"""`python -m server.bench.round_replay [--model P] [--draft-model P] [--answers FILE]`: drafting
policies priced without running them, from rounds replayed on the target's greedy answers.

Under greedy decoding a policy's rounds are deterministic: the target's answer to each bench
prompt is fixed, so how many drafts a round proposes and how many the target accepts follow from
the answer alone (the draft model's proposals are its teacher-forced greedy tokens, exact up to
its first miss, which is all acceptance reads). Each round is priced at the target's measured
forward over 1 + proposed tokens, plus one draft step per token the draft model proposed, plus
`--host-ms`; plain decoding is one one-token forward plus `--host-ms` per token. The modeled
speedup leaves out what the server adds (the draft's catch-up, prefill), so it ranks policies
rather than predicting the server's figure.

Policies: prompt lookup alone; the draft model alone at a fixed k (what `mlx_lm`'s
speculative decoding does); hybrid (lookup when it matches, the draft model when not) with
a lookup k and a model k; hybrid with a lookup k per match length (0: the draft model drafts at
that match length, as if lookup had found nothing); hybrid with a corpus n-gram
table (the target's training answers, `--answers`: REST's datastore, llama.cpp's static lookup
cache) asked before the draft model where lookup finds no match (its longest seen 3- or 4-gram,
if seen twice and its top continuation holds half the count; up to the lookup k tokens); and the
server's own adaptive k (`DraftSchedule`, one per drafter, as `Sequence` keeps them) for hybrid,
lookup alone and the draft model alone, hybrid with lookup used from a 1-, 2- or 3-token match
(`hybrid_min_match`; the server's default is `HYBRID_MIN_MATCH`), and hybrid with a
`draft_p_min` (the draft model's round ends at its first token whose teacher-forced
probability is below it; that step is priced, its token not proposed; past a round's first miss
the draft's real probabilities, which read its own wrong token, are not known, so the
teacher-forced ones stand in there).

`--held-out N` replays the first N held-out answers of `--answers` (the 5% no draft trained on)
instead of the two bench prompts' answers: thousands of rounds instead of ~60 per prompt, summed
per request family (code: a function, a module or an explanation asked for; prose).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.bench.lookup_vs_draft import draft_top, lookup_match
from server.engine.drafting import DraftSchedule, confident_count
from server.engine.params import HYBRID_MIN_MATCH, SpeculationParams
from server.engine.sequence import ROUND_DRAFTERS
from server.engine.verification import count_exact_matches

# (drafter, proposed tokens[, draft steps run]) for the round starting at answer position j;
# the draft steps default to one per proposed token
Propose = Callable[[int], tuple]


@dataclass(frozen=True)
class Costs:
    """Milliseconds: the target's forward over w tokens (`verify[w]`, w >= 1), one draft step,
    and the per-round host work."""

    verify: dict[int, float]
    draft_step: float
    host: float

    def round(self, drafter: str, proposed: int, steps: int | None = None) -> float:
        steps = proposed if steps is None else steps
        draft = self.draft_step * steps if drafter == "model" else 0.0
        return self.verify[proposed + 1] + draft + self.host


@dataclass(frozen=True)
class Replay:
    rounds: int
    proposed: int
    accepted: int
    ms: float


def replay(answer: list[int], propose: Propose, costs: Costs) -> Replay:
    """Greedy speculative rounds over `answer`: each accepts its drafts up to the first miss
    and emits one more token (the target's own)."""
    j = rounds = proposed = accepted = 0
    ms = 0.0
    observe = getattr(propose, "observe", None)  # an adaptive policy learns from each round
    while j < len(answer):
        drafter, tokens, *steps = propose(j)
        n = count_exact_matches(answer[j: j + len(tokens)], tokens)
        if observe is not None:
            observe(n)
        ms += costs.round(drafter, len(tokens), *steps)
        rounds, proposed, accepted = rounds + 1, proposed + len(tokens), accepted + n
        j += n + 1
    return Replay(rounds, proposed, accepted, ms)


def plain_ms(answer: list[int], costs: Costs) -> float:
    return len(answer) * (costs.verify[1] + costs.host)


def confident_draft(draft_next: list[int], confidence: list[float] | None, j: int, k: int,
                    p_min: float) -> tuple[list[int], int]:
    """The draft model's round at answer position j, k steps at most, under `draft_p_min`:
    (tokens proposed, draft steps run); the steps include the one whose token fell below
    p_min, as the server's decoder runs it."""
    tokens = draft_next[j: j + k]
    if not p_min:
        return tokens, len(tokens)
    cut = confident_count(confidence[j: j + len(tokens)], len(tokens), p_min)
    return tokens[:cut], min(len(tokens), cut + 1)


class Adaptive:
    """The server's adaptive drafting for one answer: a hybrid row drafts by lookup where lookup
    matches (here: at least `lookup_from` tokens), with the draft model elsewhere; each drafter
    keeps its own `DraftSchedule` (up to `max_k`), updated after each of its rounds, as
    `Sequence.plan_round` and the decoder do. `drafters` limits it to one of them; `p_min`
    is the request's `draft_p_min` (`confidence`: the draft's probability per position)."""

    def __init__(self, prompt: list[int], answer: list[int], draft_next: list[int], max_k: int,
                 lookup_from: int = 1, drafters: tuple[str, ...] = ROUND_DRAFTERS,
                 p_min: float = 0.0, confidence: list[float] | None = None):
        self.prompt, self.answer, self.draft_next = prompt, answer, draft_next
        self.max_k, self.lookup_from, self.drafters = max_k, lookup_from, drafters
        self.p_min, self.confidence = p_min, confidence
        spec = SpeculationParams(num_draft_tokens=max_k, adaptive=True)
        self.schedules = {d: DraftSchedule(spec) for d in ROUND_DRAFTERS}
        self.last: tuple[str, int, int] | None = None  # (drafter, requested k, proposed)

    def __call__(self, j: int) -> tuple[str, list[int], int]:
        n, found = (lookup_match(self.prompt + self.answer[:j], self.max_k)
                    if "prompt_lookup" in self.drafters else (0, []))
        use_lookup = n >= self.lookup_from or "model" not in self.drafters
        drafter = "prompt_lookup" if use_lookup else "model"
        k = self.schedules[drafter].next(len(self.answer) - j)
        if use_lookup:
            tokens, steps = found[:k], 0
        else:
            tokens, steps = confident_draft(self.draft_next, self.confidence, j, k, self.p_min)
        self.last = (drafter, k, len(tokens))
        return drafter, tokens, steps

    def observe(self, accepted: int) -> None:
        drafter, k, proposed = self.last
        self.schedules[drafter].update(k, proposed, accepted)


class NgramTable:
    """The most frequent next token after each n-gram (n = 1..max_n) of a corpus's answers."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], max_n: int = 4):
        counts: dict[tuple, Counter] = defaultdict(Counter)
        for prompt, answer in examples:
            seq = prompt + answer
            for j in range(len(prompt), len(seq)):
                for n in range(1, min(max_n, j) + 1):
                    counts[tuple(seq[j - n: j])][seq[j]] += 1
        self.max_n = max_n
        self.top = {gram: (*c.most_common(1)[0], sum(c.values())) for gram, c in counts.items()}

    def next(self, context: list[int], min_n: int, min_count: int, min_share: float) -> int | None:
        """The top continuation of the longest n-gram (n >= min_n) of `context` the table has,
        if it occurred `min_count` times and holds `min_share` of them; else None."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            found = self.top.get(tuple(context[-n:]))
            if found is not None:
                token, count, total = found
                return token if total >= min_count and count / total >= min_share else None
        return None

    def propose(self, context: list[int], k: int, min_n: int = 3, min_count: int = 2,
                min_share: float = 0.5) -> list[int]:
        out: list[int] = []
        context = list(context)
        while len(out) < k:
            token = self.next(context, min_n, min_count, min_share)
            if token is None:
                break
            out.append(token)
            context.append(token)
        return out


P_MINS = (0.2, 0.3, 0.4, 0.5)  # the draft_p_min values replayed


def policies(prompt: list[int], answer: list[int], draft_next: list[int],
             corpus: NgramTable | None,
             confidence: list[float] | None = None) -> dict[str, Propose]:
    """Each policy's `propose` for this prompt and answer (the `draft_p_min` ones only with the
    draft's `confidence` per position)."""

    def hybrid(lookup_k: dict[int, int], model_k: int, use_corpus: bool = False,
               p_min: float = 0.0) -> Propose:
        def propose(j: int) -> tuple:
            context = prompt + answer[:j]
            n, found = lookup_match(context, max(lookup_k.values()))
            if n and lookup_k[n]:
                return "prompt_lookup", found[: lookup_k[n]]
            if use_corpus and corpus is not None:
                guessed = corpus.propose(context, lookup_k[3])
                if guessed:
                    return "corpus", guessed
            return "model", *confident_draft(draft_next, confidence, j, model_k, p_min)
        return propose

    def lookup(k: int) -> Propose:
        return lambda j: ("prompt_lookup", lookup_match(prompt + answer[:j], k)[1])

    def model(k: int) -> Propose:  # the draft model alone (`mlx_lm`'s speculative decoding)
        return lambda j: ("model", *confident_draft(draft_next, None, j, k, 0.0))

    same = lambda k: {1: k, 2: k, 3: k}  # noqa: E731 - one lookup k for every match length
    found = {
        "lookup k=4": lookup(4),
        "lookup k=2": lookup(2),
        "draft model k=2": model(2),
        "draft model k=4": model(4),
        "hybrid lookup 4 / model 1": hybrid(same(4), 1),
        "hybrid lookup 4 / model 2": hybrid(same(4), 2),
        "hybrid lookup 4 / model 3": hybrid(same(4), 3),
        "hybrid lookup 2 / model 2": hybrid(same(2), 2),
        "hybrid lookup 6 / model 2": hybrid(same(6), 2),
        "hybrid lookup 2,4,6 by match / model 2": hybrid({1: 2, 2: 4, 3: 6}, 2),
        "hybrid lookup 1,3,6 by match / model 2": hybrid({1: 1, 2: 3, 3: 6}, 2),
        "hybrid lookup 4 from a 2-match / model 2": hybrid({1: 0, 2: 4, 3: 4}, 2),
        "hybrid lookup 4 from a 2-match / model 4": hybrid({1: 0, 2: 4, 3: 4}, 4),
        "hybrid lookup 4 from a 3-match / model 2": hybrid({1: 0, 2: 0, 3: 4}, 2),
    }
    if corpus is not None:
        found["hybrid + corpus, lookup 4 / model 2"] = hybrid(same(4), 2, use_corpus=True)
    adaptive = lambda **kw: Adaptive(prompt, answer, draft_next, 4, **kw)  # noqa: E731
    for n in (1, 2, 3):  # the server's default: k up to 4, lookup from HYBRID_MIN_MATCH
        default = " (default)" if n == HYBRID_MIN_MATCH else ""
        found[f"adaptive hybrid, lookup from a {n}-match{default}"] = adaptive(lookup_from=n)
    found["adaptive lookup alone"] = adaptive(drafters=("prompt_lookup",))
    found["adaptive draft model alone"] = adaptive(drafters=("model",))
    if confidence is not None:
        from_match = {n: 4 if n >= HYBRID_MIN_MATCH else 0 for n in (1, 2, 3)}
        for k in (4, 6):
            for p in P_MINS:
                found[f"hybrid k={k}, draft_p_min {p}"] = hybrid(from_match, k, p_min=p)
        for p in P_MINS:
            found[f"adaptive hybrid (default), draft_p_min {p}"] = adaptive(
                lookup_from=HYBRID_MIN_MATCH, p_min=p, confidence=confidence)
    return found


def measured_costs(target, draft, max_width: int, host_ms: float, reps: int) -> Costs:
    from server.bench.fused import forward_ms, forwards_ms

    verify = forwards_ms(target, 1, list(range(1, max_width + 1)), reps)
    return Costs(verify, forward_ms(draft, 1, 1, reps), host_ms)


def replay_all(examples: list[tuple[list[int], list[int]]], draft, costs: Costs,
               corpus: NgramTable | None) -> tuple[dict[str, Replay], float]:
    """Every policy replayed on every (prompt, answer), summed per policy; and plain decoding's
    summed ms."""
    totals: dict[str, Replay] = {}
    plain = 0.0
    for prompt, answer in examples:
        draft_next, confidence = draft_top(draft, prompt, answer)
        plain += plain_ms(answer, costs)
        for name, propose in policies(prompt, answer, draft_next, corpus, confidence).items():
            r, t = replay(answer, propose, costs), totals.get(name, Replay(0, 0, 0, 0.0))
            totals[name] = Replay(t.rounds + r.rounds, t.proposed + r.proposed,
                                  t.accepted + r.accepted, t.ms + r.ms)
    return totals, plain


def table(title: str, totals: dict[str, Replay], plain: float) -> str:
    lines = [f"\n{title}", f"{'policy':<50} {'modeled speedup':>15} {'rounds':>6} "
             f"{'accepted/proposed':>17} {'acceptance':>10}"]
    for name, r in totals.items():
        lines.append(f"{name:<50} {plain / r.ms:14.2f}x {r.rounds:>6} "
                     f"{r.accepted:>8}/{r.proposed:<8} {r.accepted / max(r.proposed, 1):10.2f}")
    return "\n".join(lines)


def held_out_by_family(path: Path, count: int, tokenizer) -> dict[str, list]:
    """The first `count` held-out (prompt, answer) lines of the answers file, split into code
    requests and prose ones (`chat_requests`' prose family), and the first `count` answers to
    the prose requests kept for measuring (`target_answers --eval-prose`, if written): the
    held-out split is the end of the request order, where only code requests are left."""
    from server.model_files.training import target_answers
    from server.model_files.training.chat_requests import prose_requests
    from server.model_files.training.distill import answer_split

    prose = prose_requests()
    families: dict[str, list] = {"code": [], "prose": []}
    for prompt, answer in answer_split(path)[1][:count]:
        text = tokenizer.decode(prompt)
        families["prose" if any(r in text for r in prose) else "code"].append((prompt, answer))
    if target_answers.EVAL_PROSE_OUT.exists():
        families["prose"] += target_answers.answered(target_answers.EVAL_PROSE_OUT)[:count]
    return {name: examples for name, examples in families.items() if examples}


def bench_answers(target, max_tokens: int) -> dict[str, list]:
    """The target's greedy answer to each bench prompt kind."""
    from server.bench.cells import DEFAULT_PROMPT_KINDS, PROMPT_KINDS
    from server.model_files.training.distill_eval import prompt_ids, run_target

    out = {}
    for kind in DEFAULT_PROMPT_KINDS:
        ids = prompt_ids(target.tokenizer, PROMPT_KINDS[kind])
        answer = run_target(target.model, ids, max_tokens,
                            set(target.tokenizer.eos_token_ids))["tokens"]
        out[kind] = [(ids.tolist(), answer)]
    return out


def main(argv: list[str] | None = None) -> None:
    from server.engine.model_kit import load_model
    from server.model_files.default_model import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
    from server.model_files.training import target_answers
    from server.model_files.training.distill import answer_split

    ap = argparse.ArgumentParser(prog="python -m server.bench.round_replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_TARGET_DIR))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT_DIR))
    ap.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT,
                    help="The corpus: its training split (no corpus policy if it is missing).")
    ap.add_argument("--held-out", type=int, default=0, metavar="N",
                    help="Replay the first N held-out answers of --answers instead of the bench "
                         "prompts' answers.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--host-ms", type=float, default=3.0, help="Host work per round.")
    ap.add_argument("--reps", type=int, default=20, help="Forwards per measured cost.")
    args = ap.parse_args(argv)
    target = load_model(args.model)
    draft = load_model(args.draft_model, dequantize=True).model
    corpus = None
    if args.answers.exists():
        corpus = NgramTable(answer_split(args.answers)[0])
    costs = measured_costs(target.model, draft, 7, args.host_ms, args.reps)
    print(f"{args.model} with {args.draft_model}; target forward ms by width "
          + ", ".join(f"{w}: {ms:.1f}" for w, ms in costs.verify.items())
          + f"; draft step {costs.draft_step:.1f} ms; host {costs.host} ms per round")
    families = (held_out_by_family(args.answers, args.held_out, target.tokenizer)
                if args.held_out else bench_answers(target, args.max_tokens))
    for family, examples in families.items():
        totals, plain = replay_all(examples, draft, costs, corpus)
        tokens = sum(len(answer) for _, answer in examples)
        print(table(f"{family}: {len(examples)} answers, {tokens} tokens", totals, plain))


if __name__ == "__main__":
    main()
