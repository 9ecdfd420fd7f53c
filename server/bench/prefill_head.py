"""`python -m server.bench.prefill_head [--model DIR] [--lengths 32,128,512] [--rows 1,4]`: a
prefill with the output head on the last positions only (`server/engine/head.py`) against the
head on every position (`model(inputs)`, as before), in process, through `prefill_rows`.

For each prompt length and number of rows: median seconds of 5 prefills from an empty cache,
each way, and the ratio split / whole. Default model: the converted SmolLM2-135M-Instruct
(`make serve` makes it), whose 49k-token head is a fifth of its multiply-adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from server.bench.tokens import random_tokens

DEFAULT_MODEL = "models/generated/SmolLM2-135M-Instruct"


def _time(model, prompts: list[list[int]], reps: int = 5) -> float:
    from server.engine.batch import new_cache, prefill_rows

    times = []
    for _ in range(reps):
        caches = [new_cache(model) for _ in prompts]
        start = time.perf_counter()
        prefill_rows(model, caches, prompts)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    from server.engine import head
    from server.engine.model_kit import load_model

    p = argparse.ArgumentParser(prog="python -m server.bench.prefill_head", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="Model folder.")
    p.add_argument("--lengths", default="32,128,512", help="Prompt lengths.")
    p.add_argument("--rows", default="1,4", help="Prompts prefilled together.")
    args = p.parse_args(argv)
    model = load_model(args.model).model
    split = head.split_of(model)
    if split.body is None:
        raise SystemExit(f"{args.model}: the model is not head(body(x)); nothing to compare")
    whole = head._Split(None)
    print(f"{args.model}\n{'rows':>4} {'L':>5} {'head everywhere':>16} {'last only':>10}  ratio")
    for rows in (int(v) for v in args.rows.split(",")):
        for length in (int(v) for v in args.lengths.split(",")):
            prompts = random_tokens(model, (rows, length)).tolist()
            _time(model, prompts, reps=1)  # warm up
            head.set_split(model, whole)
            before = _time(model, prompts)
            head.set_split(model, split)
            after = _time(model, prompts)
            print(f"{rows:>4} {length:>5} {before:>15.3f}s {after:>9.3f}s  {after / before:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
