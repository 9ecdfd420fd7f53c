"""`mlx-spec-bench load`: many concurrent streaming clients, our server against others.

At each level C, C clients stream a distinct greedy request each, the servers taking `--runs`
turns; a row keeps the medians (aggregate tok/s, TTFT, ITL, `from_draft` share, errors, peak RSS)
and ours over each other. `--in-process`: our scheduler against `BatchGenerator`, no HTTP (peak
GB: what a run adds to MLX's memory; ours' decoding tok/s against the bound C / t(C rows, 1), and
where its decoding time goes: the target's forwards' and drafting's shares, and the forwards'
time over the table's). And `mlx-spec-bench distributed`: the target sharded over `--ranks`
processes against one process.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator

from server.bench import results
from server.bench.results import aligned, num, percentile, ratio, summarize
from server.bench.runners import Stream, engine_stats, request_body, server_health, stream_async
from server.engine import DistributedConfig, EngineConfig, build_engine, launched_layout
from server.engine.distributed.follower import run_follower
from server.engine.kv.batch import ModelBatch
from server.engine.memory import memory_budget, peak_bytes, reset_peak
from server.engine.models.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling import decoder
from server.engine.scheduling.memory_gate import gate_for
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.forward_times import time_forwards
from server.model_files.bundled import generated_pair

_TASKS, _SUBJECTS, _CONTEXT = (results.PROMPTS["load"][k] for k in ("tasks", "subjects",
                                                                    "context"))


def prompt(i: int) -> str:
    """The i-th prompt: distinct for every i, 0 to 5 context sentences long."""
    task = _TASKS[(i // len(_SUBJECTS)) % len(_TASKS)].format(_SUBJECTS[i % len(_SUBJECTS)])
    extra = [_CONTEXT[(i + j) % len(_CONTEXT)] for j in range(i % len(_CONTEXT))]
    return " ".join([task, *extra, f"(Request {i}.)"])


async def run_level(name: str, url: str, concurrency: int, first: int, args,
                    max_tokens: int | None = None, *, transport=None,
                    clock=time.perf_counter) -> list[Stream]:
    """C clients at once, one request each (of `max_tokens`, default `args.max_tokens`)."""
    model = getattr(args, "models", {}).get(name) if args.api != "chat" else None

    async def one_client(c: int) -> Stream:
        body = request_body(args.api, [{"role": "user", "content": prompt(first + c)}],
                            max_tokens=max_tokens or args.max_tokens, temperature=0.0, model=model)
        task = stream_async(client, url, args.api, body, clock=clock)
        try:
            return await asyncio.wait_for(task, args.timeout)
        except asyncio.TimeoutError:
            return Stream(start=clock(), end=clock(), error=f"timeout after {args.timeout:g}s")

    async with httpx.AsyncClient(
            timeout=httpx.Timeout(args.timeout, connect=10.0), headers=results.auth(args.api_key),
            limits=httpx.Limits(max_connections=concurrency), transport=transport) as client:
        return list(await asyncio.gather(*(one_client(c) for c in range(concurrency))))


def level_figures(streams: list[Stream]) -> dict:
    """One run of one (server, level), from what its clients saw."""
    ok = [s for s in streams if s.error is None]
    span = max(s.end for s in streams) - min(s.start for s in streams) if streams else 0.0
    tokens = sum(s.tokens for s in ok)
    gaps = [b - a for s in ok for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]
    flagged = [s.from_draft for s in ok if s.from_draft is not None]
    errors = [s.error for s in streams if s.error is not None]
    return {
        "requests": len(streams), "completed": len(ok), "errors": len(errors),
        "retries": sum(s.retries for s in streams),
        "error_messages": list(dict.fromkeys(errors))[:3], "span_s": span, "tokens": tokens,
        "aggregate_tps": tokens / span if span > 0 and ok else None,
        "ttft_p50_s": percentile([s.arrivals[0] - s.start for s in ok if s.arrivals], 50),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "from_draft_fraction": ratio(sum(flagged), tokens) if flagged else None,
        "k_histogram": k_histogram(s.stats for s in ok)}


def k_histogram(stats) -> dict[str, int] | None:
    """Rounds by the tokens drafted in them, summed over our `stats` (None: another server)."""
    counts = Counter()
    for one in stats:
        counts.update({str(k): n for k, n in ((one or {}).get("k_histogram") or {}).items()})
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0]))) or None


def peak_rss_gb(pid: int, *, reset: bool = False) -> float | None:
    """The process's peak resident memory (VmHWM); `reset` starts a new peak (clear_refs 5)."""
    try:
        if reset:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            return None
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1e6 for line in status  # kB -> GB
                 if line.startswith("VmHWM:")), None)


MEDIANS = ("aggregate_tps", "ttft_p50_s", "itl_p50_s", "itl_p99_s", "from_draft_fraction")
IN_PROCESS = ("peak_gb", "decode_tps", "forward_bound_tps",  # --in-process only
              "target_share", "draft_share", "target_over_table")
RATIOS = {"aggregate_tps": "ratio_aggregate", "ttft_p50_s": "ratio_ttft",
          "itl_p99_s": "ratio_itl_p99", "peak_rss_gb": "ratio_peak_rss"}


def level_row(name: str, concurrency: int, runs: list[dict], peak_gb: float | None) -> dict:
    """A server's row of a level: the medians of its runs; counts summed."""
    return {"server": name, "concurrency": concurrency, "runs": len(runs),
            **{k: sum(r[k] for r in runs)
               for k in ("requests", "completed", "errors", "retries", "tokens")},
            "all_answered": all(r["errors"] == 0 for r in runs),
            **{k: summarize([r.get(k) for r in runs]).median for k in MEDIANS},
            **{k: summarize([r[k] for r in runs]).median for k in IN_PROCESS if k in runs[0]},
            "peak_rss_gb": peak_gb if peak_gb is not None else
            summarize([r.get("peak_gb") for r in runs]).median,
            "aggregate_tps_runs": [r["aggregate_tps"] for r in runs],
            "k_histogram": k_histogram({"k_histogram": r.get("k_histogram")} for r in runs),
            "error_messages": list(dict.fromkeys(m for r in runs for m in r["error_messages"]))}


def add_ratios(rows: list[dict]) -> None:
    """On each other server's row of a level: ours (the first row) over theirs."""
    for row in rows:
        for key, name in RATIOS.items():
            row[name] = None if row is rows[0] else ratio(rows[0][key], row[key])


async def interleaved(names: list[str], measure, args, *, on_row=lambda row: None,
                      log=sys.stderr) -> list[dict]:
    """`args.warmup` short unmeasured requests per server, then per level `args.runs` runs of
    every server (`measure(name, c, first_prompt)`), the first rotating; a row per server."""
    for i in range(args.warmup):
        for name in names:
            await measure(name, 1, i, 8)  # 8 tokens
    pids, first, rows = getattr(args, "pids", {}), args.warmup, []
    for level, concurrency in enumerate(args.concurrency):
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for name in pids:
            peak_rss_gb(pids[name], reset=True)
        for r in range(args.runs):
            shift = (level + r) % len(names)
            for name in names[shift:] + names[:shift]:
                print(f"  {concurrency} stream(s), run {r + 1} on {name}", file=log)
                runs[name].append(await measure(name, concurrency, first))
            first += concurrency
        level_rows = [level_row(name, concurrency, runs[name], peak_rss_gb(pids[name])
                                if name in pids else None) for name in names]
        add_ratios(level_rows)
        for row in level_rows:
            on_row(row)
        rows += level_rows
    return rows


async def run_load(servers: list[tuple[str, str]], args, *, transports=None,
                   clock=time.perf_counter, on_row=lambda row: None, log=sys.stderr) -> list[dict]:
    """Every level on every server over HTTP."""
    urls, transports = dict(servers), transports or {}

    async def measure(name: str, concurrency: int, first: int, max_tokens=None) -> dict:
        return level_figures(await run_level(name, urls[name], concurrency, first, args, max_tokens,
                                             transport=transports.get(name), clock=clock))

    return await interleaved(list(urls), measure, args, on_row=on_row, log=log)


@dataclass
class ForwardClock:
    """Where a decoding phase's time went: in the target's batch forwards, in drafting (the
    draft model's forwards and the choice of its tokens), and what the cost model's table
    (`StepCosts`) expected the target's forwards to take."""

    target_s: float = 0.0
    draft_s: float = 0.0
    target_table_s: float = 0.0

    def figures(self, decoding_s: float) -> dict:
        return {"target_share": self.target_s / decoding_s,
                "draft_share": self.draft_s / decoding_s,
                "target_over_table": ratio(self.target_s, self.target_table_s)}


@contextmanager
def forward_clock(scheduler: Scheduler) -> Iterator[ForwardClock]:
    """Times, while open, the target's `ModelBatch.forward`s, each evaluated before the clock
    stops (the round reads its logits right after: one more host sync), and each round's
    drafting (`decoder._draft_with_model`, which ends with its own sync): no draft step is
    evaluated apart, so the cost model's calibration of drafting rounds is not disturbed.
    Not thread-safe: the in-process benchmark runs one engine at a time, on this thread."""
    clock = ForwardClock()
    forward, drafting = ModelBatch.forward, decoder._draft_with_model

    def timed_forward(batch: ModelBatch, inputs: mx.array, **kwargs) -> mx.array:
        if batch.model is not scheduler.kit.target.model:
            return forward(batch, inputs, **kwargs)
        start = time.perf_counter()
        logits = forward(batch, inputs, **kwargs)
        mx.eval(logits)
        clock.target_s += time.perf_counter() - start
        clock.target_table_s += scheduler.costs.target.at(*inputs.shape)
        return logits

    def timed_drafting(*args, **kwargs):
        start = time.perf_counter()
        try:
            return drafting(*args, **kwargs)
        finally:
            clock.draft_s += time.perf_counter() - start

    ModelBatch.forward, decoder._draft_with_model = timed_forward, timed_drafting
    try:
        yield clock
    finally:
        ModelBatch.forward, decoder._draft_with_model = forward, drafting


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """The last `tokens` tokens of a chat prompt made of the load prompts one after another."""
    text, ids = "", []
    for i in itertools.count():
        text += prompt(i) + "\n"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        if len(ids) >= tokens:
            return ids[-tokens:]


def in_process(args, on_row, log) -> list[dict]:
    """Ours with and without the draft against `BatchGenerator`, C requests at once."""
    target, draft = (args.target_model, args.draft_model) if args.target_model else generated_pair()
    model, tokenizer = mlx_load(target)
    batch, n = max(args.concurrency), args.max_tokens

    def figures(ids: list, tokens: int, start: float, from_draft: int | None, **more) -> dict:
        return {"requests": len(ids), "completed": len(ids), "errors": 0, "retries": 0,
                "error_messages": [], "tokens": tokens,
                "aggregate_tps": tokens / (time.perf_counter() - start),
                "from_draft_fraction": ratio(from_draft, tokens),
                "peak_gb": (peak_bytes() - weights) / 1e9, **more}

    def ours(kit, k: int):
        scheduler = Scheduler(kit, SchedulerConfig(max_batch_size=batch, max_queue_size=batch))
        scheduler.measure_costs()  # as the server does (engine.cost_model): each row's k
        scheduler.memory = gate_for(kit, memory_budget(),  # and admits by memory
                                    scheduler.config.idle_prefill_chunk)

        def run(ids: list[list[int]]) -> dict:
            seqs = [scheduler.submit(GenerationParams(tuple(p), n, speculation=SpeculationParams(
                num_draft_tokens=k)), lambda event: None) for p in ids]
            start = time.perf_counter()
            while any(s.phase in (Phase.WAITING, Phase.PREFILL) for s in seqs):
                scheduler.step()
            decoding, before = time.perf_counter(), sum(len(s.output) for s in seqs)
            with forward_clock(scheduler) as clock:
                while any(s.phase is not Phase.DONE for s in seqs):
                    scheduler.step()
            decoding = time.perf_counter() - decoding
            stats = [s.stats() for s in seqs]
            tokens = sum(s.generation_tokens for s in stats)
            bound = len(ids) / scheduler.costs.target.at(len(ids), 1)
            return figures(ids, tokens, start, sum(s.draft_tokens_accepted for s in stats),
                           decode_tps=(tokens - before) / decoding, forward_bound_tps=bound,
                           **clock.figures(decoding))

        return run

    def batch_generator(ids: list[list[int]]) -> dict:
        gen = BatchGenerator(model, max_tokens=n, stop_tokens=[[-1]])
        start, tokens, done = time.perf_counter(), 0, 0
        gen.insert(ids, [n] * len(ids))
        while done < len(ids):
            for r in gen.next_generated():
                tokens += 1
                done += r.finish_reason is not None
        return figures(ids, tokens, start, None)

    with_draft = ModelKit(load_model(target))
    with_draft.load_draft(draft)
    engines = {"ours+draft": ours(with_draft, 4), "ours": ours(ModelKit(load_model(target)), 0),
               "mlx_lm": batch_generator}
    weights = mx.get_active_memory()  # every engine's weights: a run's peak is what it adds

    async def measure(name: str, concurrency: int, first: int, max_tokens=None) -> dict:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": prompt(first + i)}],
                                             add_generation_prompt=True)
               for i in range(concurrency)]
        if args.long_prompt and max_tokens is None:  # not the warm-up's
            ids[0] = long_prompt(tokenizer, args.long_prompt)
        reset_peak()
        return engines[name](ids)  # the warm-up's too: of the engines' max_tokens

    return asyncio.run(interleaved(list(engines), measure, args, on_row=on_row, log=log))


def answered(row: dict) -> str:
    """"completed/requests", and how many connection retries it took (as the OpenAI SDK's);
    result files written before retries were counted have none."""
    retries = row.get("retries", 0)
    return f"{row['completed']}/{row['requests']}" + (f" ({retries} retried)" if retries else "")


def table(rows: list[dict]) -> list[list[str]]:
    lines = [["streams", "server", "agg tok/s", "TTFT p50 s", "ITL p99 ms", "from draft",
              "peak GB", "answered", "agg ratio", "TTFT ratio", "ITL p99 ratio", "mem ratio"]]
    for r in rows:
        itl = None if r["itl_p99_s"] is None else r["itl_p99_s"] * 1000
        lines.append([str(r["concurrency"]), r["server"], num(r["aggregate_tps"], ".1f"),
                      num(r["ttft_p50_s"], ".3f"), num(itl, ".1f"),
                      num(r["from_draft_fraction"], ".2f"), num(r["peak_rss_gb"], ".2f"),
                      answered(r),
                      *(num(r[k], ".2f", suffix="x") for k in RATIOS.values())])
    if any("forward_bound_tps" in r for r in rows):  # --in-process: the decoding phase alone
        lines[0] += ["decode tok/s", "forward bound", "of bound", "in target fwd",
                     "in drafting", "target fwd / table"]
        for line, r in zip(lines[1:], rows, strict=True):
            decode, bound = r.get("decode_tps"), r.get("forward_bound_tps")
            line += [num(decode, ".1f"), num(bound, ".1f"), num(ratio(decode, bound), ".2f"),
                     *(num(r.get(k), ".2f") for k in ("target_share", "draft_share")),
                     num(r.get("target_over_table"), ".2f", suffix="x")]
    if any(r.get("k_histogram") for r in rows):  # ours: rounds by their drafted tokens
        lines[0].append("rounds by k")
        for line, r in zip(lines[1:], rows, strict=True):
            line.append(" ".join(f"{k}:{n}" for k, n in (r.get("k_histogram") or {}).items())
                        or "-")
    return lines


def _pid(text: str) -> tuple[str, int]:
    name, _, pid = text.rpartition("=")
    if not name or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PID: {text!r}")
    return name, int(pid)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = results.parser("load", __doc__, api=True, servers="optional")
    a = p.add_argument
    a("--concurrency", type=results.int_list, default=[1, 2, 4, 8, 16, 32], metavar="C,...",
      help="Concurrent streams per level.")
    a("--max-tokens", type=int, default=96, help="Tokens per request.")
    a("--runs", type=int, default=1, help="Interleaved runs per server and level; medians.")
    a("--pid", type=_pid, action="append", default=[], metavar="NAME=PID",
      help="Report this server process's peak RSS (VmHWM), read after each level.")
    a("--timeout", type=float, default=300.0, help="Seconds one request may take.")
    a("--warmup", type=int, default=1, help="Unmeasured short requests per server first.")
    a("--in-process", action="store_true", help="Our scheduler against BatchGenerator, no HTTP.")
    a("--target-model", help="--in-process: the target (default: the generated pair's).")
    a("--draft-model", help="--in-process: the draft (default: the generated pair's).")
    a("--long-prompt", type=int, default=0, metavar="TOKENS",
      help="--in-process: the first request of each level has a prompt this many tokens long"
      " (the others as usual): rows of very different lengths in one batch.")
    args = p.parse_args(argv)
    servers = ([args.server] if args.server else []) + args.compare
    names = [name for name, _ in servers]
    results.check(p, [
        (not args.in_process and not args.server, "--server is required (or --in-process)"),
        (args.in_process and servers, "--in-process runs no server: drop --server/--compare"),
        (bool(args.target_model) != bool(args.draft_model),
         "--target-model and --draft-model go together"),
        (args.max_tokens < 2, "--max-tokens must be >= 2"), (args.runs < 1, "--runs must be >= 1"),
        (args.warmup < 0, "--warmup must be >= 0"), (args.timeout <= 0, "--timeout must be > 0"),
        (args.long_prompt < 0, "--long-prompt must be >= 0"),
        (args.long_prompt and not args.in_process, "--long-prompt goes with --in-process"),
        (len(set(names)) != len(names), f"servers need distinct names (NAME=URL): {names}"),
        (any(n not in names for n, _ in args.pid), "--pid NAME must name a server")])
    args.servers, args.pids = servers, dict(args.pid)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    writer = results.ResultsWriter(args.results_dir, "load", args.tag)
    meta = results.environment(target_model=args.target_model, draft_model=args.draft_model)
    if args.in_process:
        rows = in_process(args, writer.write_row, sys.stderr)
    else:
        meta["servers"] = [server_health(*s) for s in args.servers]
        args.models = {s["name"]: s["target"] for s in meta["servers"]}
        rows = asyncio.run(run_load(args.servers, args, on_row=writer.write_row, log=sys.stderr))
    results.save("load", argv, args, meta, rows, table, writer=writer)
    return 0


# -- distributed --------------------------------------------------------------------------------
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def layout_figures(args: argparse.Namespace, layout=None) -> dict:
    """Every figure of one layout (one process when `layout` is None), on a started engine."""
    engine = build_engine(EngineConfig(
        model=args.target_model, draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens, prefix_cache_bytes=0,
        distributed=None if layout is None else DistributedConfig(layout)))
    engine.start()
    try:
        ids, k = list(engine.tokenizer.encode(PROMPT)), args.num_draft_tokens

        def run(max_tokens: int, draft_k: int):
            spec = SpeculationParams(num_draft_tokens=draft_k, required=draft_k > 0)
            return engine_stats(engine, GenerationParams(
                tuple(ids), max_tokens, ignore_eos=True, cache_prompt=False, speculation=spec))

        run(8, 0)  # warm-up
        tps = {name: statistics.median(run(args.max_tokens, draft_k).generation_tps
                                       for _ in range(args.reps))
               for name, draft_k in [("plain", 0)] + ([("draft", k)] if engine.draft else [])}
        timed: Future = Future()  # on the engine's MLX thread, where every collective runs
        engine.scheduler.call(lambda: time_forwards(
            engine.kit.target.model, rows=(1,), tokens=(1, k + 1), context=args.context,
            reps=args.reps * 3), lambda times, error: timed.set_exception(error) if error
            else timed.set_result(times))
        times = timed.result()
        shards = engine.distributed
        return {"tps": tps, "forward_s": dict(zip(map(str, times.tokens), times.seconds[0],
                                                  strict=True)),
                "rank_memory_gb": shards["rank_memory_gb"] if shards else
                [round(asyncio.run(engine.memory())["active_gb"], 4)]}
    finally:
        engine.stop()


def distributed_report(single: dict, dist: dict, k: int) -> str:
    """The figures of both layouts side by side, ranks over one process."""
    one, block = "1", str(k + 1)
    rows = [(f"decode tok/s, {cell}", single["tps"][cell], dist["tps"][cell])
            for cell in single["tps"]]
    rows += [(f"forward of {width} token(s), ms", single["forward_s"][width] * 1e3,
              dist["forward_s"][width] * 1e3) for width in (one, block)]
    rows.append(("k+1 / 1 forward time", *(f["forward_s"][block] / f["forward_s"][one]
                                           for f in (single, dist))))
    if "draft" in single["tps"]:
        rows.append(("draft / plain tok/s", *(f["tps"]["draft"] / f["tps"]["plain"]
                                              for f in (single, dist))))
    lines = [["", "1 process", f"{dist['world_size']} ranks", "ratio"]] + [
        [name, f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}"] for name, a, b in rows]
    return aligned(lines) + f"\nrank memory GB: 1 process {single['rank_memory_gb']}, ranks " \
        f"{dist['rank_memory_gb']}"


def distributed_main(argv: list[str]) -> None:
    """`mlx-spec-bench distributed`: a target sharded with mlx.launch against one process."""
    p = argparse.ArgumentParser(prog="mlx-spec-bench distributed",
                                description="A sharded target against one process.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target-model", required=True, help="Target model folder (sharded).")
    a("--draft-model", default=None, help="Draft model folder (rank 0 only).")
    a("--ranks", type=int, default=2, help="Processes to shard over.")
    a("--mode", choices=["tensor", "pipeline"], default="tensor", help="How to shard.")
    a("--num-draft-tokens", type=int, default=4, help="k.")
    a("--max-tokens", type=int, default=64, help="Tokens per request.")
    a("--context", type=int, default=128, help="Context before the timed forwards.")
    a("--reps", type=int, default=3, help="Requests / forwards per cell (median).")
    a("--out", type=Path, default=None, help="Write the results here as JSON.")
    a("--result-file", type=Path, default=None, help=argparse.SUPPRESS)  # set: under mlx.launch
    args = p.parse_args(argv)
    if args.result_file is not None:  # inside mlx.launch: rank 0 measures, the others follow
        layout = launched_layout(args.mode)
        if layout.rank > 0:
            run_follower(layout, args.target_model, timeout_s=600, drain_timeout_s=10)
            return
        args.result_file.write_text(json.dumps({
            **layout_figures(args, layout), "world_size": layout.world_size,
            "backend": layout.backend, "mode": layout.mode}))
        return
    single = layout_figures(args)
    with tempfile.TemporaryDirectory() as folder:  # the same command on each rank
        result_file = Path(folder) / "result.json"
        subprocess.run([str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring",
                        "-n", str(args.ranks), "--", sys.executable, "-m", "server.bench",
                        "distributed", *argv, "--result-file", str(result_file)], check=True)
        dist = json.loads(result_file.read_text())
    print(distributed_report(single, dist, args.num_draft_tokens))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "single": single, "distributed": dist}, indent=1))
