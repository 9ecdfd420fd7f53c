"""`python -m server.bench.stall`: how long a new long prompt freezes the streams already running.

In process (no HTTP), on the generated pair: one request decodes; a second arrives with a long
prompt; the running stream's gaps between tokens are recorded while the second one prefills,
for several `prefill_chunk` sizes (the last one: the whole prompt at once, no interleaving).
Prints the longest gap and its ratio to the ordinary gap between tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from server.engine.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.policy import SpeculationPolicy
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.sequence import Phase
from server.model_files.bundled import generated_pair


def measure(kit: ModelKit, chunk: int, prompt_len: int, k: int) -> dict:
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=chunk), SpeculationPolicy(4, 8))
    stamps: list[float] = []
    running = scheduler.submit(
        GenerationParams(tuple(range(10, 40)), 10_000, ignore_eos=True,
                         speculation=SpeculationParams(num_draft_tokens=k)),
        lambda event: stamps.append(time.perf_counter()))
    while len(running.output) < 20:
        scheduler.step()
    before = len(stamps)
    long = scheduler.submit(GenerationParams(tuple(i % 4000 + 5 for i in range(prompt_len)), 1),
                            lambda event: None)
    started = time.perf_counter()
    while long.phase is not Phase.DONE:
        scheduler.step()
    prefill_s = time.perf_counter() - started
    for _ in range(10):
        scheduler.step()
    gaps = [b - a for a, b in zip(stamps[before - 10:], stamps[before - 9:], strict=False)]
    ordinary = statistics.median(gaps[:9])
    scheduler.cancel(running)
    scheduler.step()
    return {"prefill_chunk": chunk, "prompt_tokens": prompt_len, "k": k,
            "max_gap_s": max(gaps), "median_gap_s": ordinary,
            "stall_ratio": max(gaps) / ordinary, "long_prompt_total_s": prefill_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.stall", description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--chunks", default="64,256,1024,0", help="0: the whole prompt at once")
    p.add_argument("--num-draft-tokens", type=int, default=0)
    args = p.parse_args(argv)
    target, draft = generated_pair()
    kit = ModelKit(load_model(target))
    kit.load_draft(draft)
    print(f"{'chunk':>6} {'max gap s':>10} {'median gap s':>13} {'stall ratio':>12} "
          f"{'long prompt s':>14}")
    for chunk in (int(c) for c in args.chunks.split(",")):
        row = measure(kit, chunk or args.prompt_tokens, args.prompt_tokens,
                      args.num_draft_tokens)
        print(f"{chunk or 'all':>6} {row['max_gap_s']:10.3f} {row['median_gap_s']:13.3f} "
              f"{row['stall_ratio']:12.1f} {row['long_prompt_total_s']:14.2f}")
        print(json.dumps(row))


if __name__ == "__main__":
    main()
