"""`python -m server.bench.prefill_shapes [--prompts 8] [--lengths 32,65,128]`: what prefilling
N prompts costs one at a time against in one batched forward, in process, on the generated
target (why the scheduler prefills whole prompts that arrive together as one (N, L) forward).

For each length L: N forwards of (1, L), one forward of (N, L), and one of (1, N*L) (the same
tokens as one long prompt), each from an empty cache, best of 3. Prints seconds and the ratio
batched / one at a time.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from server.bench.tokens import random_tokens


def best_of(model, shape: tuple[int, int], forwards: int, reps: int = 3) -> float:
    x = random_tokens(model, shape)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(forwards):
            mx.eval(model(x, cache=make_prompt_cache(model)))
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    from mlx_lm import load

    from server.model_files.bundled import generated_pair

    p = argparse.ArgumentParser(prog="python -m server.bench.prefill_shapes", description=__doc__)
    p.add_argument("--prompts", type=int, default=8, help="N, the prompts prefilled.")
    p.add_argument("--lengths", default="32,65,128", help="Prompt lengths L to try.")
    p.add_argument("--model", help="Model folder (default: the generated pair's target).")
    args = p.parse_args(argv)
    model, _ = load(args.model or generated_pair()[0])
    n = args.prompts
    print(f"{'L':>5}  {f'{n} x (1, L)':>12}  {f'({n}, L)':>10}  {f'(1, {n}L)':>10}  batched/alone")
    for length in (int(v) for v in args.lengths.split(",")):
        alone = best_of(model, (1, length), n)
        batched = best_of(model, (n, length), 1)
        long = best_of(model, (1, n * length), 1)
        print(f"{length:>5}  {alone:>11.3f}s  {batched:>9.3f}s  {long:>9.3f}s  "
              f"{batched / alone:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
