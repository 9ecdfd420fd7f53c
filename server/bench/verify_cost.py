"""`python -m server.bench.verify_cost [--model P] [--draft-model P] [--context 100]`: what one
speculative round costs, from its parts: the target's forward over 1, 2, 3 and 5 tokens (verifying
k = 0, 1, 2, 4 drafts) and the draft's one-token step, each on a cache holding `--context`
tokens, median of `--reps`, loaded as the server loads them. Prints each cost over the target's
one-token step, and the per-token acceptance a draft needs for a given speedup at each k:
with per-token acceptance p, a greedy round yields 1 + p + ... + p^k tokens for k draft steps
and one verification."""

from __future__ import annotations

import argparse

from server.bench.fused import forward_ms
from server.engine.model_kit import ModelKit, load_model
from server.model_files.default_model import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR


def needed_p(k: int, round_ms: float, one_ms: float, speedup: float) -> float:
    """The smallest per-token acceptance p with (1 + p + ... + p^k) * one_ms / round_ms >=
    speedup (bisection: the left side grows with p)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        p = (lo + hi) / 2
        tokens = sum(p ** i for i in range(k + 1))
        lo, hi = (lo, p) if tokens * one_ms / round_ms >= speedup else (p, hi)
    return hi


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m server.bench.verify_cost", description=__doc__)
    ap.add_argument("--model", default=str(DEFAULT_TARGET_DIR))
    ap.add_argument("--draft-model", default=str(DEFAULT_DRAFT_DIR))
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--speedup", type=float, default=1.4)
    args = ap.parse_args(argv)
    kit = ModelKit(load_model(args.model))
    draft = kit.load_draft(args.draft_model).model
    one = forward_ms(kit.target.model, 1, 1, args.reps, args.context)
    draft_ms = forward_ms(draft, 1, 1, args.reps, args.context)
    print(f"{args.model}, {args.context} cached tokens, median of {args.reps}")
    print(f"target, 1 token: {one:.1f} ms; draft ({args.draft_model}), 1 token: "
          f"{draft_ms:.1f} ms (c = {draft_ms / one:.3f})")
    print(f"{'k':>2}  {'verify ms':>9}  {'verify / 1 token':>16}  {'round ms':>8}  "
          f"p for {args.speedup}x")
    for k in (1, 2, 4):
        verify = forward_ms(kit.target.model, 1, k + 1, args.reps, args.context)
        round_ms = k * draft_ms + verify
        print(f"{k:>2}  {verify:9.1f}  {verify / one:15.2f}x  {round_ms:8.1f}  "
              f"{needed_p(k, round_ms, one, args.speedup):.2f}")


if __name__ == "__main__":
    main()
