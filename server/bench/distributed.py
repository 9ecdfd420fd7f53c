"""`mlx-spec-bench distributed`: a target sharded with mlx.launch against one process.

`mlx-spec-bench distributed --target-model T [--draft-model D] [--ranks 2]`: the target sharded
over `--ranks` processes (`mlx.launch --backend ring`, loopback) against one process, same
pair, same engine (no HTTP), one run each; prints ratios.

Measured in each layout:
- decode tok/s of one greedy request (`--max-tokens`, EOS ignored), with the draft (k =
  `--num-draft-tokens`, the default adaptive policy) and without;
- the time of one target forward (head included) carrying 1 token and k + 1 tokens after a
  `--context`-token prefill: the case for speculation when distributed, since a
  tensor-parallel forward costs 2 `all_sum`s per layer whatever it carries;
- each rank's MLX active memory after the load (rank 0 also holds the draft).

Communication per distributed forward (from the config, for `--paper` estimates): 2 `all_sum`s
per layer, each rows * tokens * hidden_size * bytes-per-value.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlx-spec-bench distributed",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target-model", required=True, help="Target model folder (sharded).")
    p.add_argument("--draft-model", default=None, help="Draft model folder (rank 0 only).")
    p.add_argument("--ranks", type=int, default=2, help="Processes to shard over (default 2).")
    p.add_argument("--mode", choices=["tensor", "pipeline"], default="tensor")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k (default 4).")
    p.add_argument("--max-tokens", type=int, default=64, help="Tokens per request (64).")
    p.add_argument("--context", type=int, default=128, help="Context before the timed forwards.")
    p.add_argument("--reps", type=int, default=3, help="Requests / forwards per cell (median).")
    p.add_argument("--out", type=Path, default=None, help="Write the results here as JSON.")
    p.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one layout --------------------------------------------------------------------------------


def _on_engine(engine, fn):
    """Run `fn` on the engine's MLX thread (where every MLX call, and so every collective, runs)."""
    box, done = {}, threading.Event()

    def settle(result, error):
        box.update(result=result, error=error)
        done.set()

    engine.scheduler.call(fn, settle)
    done.wait()
    if box["error"] is not None:
        raise box["error"]
    return box["result"]


def _generate(engine, ids: list[int], max_tokens: int, k: int) -> dict:
    from server.engine.events import Finished
    from server.engine.params import GenerationParams, SpeculationParams

    finished, done = {}, threading.Event()

    def sink(event):
        if isinstance(event, Finished):
            finished["stats"] = event.stats
            done.set()
        elif isinstance(event, BaseException):
            finished["error"] = event
            done.set()

    params = GenerationParams(tuple(ids), max_tokens, ignore_eos=True, cache_prompt=False,
                              speculation=SpeculationParams(num_draft_tokens=k, required=k > 0))
    engine.scheduler.submit(params, sink)
    done.wait()
    if "error" in finished:
        raise finished["error"]
    stats = finished["stats"]
    return {"tps": stats.generation_tps, "accepted": stats.draft_tokens_accepted,
            "proposed": stats.draft_tokens_proposed}


def _forward_times(model, context: list[int], widths: list[int], reps: int) -> dict[int, float]:
    """Median seconds of one forward of each width over a one-row cache holding `context`."""
    import mlx.core as mx

    from server.engine.batch import new_cache, prefill
    from server.engine.ragged_cache import RaggedKVCache

    row = new_cache(model)
    prefill(model, row, context)
    cache = [RaggedKVCache.merge([c]) for c in row]
    out = {}
    for width in widths:
        times = []
        for rep in range(reps + 1):
            inputs = mx.array([context[:width]], mx.uint32)
            start = time.perf_counter()
            mx.eval(model(inputs, cache=cache))
            if rep:  # the first is a warm-up
                times.append(time.perf_counter() - start)
            for c in cache:
                c.trim(width)
        out[width] = statistics.median(times)
    return out


def measure(engine, args: argparse.Namespace) -> dict:
    """Every figure of one layout, from a started engine."""
    import mlx.core as mx

    tokenizer = engine.tokenizer
    ids = list(tokenizer.encode(PROMPT))
    context = (ids * (args.context // len(ids) + 1))[: args.context]
    k = args.num_draft_tokens
    cells = [("plain", 0)] + ([("draft", k)] if engine.draft is not None else [])
    result = {"tps": {}, "accepted": {}}
    _generate(engine, ids, 8, 0)  # warm-up
    for name, draft_k in cells:
        runs = [_generate(engine, ids, args.max_tokens, draft_k) for _ in range(args.reps)]
        result["tps"][name] = statistics.median(r["tps"] for r in runs)
        result["accepted"][name] = sum(r["accepted"] for r in runs) / max(
            1, sum(r["proposed"] for r in runs))
    times = _on_engine(engine, lambda: _forward_times(engine.kit.target.model, context,
                                                      [1, k + 1], args.reps * 3))
    result["forward_s"] = {str(w): t for w, t in times.items()}
    layout = engine.distributed
    result["rank_memory_gb"] = (layout["rank_memory_gb"] if layout else
                                [round(_on_engine(engine, mx.get_active_memory) / 1e9, 4)])
    config = engine.target.config
    result["layers"] = config.get("num_hidden_layers")
    result["hidden_size"] = config.get("hidden_size")
    return result


def _engine(args: argparse.Namespace, layout=None):
    from server.engine.distributed import DistributedEngine
    from server.engine.service import InferenceEngine

    kwargs = {"model": args.target_model, "draft_model": args.draft_model,
              "num_draft_tokens": args.num_draft_tokens, "prefix_cache_bytes": 0}
    if layout is None:
        return InferenceEngine(**kwargs)
    return DistributedEngine(layout=layout, **kwargs)


def _run(engine, args) -> dict:
    engine.start()
    try:
        return measure(engine, args)
    finally:
        engine.stop()


def launched(args: argparse.Namespace) -> None:
    """Inside `mlx.launch`: rank 0 measures, the others follow."""
    from server.engine.distributed import launched_layout
    from server.engine.follower import run_follower

    layout = launched_layout(args.mode)
    if layout is None:
        raise SystemExit("--launched needs mlx.launch")
    if layout.rank > 0:
        run_follower(layout, args.target_model, timeout_s=600, drain_timeout_s=10)
        return
    result = _run(_engine(args, layout), args)
    result.update(world_size=layout.world_size, backend=layout.backend, mode=layout.mode)
    args.result_file.write_text(json.dumps(result))


# -- both layouts ------------------------------------------------------------------------------


def distributed(args: argparse.Namespace) -> dict:
    launcher = Path(sys.executable).parent / "mlx.launch"
    with tempfile.TemporaryDirectory() as folder:
        result_file = Path(folder) / "result.json"
        cmd = [str(launcher), "--backend", "ring", "-n", str(args.ranks), "--",
               sys.executable, "-m", "server.bench.distributed", "--launched",
               "--result-file", str(result_file), "--target-model", args.target_model,
               "--mode", args.mode, "--num-draft-tokens", str(args.num_draft_tokens),
               "--max-tokens", str(args.max_tokens), "--context", str(args.context),
               "--reps", str(args.reps)]
        if args.draft_model:
            cmd += ["--draft-model", args.draft_model]
        subprocess.run(cmd, check=True, env=os.environ.copy())
        return json.loads(result_file.read_text())


def report(single: dict, dist: dict, k: int) -> str:
    one, block = "1", str(k + 1)
    lines = [f"{'':34}{'1 process':>12}{str(dist['world_size']) + ' ranks':>12}{'ratio':>8}"]

    def row(name, a, b, fmt="{:12.2f}"):
        lines.append(f"{name:34}" + fmt.format(a) + fmt.format(b) + f"{b / a:8.2f}")

    for cell in single["tps"]:
        row(f"decode tok/s, {cell}", single["tps"][cell], dist["tps"][cell])
    for width in (one, block):
        row(f"forward of {width} token(s), ms", single["forward_s"][width] * 1e3,
            dist["forward_s"][width] * 1e3, "{:12.3f}")
    for name, layout in (("1 process", single), ("ranks", dist)):
        lines.append(f"{name:34}{'k+1 / 1 forward time':>24}"
                     f"{layout['forward_s'][block] / layout['forward_s'][one]:8.2f}")
    if "draft" in single["tps"]:
        for name, layout in (("1 process", single), ("ranks", dist)):
            lines.append(f"{name:34}{'draft / plain tok/s':>24}"
                         f"{layout['tps']['draft'] / layout['tps']['plain']:8.2f}")
    lines.append(f"rank memory GB: 1 process {single['rank_memory_gb']},"
                 f" ranks {dist['rank_memory_gb']}")
    lines.append(f"all_sums per distributed forward: {2 * dist['layers']} (2 per layer);"
                 f" bytes each: rows * tokens * {dist['hidden_size']} * bytes per value")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.launched:
        launched(args)
        return
    single = _run(_engine(args), args)
    dist = distributed(args)
    print(report(single, dist, args.num_draft_tokens))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "single": single, "distributed": dist}, indent=1))


if __name__ == "__main__":
    main()
