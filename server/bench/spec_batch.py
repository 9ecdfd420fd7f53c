"""`python -m server.bench.spec_batch [--batch 1,2,4,8,12,16] [--k 1,2] [--reps 3]`: where
batched speculation stops paying, in process, on the generated pair.

For each batch size B, B greedy requests (the load benchmark's prompts) are prefilled, then
timed while every row decodes: plain batched rounds (k = 0) against speculative rounds with a
fixed k drafted by every row. Prints decode tok/s (median of interleaved runs), each k's ratio
to plain decoding, and the acceptance. The speculation policy's defaults
(`engine.spec_max_batch`, `engine.spec_batch_draft_tokens`) are read off this table.
"""

from __future__ import annotations

import argparse
import statistics
import time

MAX_TOKENS = 96


def decode_rate(kit, batch: int, k: int, first: int) -> tuple[float, float | None]:
    """(decode tok/s once every row decodes, accepted/proposed) for one batch."""
    from server.bench.engine_load import _ids
    from server.engine.params import GenerationParams, SpeculationParams
    from server.engine.policy import SpeculationPolicy
    from server.engine.scheduler import Scheduler
    from server.engine.sequence import Phase

    policy = SpeculationPolicy(max(k, 1), 256 if k else 0, max(k, 1))
    scheduler = Scheduler(kit, policy=policy)
    spec = SpeculationParams(num_draft_tokens=k, adaptive=False)
    seqs = [scheduler.submit(GenerationParams(_ids(kit.target.tokenizer, first + i), MAX_TOKENS,
                                              speculation=spec), lambda event: None)
            for i in range(batch)]
    while any(s.phase is not Phase.DECODE for s in seqs):
        scheduler.step()
    before = sum(len(s.output) for s in seqs)
    start = time.perf_counter()
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    rate = (sum(len(s.output) for s in seqs) - before) / (time.perf_counter() - start)
    proposed = sum(s.counters.proposed for s in seqs)
    return rate, (sum(s.counters.accepted for s in seqs) / proposed if proposed else None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.spec_batch", description=__doc__)
    p.add_argument("--batch", default="1,2,4,8,12,16", help="Batch sizes.")
    p.add_argument("--k", default="1,2", help="Draft lengths to compare with plain decoding.")
    p.add_argument("--reps", type=int, default=3, help="Interleaved runs per cell.")
    args = p.parse_args(argv)
    from server.engine.model_kit import ModelKit, load_model
    from server.model_files.bundled import generated_pair

    target, draft = generated_pair()
    kit = ModelKit(load_model(target))
    kit.load_draft(draft)
    ks = [0, *(int(k) for k in args.k.split(","))]
    print(f"decode tok/s while every row decodes (median of {args.reps}); k/plain; acceptance")
    print(f"{'batch':>5}  {'plain':>7}  " + "  ".join(f"{f'k={k}':>22}" for k in ks[1:]))
    first = 3000
    for batch in (int(b) for b in args.batch.split(",")):
        runs: dict[int, list[tuple[float, float | None]]] = {k: [] for k in ks}
        for _ in range(args.reps):
            for k in ks:
                runs[k].append(decode_rate(kit, batch, k, first))
            first += batch
        plain = statistics.median(r for r, _ in runs[0])
        cells = []
        for k in ks[1:]:
            rate = statistics.median(r for r, _ in runs[k])
            acceptance = statistics.median(a for _, a in runs[k] if a is not None)
            cells.append(f"{rate:>7.1f} {rate / plain:>5.2f}x {acceptance:>6.2f}")
        print(f"{batch:>5}  {plain:>7.1f}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
