"""`python -m server.bench.round_time [--batch 8] [--tokens 60]`: where a decoding round's time
goes, in process: the model's forward (evaluated) vs everything else the engine does per round
(logits pipeline, verification, detokenizing, events), on the generated pair, no draft."""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from server.engine.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams
from server.engine.policy import SpeculationPolicy
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.sequence import Phase
from server.model_files.bundled import generated_pair


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.round_time", description=__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=60)
    args = p.parse_args(argv)
    kit = ModelKit(load_model(generated_pair()[0]))
    tokenizer = kit.target.tokenizer
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy(4, 0))
    seqs = [scheduler.submit(GenerationParams(
        tuple(tokenizer.encode(f"def f{i}(x):\n    return x * {i}\n" * 3)), args.tokens),
        lambda event: None) for i in range(args.batch)]
    while any(s.phase is not Phase.DECODE for s in seqs):
        scheduler.step()
    forward_s = [0.0]
    forward = scheduler.target.forward

    def timed(inputs):
        out = forward(inputs)
        start = time.perf_counter()
        mx.eval(out)
        forward_s[0] += time.perf_counter() - start
        return out

    scheduler.target.forward = timed
    start, rounds = time.perf_counter(), 0
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
        rounds += 1
    total = time.perf_counter() - start
    rest = total - forward_s[0]
    print(f"batch {args.batch}: {rounds} rounds, {total / rounds * 1e3:.1f} ms/round, model "
          f"{forward_s[0] / rounds * 1e3:.1f} ms, the rest {rest / rounds * 1e3:.1f} ms "
          f"({rest / total:.1%})")


if __name__ == "__main__":
    main()
