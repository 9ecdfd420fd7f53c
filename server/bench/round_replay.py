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

Policies: prompt lookup alone; hybrid (lookup when it matches, the draft model when not) with
a lookup k and a model k; hybrid with a lookup k per match length (0: the draft model drafts at
that match length, as if lookup had found nothing); hybrid with a corpus n-gram
table (the target's training answers, `--answers`: REST's datastore, llama.cpp's static lookup
cache) asked before the draft model where lookup finds no match (its longest seen 3- or 4-gram,
if seen twice and its top continuation holds half the count; up to the lookup k tokens).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.bench.lookup_vs_draft import draft_predictions, lookup_match
from server.engine.verification import count_exact_matches

# (drafter, proposed tokens) for the round starting at answer position j
Propose = Callable[[int], tuple[str, list[int]]]


@dataclass(frozen=True)
class Costs:
    """Milliseconds: the target's forward over w tokens (`verify[w]`, w >= 1), one draft step,
    and the per-round host work."""

    verify: dict[int, float]
    draft_step: float
    host: float

    def round(self, drafter: str, proposed: int) -> float:
        draft = self.draft_step * proposed if drafter == "model" else 0.0
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
    while j < len(answer):
        drafter, tokens = propose(j)
        n = count_exact_matches(answer[j: j + len(tokens)], tokens)
        ms += costs.round(drafter, len(tokens))
        rounds, proposed, accepted = rounds + 1, proposed + len(tokens), accepted + n
        j += n + 1
    return Replay(rounds, proposed, accepted, ms)


def plain_ms(answer: list[int], costs: Costs) -> float:
    return len(answer) * (costs.verify[1] + costs.host)


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


def policies(prompt: list[int], answer: list[int], draft_next: list[int],
             corpus: NgramTable | None) -> dict[str, Propose]:
    """Each policy's `propose` for this prompt and answer."""

    def hybrid(lookup_k: dict[int, int], model_k: int, use_corpus: bool = False) -> Propose:
        def propose(j: int) -> tuple[str, list[int]]:
            context = prompt + answer[:j]
            n, found = lookup_match(context, max(lookup_k.values()))
            if n and lookup_k[n]:
                return "prompt_lookup", found[: lookup_k[n]]
            if use_corpus and corpus is not None:
                guessed = corpus.propose(context, lookup_k[3])
                if guessed:
                    return "corpus", guessed
            return "model", draft_next[j: j + model_k]
        return propose

    def lookup(k: int) -> Propose:
        return lambda j: ("prompt_lookup", lookup_match(prompt + answer[:j], k)[1])

    same = lambda k: {1: k, 2: k, 3: k}  # noqa: E731 - one lookup k for every match length
    found = {
        "lookup k=4": lookup(4),
        "lookup k=2": lookup(2),
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
    return found


def measured_costs(target, draft, max_width: int, host_ms: float, reps: int) -> Costs:
    from server.bench.fused import forward_ms

    verify = {w: forward_ms(target, 1, w, reps) for w in range(1, max_width + 1)}
    return Costs(verify, forward_ms(draft, 1, 1, reps), host_ms)


def main(argv: list[str] | None = None) -> None:
    from server.bench.cells import DEFAULT_PROMPT_KINDS, PROMPT_KINDS
    from server.engine.model_kit import load_model
    from server.model_files.default_model import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR
    from server.model_files.training import target_answers
    from server.model_files.training.distill import held_out_start
    from server.model_files.training.distill_eval import prompt_ids, run_target

    ap = argparse.ArgumentParser(prog="python -m server.bench.round_replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_TARGET_DIR))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT_DIR))
    ap.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT,
                    help="The corpus: its training split (no corpus policy if it is missing).")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--host-ms", type=float, default=3.0, help="Host work per round.")
    ap.add_argument("--reps", type=int, default=20, help="Forwards per measured cost.")
    args = ap.parse_args(argv)
    target = load_model(args.model)
    draft = load_model(args.draft_model, dequantize=True).model
    corpus = None
    if args.answers.exists():
        lines = [line for line in target_answers.read(args.answers) if line[1]]
        corpus = NgramTable(lines[: held_out_start(lines)])
    costs = measured_costs(target.model, draft, 7, args.host_ms, args.reps)
    print(f"{args.model} with {args.draft_model}; target forward ms by width "
          + ", ".join(f"{w}: {ms:.1f}" for w, ms in costs.verify.items())
          + f"; draft step {costs.draft_step:.1f} ms; host {costs.host} ms per round")
    for kind in DEFAULT_PROMPT_KINDS:
        ids = prompt_ids(target.tokenizer, PROMPT_KINDS[kind])
        answer = run_target(target.model, ids, args.max_tokens,
                            set(target.tokenizer.eos_token_ids))["tokens"]
        prompt = ids.tolist()
        draft_next = draft_predictions(draft, prompt, answer)
        print(f"\n{kind}: {len(answer)} tokens")
        print(f"{'policy':<40} {'modeled speedup':>15} {'rounds':>6} {'accepted/proposed':>17}")
        for name, propose in policies(prompt, answer, draft_next, corpus).items():
            r = replay(answer, propose, costs)
            print(f"{name:<40} {plain_ms(answer, costs) / r.ms:14.2f}x {r.rounds:>6} "
                  f"{r.accepted:>8}/{r.proposed:<8}")


if __name__ == "__main__":
    main()
