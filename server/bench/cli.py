"""`python -m server.bench`: sweep the draft length k and see whether speculation pays.

For each prompt kind: a baseline (no draft) and one cell per k, each `--warmup` runs then
`--reps` measured runs, greedy by default, the same models and prompt tokens in every cell.
Runs the engine in this process, or any OpenAI-compatible server (`--server URL`), or two
servers interleaved cell by cell (`--compare URL2`). Writes RESULTS/<name>.{jsonl,csv,json,png}.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import get_args

from server.bench.cells import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_PROMPT_KINDS,
    PROMPT_KINDS,
    plan_cells,
)
from server.bench.http_runner import TIMEOUT_S, ServerUnreachable
from server.bench.report import format_table
from server.bench.stats import verdicts
from server.bench.sweep import SweepSettings, sweep
from server.bench.writer import ResultsWriter, results_name
from server.engine.params import DraftSource, SpeculationParams

DEFAULT_MAX_TOKENS = 320
DEFAULT_REPS = 5
DEFAULT_WARMUP = 1


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4: {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4: {text!r}")
    return list(dict.fromkeys(values))


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in PROMPT_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown prompt kind(s) {unknown}; choose from {', '.join(PROMPT_KINDS)}")
    return list(dict.fromkeys(kinds))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.bench",
                                description=__doc__.splitlines()[0])
    models = p.add_argument_group("models (in-process runs; with --server: only to measure c)")
    models.add_argument("--target-model", help="Target model (default: models/demo/target, "
                        "else a generated pair in models/generated).")
    models.add_argument("--draft-model", help="Draft model (default: the target's pair).")
    sweep_args = p.add_argument_group("sweep")
    sweep_args.add_argument("--draft-tokens", type=_int_list, default=list(DEFAULT_DRAFT_TOKENS),
                            metavar="K,K,...", help="Draft lengths to sweep (default 1,2,4,8,16).")
    sweep_args.add_argument("--prompt-kinds", type=_kinds, default=list(DEFAULT_PROMPT_KINDS),
                            metavar="KIND,...",
                            help=f"Of {', '.join(PROMPT_KINDS)} (default structured,open_ended).")
    sweep_args.add_argument("--reps", type=int, default=DEFAULT_REPS,
                            help=f"Measured runs per cell (default {DEFAULT_REPS}).")
    sweep_args.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                            help=f"Discarded runs before them (default {DEFAULT_WARMUP}).")
    sweep_args.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                            help=f"Tokens per run (default {DEFAULT_MAX_TOKENS}).")
    sweep_args.add_argument("--temp", type=float, default=0.0,
                            help="Sampling temperature (default 0: greedy).")
    sweep_args.add_argument("--seed", type=int, default=0, help="Seed of the first rep.")
    sweep_args.add_argument("--smoke", action="store_true",
                            help="1 rep, no warm-up, the first prompt kind, the first two k.")
    spec = p.add_argument_group("speculation")
    spec.add_argument("--draft", choices=get_args(DraftSource), default="model",
                      help="Draft with the draft model, by prompt lookup (no draft model), or "
                           "hybrid (lookup when it finds a match, the draft model when not).")
    spec.add_argument("--acceptance", choices=["exact", "rejection"],
                      default=SpeculationParams().acceptance,
                      help="Acceptance rule at --temp > 0.")
    spec.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False,
                      help="Adapt k per round (default off: the sweep measures a fixed k, "
                           "which the theory column models).")
    spec.add_argument("--draft-p-min", type=float, default=0.0,
                      help="End a round's drafting at the first token whose draft "
                           "probability is below this (the request's draft_p_min).")
    spec.add_argument("--hybrid-min-match", type=int, choices=(1, 2, 3),
                      default=SpeculationParams().hybrid_min_match,
                      help="With --draft hybrid: draft by prompt lookup only where the last this-"
                           "many tokens occurred before (the request's hybrid_min_match).")
    spec.add_argument("--cost-ratio", type=float,
                      help="Draft/target cost per token, c (default: measured).")
    remote = p.add_argument_group("servers")
    remote.add_argument("--server", metavar="URL",
                        help="Run the cells through this OpenAI-compatible server.")
    remote.add_argument("--compare", metavar="URL2",
                        help="Also run every cell on URL2, interleaved; report URL/URL2 ratios.")
    remote.add_argument("--api-key", help="Bearer key for the server(s).")
    remote.add_argument("--timeout", type=float, default=TIMEOUT_S,
                        help=f"Seconds a server may stay silent in a request (default "
                             f"{TIMEOUT_S:g}); then the cell fails.")
    out = p.add_argument_group("output")
    out.add_argument("--results-dir", type=Path, default=Path("RESULTS"),
                     help="Where the files go (default RESULTS).")
    out.add_argument("--tag", help="Appended to the results' file name.")
    out.add_argument("--dry-run", action="store_true",
                     help="Synthetic rows through the same writer; loads no model.")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (tok/s needs two tokens)")
    if args.temp < 0:
        p.error("--temp must be >= 0")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    if args.compare and not args.server:
        p.error("--compare URL2 needs --server URL")
    if args.draft == "prompt_lookup" and args.draft_model:
        p.error("--draft prompt_lookup drafts from the prompt: drop --draft-model")
    local = not (args.server or args.dry_run)
    if local and args.draft != "prompt_lookup" and args.target_model and not args.draft_model:
        p.error("--target-model needs --draft-model (or --draft prompt_lookup)")
    if args.smoke:
        args.reps, args.warmup = 1, 0
        args.prompt_kinds = args.prompt_kinds[:1]
        args.draft_tokens = args.draft_tokens[:2]
    return args


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.target_model is None:
        from server.model_files.bundled import demo_or_generated_pair

        target, draft = demo_or_generated_pair()
        draft = args.draft_model or draft
    else:
        target, draft = args.target_model, args.draft_model
    return target, (None if args.draft == "prompt_lookup" else draft)


def speculation_of(args: argparse.Namespace) -> SpeculationParams:
    return SpeculationParams(source=args.draft, acceptance=args.acceptance,
                             adaptive=args.adaptive, draft_p_min=args.draft_p_min,
                             hybrid_min_match=args.hybrid_min_match)


def _distinct_labels(runners: list) -> list:
    """Comparing a server with itself (an A/A test of the noise) still needs two names."""
    if len(runners) == 2 and runners[0].label == runners[1].label:
        runners[1].label += " (again)"
    return runners


def make_runners(args: argparse.Namespace, log) -> tuple[list, dict]:
    """The runners and what the run loaded (for the metadata)."""
    spec = speculation_of(args)
    if args.dry_run:
        from server.bench.runners import SyntheticRunner

        labels = [u for u in (args.server, args.compare) if u] or ["dry-run"]
        return _distinct_labels([SyntheticRunner(label, speculation=spec)
                                 for label in labels]), {}
    if args.server:
        from server.bench.http_runner import HttpRunner

        urls = [u for u in (args.server, args.compare) if u]
        return _distinct_labels([
            HttpRunner(u, speculation=spec, temperature=args.temp, api_key=args.api_key,
                       timeout=args.timeout)
            for u in urls]), {}
    from server.bench.runners import EngineRunner

    target, draft = resolve_models(args)
    print(f"Loading target {target}" + (f" and draft {draft}" if draft else ""), file=log)
    runner = EngineRunner(target, draft, speculation=spec, temperature=args.temp)
    return [runner], {"target_model": target, "draft_model": draft}


def cost_ratio(args: argparse.Namespace, runners: list) -> float | None:
    """c for the theory column: given, measured on the loaded models, or N/A."""
    if args.cost_ratio is not None:
        return args.cost_ratio
    if args.draft == "prompt_lookup":
        return 0.0
    if hasattr(runners[0], "cost_ratio"):
        return runners[0].cost_ratio()
    if args.target_model and args.draft_model:  # servers: measure the same pair here
        from server.bench.runners import measure_cost_ratio
        from server.engine.model_kit import ModelKit, load_model

        kit = ModelKit(load_model(args.target_model))
        draft = load_model(args.draft_model, dequantize=True)
        c = measure_cost_ratio(kit.target.model, draft.model)
        del kit, draft
        ModelKit._free()
        return c
    return None


def environment() -> dict:
    import mlx.core as mx

    def version(pkg: str) -> str | None:
        try:
            return importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "machine": platform.machine(), "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(), "os": platform.platform(),
        "python": platform.python_version(), "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"), "mlx_device": str(mx.default_device()),
        "git_commit": commit,
    }


def _args_dict(args: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k != "api_key"}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = sys.stderr
    from server.engine.model_kit import IncompatibleDraft, ModelLoadError

    try:
        runners, loaded = make_runners(args, log)
    except (ModelLoadError, IncompatibleDraft, ServerUnreachable) as e:
        print(f"error: {e}", file=log)
        return 1
    return run_sweep(args, runners, loaded, log)


def run_sweep(args: argparse.Namespace, runners: list, loaded: dict, log) -> int:
    from tqdm import tqdm

    c = cost_ratio(args, runners)
    settings = SweepSettings(
        reps=args.reps, warmup=args.warmup, max_tokens=args.max_tokens,
        temperature=args.temp, seed=args.seed, drafter=args.draft,
        acceptance=args.acceptance, adaptive=args.adaptive,
    )
    cells = plan_cells(args.prompt_kinds, args.draft_tokens)
    writer = ResultsWriter(args.results_dir, results_name(args.tag))
    started = time.time()
    meta = {
        "name": writer.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dry_run": args.dry_run, "environment": environment(), "args": _args_dict(args),
        "runners": [r.describe() for r in runners], **loaded, "cost_ratio": c,
        "cells": len(cells) * len(runners),
    }
    print(f"{len(cells)} cells x {len(runners)} runner(s), {args.warmup} warm-up + "
          f"{args.reps} reps each, {args.max_tokens} tokens; c = "
          f"{'n/a' if c is None else f'{c:.3f}'}; writing {writer.paths['jsonl']}", file=log)
    bar = tqdm(total=len(cells) * len(runners), unit="cell", file=log, dynamic_ncols=True)
    rows: list[dict] = []
    interrupted = False
    try:
        sweep(runners, cells, settings, cost_ratio=c,
              on_row=lambda row: (writer.write_row(row), rows.append(row)),
              on_start=lambda cell, label: bar.set_postfix_str(
                  cell.label() + (f" @ {label}" if len(runners) > 1 else "")),
              on_done=lambda cell, label: bar.update(1))
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: writing what was done", file=log)
    finally:
        bar.close()
        for runner in runners:
            runner.close()
    results = verdicts(rows)
    meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                elapsed_s=round(time.time() - started, 2), interrupted=interrupted)
    written = writer.finish(meta, rows, results)
    print()
    print(format_table(rows))
    print()
    for v in results:
        print(v.line())
    print()
    for path in written.values():
        print(f"wrote {path}")
    return 130 if interrupted else 0
