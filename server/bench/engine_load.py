"""`python -m server.bench.engine_load [--streams 8,16] [--reps 3]`: our scheduler against
`mlx_lm`'s `BatchGenerator`, in process (no HTTP), on the same prompts.

N clients each send one 96-token greedy chat request (`server.bench.load.prompt`) at once; the
engine runs until all are answered. Prints aggregate tok/s per engine and their ratio, so a gap
seen through the servers (`server.bench.load`) can be told apart from one in the engine. Ours
runs with the generated pair's draft loaded and k=4 requested (the default policy decides), and
without a draft.
"""

from __future__ import annotations

import argparse
import statistics
import time

from server.bench.load import prompt

MAX_TOKENS = 96


COSTS: dict[str, bool] = {}  # "on": False runs the draft up to the caps (--no-cost-model)
PAIR: dict[str, str] = {}  # "target", "draft": --target-model / --draft-model or the generated pair


def ours(streams: int, first: int, *, draft: bool) -> float:
    from server.engine.params import GenerationParams, SpeculationParams
    from server.engine.policy import SpeculationPolicy
    from server.engine.scheduler import Scheduler
    from server.engine.sequence import Phase

    kit = _kit(draft)
    tokenizer = kit.target.tokenizer
    scheduler = Scheduler(kit, policy=SpeculationPolicy())
    if draft and COSTS.get("on", True):
        scheduler.measure_costs()  # as the server does (engine.cost_model)
    spec = SpeculationParams(num_draft_tokens=4 if draft else 0)
    seqs = [scheduler.submit(GenerationParams(_ids(tokenizer, first + i), MAX_TOKENS,
                                              speculation=spec), lambda event: None)
            for i in range(streams)]
    start = time.perf_counter()
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    return sum(len(s.output) for s in seqs) / (time.perf_counter() - start)


def mlx_lm(streams: int, first: int) -> float:
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = _mlx_pair()
    gen = BatchGenerator(model, max_tokens=MAX_TOKENS, stop_tokens=[[-1]])
    start = time.perf_counter()
    gen.insert([list(_ids(tokenizer, first + i)) for i in range(streams)],
               [MAX_TOKENS] * streams)
    tokens, done = 0, 0
    while done < streams:
        for r in gen.next_generated():
            tokens += 1
            done += r.finish_reason is not None
    return tokens / (time.perf_counter() - start)


_cache: dict = {}


def _kit(draft: bool):
    from server.engine.model_kit import ModelKit, load_model

    if draft not in _cache:
        kit = ModelKit(load_model(PAIR["target"]))
        if draft:
            kit.load_draft(PAIR["draft"])
        _cache[draft] = kit
    return _cache[draft]


def _mlx_pair():
    from mlx_lm import load

    if "mlx" not in _cache:
        _cache["mlx"] = load(PAIR["target"])
    return _cache["mlx"]


def _ids(tokenizer, i: int) -> tuple[int, ...]:
    messages = [{"role": "user", "content": prompt(i)}]
    return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.engine_load", description=__doc__)
    p.add_argument("--streams", default="8,16", help="Concurrent requests per level.")
    p.add_argument("--reps", type=int, default=3, help="Runs per engine and level, interleaved.")
    p.add_argument("--target-model", help="Target folder (default: the generated pair's).")
    p.add_argument("--draft-model", help="Draft folder (default: the generated pair's).")
    p.add_argument("--no-cost-model", action="store_true",
                   help="With the draft, rows draft up to the caps (no measured costs).")
    args = p.parse_args(argv)
    COSTS["on"] = not args.no_cost_model
    from server.model_files.bundled import generated_pair

    chosen = (args.target_model, args.draft_model)
    PAIR["target"], PAIR["draft"] = chosen if all(chosen) else generated_pair()
    _cache.clear()
    print(f"{'streams':>7}  {'ours+draft':>10}  {'ours':>8}  {'mlx_lm':>8}  "
          f"{'ratio':>6}  (tok/s, median of {args.reps}; ratio: ours+draft / mlx_lm)")
    first = 1000
    for streams in (int(s) for s in args.streams.split(",")):
        runs: dict[str, list[float]] = {"ours+draft": [], "ours": [], "mlx_lm": []}
        for _ in range(args.reps):  # interleaved, so drift hits every engine alike
            runs["ours+draft"].append(ours(streams, first, draft=True))
            runs["ours"].append(ours(streams, first, draft=False))
            runs["mlx_lm"].append(mlx_lm(streams, first))
            first += streams
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{streams:>7}  {med['ours+draft']:>10.1f}  {med['ours']:>8.1f}  "
              f"{med['mlx_lm']:>8.1f}  {med['ours+draft'] / med['mlx_lm']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
