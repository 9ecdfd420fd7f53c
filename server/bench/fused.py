"""`python -m server.bench.fused [--model DIR] [--reps 5]`: one forward of the target with
fused projections (`server.engine.fused`) against the same model unfused, in process.

For each shape (rows x tokens per row, over a 150-token context in a `BatchKVCache`) it prints
the median time of each and their ratio (fused / unfused; below 1 means fusing pays). Runs are
interleaved so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from server.bench.tokens import random_tokens

SHAPES = ((1, 1), (8, 1), (8, 2), (16, 1))
CONTEXT = 150


def forward_ms(model, rows: int, tokens: int, steps: int = 20, context: int = CONTEXT) -> float:
    """Median time of one (rows, tokens) forward after a `context`-token prefill."""
    return forwards_ms(model, rows, [tokens], steps, context)[tokens]


def forwards_ms(model, rows: int, widths: list[int], steps: int = 20,
                context: int = CONTEXT) -> dict[int, float]:
    """Median time of one (rows, w) forward for each w in `widths`, after one `context`-token
    prefill; the widths take turns in each of the `steps` passes, so a drift of the machine
    moves them alike."""
    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    mx.eval(model(random_tokens(model, (rows, context)), cache=cache))
    inputs = {w: random_tokens(model, (rows, w)) for w in widths}
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(steps):
        for w, x in inputs.items():
            start = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times[w].append(time.perf_counter() - start)
            for c in cache:
                c.trim(w)
    return {w: statistics.median(t) * 1e3 for w, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.fused", description=__doc__)
    p.add_argument("--model", help="Target folder (default: the generated pair's target).")
    p.add_argument("--reps", type=int, default=5, help="Interleaved runs per variant.")
    args = p.parse_args(argv)
    from server.engine.model_kit import load_model
    from server.model_files.bundled import generated_pair

    path = args.model or generated_pair()[0]
    models = {fuse: load_model(path, fuse=fuse).model for fuse in (False, True)}
    times: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(args.reps):
        for fuse, model in models.items():
            times[fuse].append([forward_ms(model, b, t) for b, t in SHAPES])
    print(f"{path}: one forward, median of {args.reps} interleaved runs")
    print(f"{'rows x tokens':>13}  {'unfused ms':>10}  {'fused ms':>8}  {'fused/unfused':>13}")
    for i, (b, t) in enumerate(SHAPES):
        plain = statistics.median(r[i] for r in times[False])
        fused = statistics.median(r[i] for r in times[True])
        print(f"{f'{b} x {t}':>13}  {plain:>10.1f}  {fused:>8.1f}  {fused / plain:>12.2f}x")


if __name__ == "__main__":
    main()
