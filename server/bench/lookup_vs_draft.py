"""`python -m server.bench.lookup_vs_draft [--answers FILE] [--draft-model P] [--count 150]`:
who predicts the target better at each position of its own held-out answers, prompt lookup or
the draft model, by how long an n-gram lookup matches there.

The answers are `target_answers`' JSONL (the target's greedy answers; the same 5% held out as
`distill`'s), so a greedy draft is accepted exactly where it predicts them. At each answer
position the context is the prompt and the answer so far; lookup tries its last 3, then 2, then
1 tokens (`prompt_lookup`'s order), and the draft model reads the answer once (teacher forcing,
which for a greedy draft is what it would propose). Per match length it prints how often each
drafter's first token is right, and how many of `--k` drafts a round would accept in a row:
what the `hybrid` drafter (lookup when it matches, the draft model when not) weighs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np

from server.engine.prompt_lookup import DEFAULT_MAX_NGRAM, find_continuation
from server.engine.verification import count_exact_matches
from server.model_files.default_model import DEFAULT_DRAFT_DIR


def lookup_match(context: list[int], k: int) -> tuple[int, list[int]]:
    """(n, proposal): the longest n <= DEFAULT_MAX_NGRAM whose last n-gram occurred before in
    `context`, and the k tokens lookup proposes from it; (0, []) when none did."""
    for n in range(DEFAULT_MAX_NGRAM, 0, -1):
        proposal = find_continuation(context, k, max_ngram=n, min_ngram=n)
        if proposal:
            return n, proposal
    return 0, []


def positions(prompt: list[int], answer: list[int], draft_next: list[int], k: int):
    """(n, lookup's run, draft's run) at each answer position: n as `lookup_match`, a run how
    many of its k drafts greedy verification accepts; `draft_next[j]` is the draft's greedy
    token after prompt + answer[:j]."""
    for j in range(len(answer)):
        n, proposal = lookup_match(prompt + answer[:j], k)
        truth = answer[j : j + k]
        yield n, count_exact_matches(truth, proposal), count_exact_matches(
            truth, draft_next[j : j + k])


def table(rows: np.ndarray, k: int) -> str:
    lines = [f"{'match':>5}  {'share':>5}  {'lookup 1st':>10}  {'draft 1st':>9}  "
             f"{'lookup run/' + str(k):>12}  {'draft run/' + str(k):>11}"]
    for n in range(DEFAULT_MAX_NGRAM + 1):
        at = rows[rows[:, 0] == n]
        if len(at):
            lines.append(f"{n:>5}  {len(at) / len(rows):5.2f}  {np.mean(at[:, 1] > 0):10.2f}  "
                         f"{np.mean(at[:, 2] > 0):9.2f}  {at[:, 1].mean():12.2f}  "
                         f"{at[:, 2].mean():11.2f}")
    return "\n".join(lines)


def draft_predictions(model, prompt: list[int], answer: list[int]) -> list[int]:
    return draft_top(model, prompt, answer)[0]


def draft_top(model, prompt: list[int], answer: list[int]) -> tuple[list[int], list[float]]:
    """At each answer position (teacher forced): the draft's greedy token and the probability
    it gives that token (what `draft_p_min` compares)."""
    logits = model(mx.array(prompt + answer, mx.uint32)[None])[0, len(prompt) - 1 : -1]
    logits = logits.astype(mx.float32)
    top = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))
    return mx.argmax(logits, axis=-1).tolist(), top.tolist()


def main(argv: list[str] | None = None) -> None:
    from server.engine.model_kit import load_model
    from server.model_files.training import target_answers
    from server.model_files.training.distill import answer_split

    ap = argparse.ArgumentParser(prog="python -m server.bench.lookup_vs_draft",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT)
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT_DIR))
    ap.add_argument("--count", type=int, default=150, help="Held-out answers to read.")
    ap.add_argument("--k", type=int, default=4, help="Drafts per round.")
    args = ap.parse_args(argv)
    held_out = answer_split(args.answers)[1][: args.count]
    draft = load_model(args.draft_model, dequantize=True).model
    rows = [row for prompt, answer in held_out
            for row in positions(prompt, answer, draft_predictions(draft, prompt, answer),
                                 args.k)]
    print(f"{len(held_out)} held-out answers of {args.answers}, {len(rows)} positions; "
          f"draft {args.draft_model}; k = {args.k}")
    print(table(np.array(rows), args.k))


if __name__ == "__main__":
    main()
