"""`mlx-spec-bench sweep`: sweep the draft length k and see whether speculation pays.

Per prompt kind a baseline and a cell per k, `--warmup` then `--reps` runs each, in this process,
through `--server`, or two interleaved (`--compare`). Verdicts: P1 some k beats the baseline
(IQRs apart), P2 tok/s peaks inside the k swept, P3 `structured` accepts more than `open_ended`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from server.bench import results
from server.bench.results import num, ratio, summarize
from server.bench.runners import TIMEOUT_S, EngineRunner, HttpRunner, StreamFailed
from server.engine.errors import IncompatibleDraft, ModelLoadError
from server.engine.params import DraftSource, SpeculationParams
from server.model_files.bundled import demo_or_generated_pair

_PROMPTS = results.PROMPTS["sweep"]
STRUCTURED, OPEN_ENDED = _PROMPTS["structured"], _PROMPTS["open_ended"]
PROMPT_KINDS = {"structured": STRUCTURED, "open_ended": OPEN_ENDED, "repeat_edit": (
    f"{_PROMPTS['repeat_edit_instruction']}\n\n```python\n{_PROMPTS['repeat_edit_code']}```")}


class Cell(NamedTuple):
    """One point of the sweep: a prompt kind and a draft length (0 = the baseline)."""

    kind: str
    k: int

    @property
    def prompt(self) -> str:
        return PROMPT_KINDS[self.kind]


def plan_cells(kinds: list[str], draft_tokens: list[int]) -> list[Cell]:
    """Per kind: the baseline first (speedups need it), then each k in the order given."""
    return [Cell(kind, k) for kind in kinds for k in (0, *draft_tokens)]


def theoretical_speedup(a: float, k: float, c: float) -> float:
    """Speculative decoding's expected speedup (Leviathan et al. 2023, eq. 1), `a` the per-token
    acceptance, `c` a draft forward's cost over the target's: (1 - a^(k+1)) / (1 - a) / (1 + kc)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    return (k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)) / (1 + k * c)  # tokens/round


def per_token_acceptance(rate: float, k: float) -> float:
    """The `a` of `theoretical_speedup` from a measured accepted/proposed `rate`: a round stops
    at its first rejection, so rate = a (1 - a^k) / (k (1 - a)), inverted by bisection."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    if rate in (0.0, 1.0) or k <= 1:
        return rate
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * (1 - mid**k) / (k * (1 - mid)) < rate else (lo, mid)
    return (lo + hi) / 2


class Verdict(NamedTuple):
    id: str
    claim: str
    verdict: str  # PASS | FAIL | N-A
    detail: str
    server: str | None = None  # set when a sweep compared two servers


def _ok(rows: list[dict], *, baseline: bool | None = None) -> list[dict]:
    return [r for r in rows if r.get("error") is None and r.get("tps_median") is not None
            and (baseline is None or (r["k"] == 0) == baseline)]


def verdict_beats_baseline(rows: list[dict]) -> Verdict:
    """P1: some k is faster than the baseline of its kind, their IQRs not overlapping."""
    claim = "some k beats the baseline"
    base = {r["kind"]: r for r in _ok(rows, baseline=True)}
    if not (spec := [r for r in _ok(rows, baseline=False) if r["kind"] in base]):
        return Verdict("P1", claim, "N-A", "no baseline and speculative cells to compare")
    best = max(spec, key=lambda r: r["tps_median"] / base[r["kind"]]["tps_median"])
    b = base[best["kind"]]
    detail = (f"best {best['kind']} k={best['k']}: {best['tps_median']:.1f} tok/s "
              f"[Q1 {best['tps_q1']:.1f}] vs baseline {b['tps_median']:.1f} "
              f"[Q3 {b['tps_q3']:.1f}], {best['tps_median'] / b['tps_median']:.2f}x")
    return Verdict("P1", claim, "PASS" if best["tps_q1"] > b["tps_q3"] else "FAIL", detail)


def verdict_interior_maximum(rows: list[dict]) -> Verdict:
    """P2: per kind, the fastest k is neither the smallest nor the largest k swept."""
    spec = _ok(rows, baseline=False)
    parts, found = [], []
    for kind in dict.fromkeys(r["kind"] for r in spec):
        cells = [r for r in spec if r["kind"] == kind]
        if len(cells) < 3:
            parts.append(f"{kind}: fewer than 3 k values")
            continue
        ks, best = sorted(r["k"] for r in cells), max(cells, key=lambda r: r["tps_median"])
        found.append(ks[0] < best["k"] < ks[-1])
        parts.append(f"{kind}: best k={best['k']} of {ks[0]}..{ks[-1]} "
                     f"({best['tps_median']:.1f} tok/s)")
    verdict = "N-A" if not found else "PASS" if all(found) else "FAIL"
    return Verdict("P2", "tok/s vs k has an interior maximum", verdict,
                   "; ".join(parts) or "no speculative cells")


def verdict_structured_accepts_more(rows: list[dict]) -> Verdict:
    """P3: accepted/proposed, pooled over every k, is higher on `structured` than `open_ended`."""
    claim, pooled = "acceptance on structured > open_ended", {}
    for kind in ("structured", "open_ended"):
        cells = [r for r in _ok(rows, baseline=False) if r["kind"] == kind]
        acc, prop = (sum(r.get(key) or 0 for r in cells) for key in ("accepted", "proposed"))
        if prop:
            pooled[kind] = f"{kind} {acc / prop:.3f} ({acc}/{prop})", acc / prop
    if len(pooled) < 2:
        return Verdict("P3", claim, "N-A", "needs accepted/proposed on both kinds")
    (s, s_rate), (o, o_rate) = pooled["structured"], pooled["open_ended"]
    return Verdict("P3", claim, "PASS" if s_rate > o_rate else "FAIL", f"{s} vs {o}")


def verdicts(rows: list[dict]) -> list[Verdict]:
    """P1-P3, for each server separately when a sweep compared two."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    checks = (verdict_beats_baseline, verdict_interior_maximum, verdict_structured_accepts_more)
    found = [(server, check([r for r in rows if r["server"] == server]))
             for server in servers or [None] for check in checks]
    return [v._replace(server=server) if len(servers) > 1 else v for server, v in found]


def cell_row(cell: Cell, runs: list[dict], *, server: str, args, error=None) -> dict:
    """One row: medians, IQRs and robust CVs of the reps, plus pooled draft counts."""
    tps = summarize([r["tps"] for r in runs])

    def spread(name: str, values: list) -> dict:
        s = summarize(values)
        return {f"{name}_median": s.median, f"{name}_iqr": s.iqr}

    proposed, accepted, rounds = (
        sum(vals) if vals and None not in vals else None
        for vals in ([r[key] for r in runs] for key in ("proposed", "accepted", "rounds")))
    spec = cell.k > 0
    return {
        "server": server, "kind": cell.kind, "k": cell.k, "drafter": args.draft if spec else None,
        "acceptance_rule": args.acceptance if spec else None,
        "adaptive": args.adaptive if spec else None, "temperature": args.temp,
        "max_tokens": args.max_tokens, "reps": len(runs), "warmup": args.warmup, "error": error,
        "tps_median": tps.median, "tps_iqr": tps.iqr, "tps_q1": tps.q1, "tps_q3": tps.q3,
        "tps_cv": tps.cv, "flagged": tps.noisy,
        "speedup": None, "theory": None, "alpha": None, "cost_ratio": None,
        **spread("accept_rate", [ratio(r["accepted"], r["proposed"]) for r in runs]),
        **spread("from_draft", [ratio(r["from_draft"], r["tokens"]) for r in runs]),
        **spread("peak_gb", [r["peak_gb"] for r in runs]),
        "tokens_median": summarize([r["tokens"] for r in runs]).median,
        "prompt_tokens": runs[0]["prompt_tokens"] if runs else None,
        "ttft_median": summarize([r["ttft_s"] for r in runs]).median,
        "proposed": proposed, "accepted": accepted, "rounds": rounds,
        "k_mean": ratio(proposed, rounds) if rounds else (cell.k or None),
        "compare_with": None, "compare_ratio": None, "tps_reps": [r["tps"] for r in runs]}


def sweep(runners: list, cells: list[Cell], args, cost_ratio: float | None, log) -> Iterator:
    """Each cell on each runner in turn; yields the cell's rows as soon as it is done."""
    baselines: dict[tuple[str, str], dict] = {}
    for cell in cells:
        cell_rows = []
        for runner in runners:
            print(f"  {cell.kind} k={cell.k} @ {runner.label}", file=log)
            runs, error = [], None
            try:
                for i in range(args.warmup):  # discarded
                    runner.run(cell, max_tokens=args.max_tokens, seed=args.reps + i)
                runs = [runner.run(cell, max_tokens=args.max_tokens, seed=i)
                        for i in range(args.reps)]
            except Exception as e:  # a failed cell is data: record it, go on with the sweep
                error = f"{type(e).__name__}: {e}"
            row = cell_row(cell, runs, server=runner.label, args=args, error=error)
            base = baselines.setdefault((runner.label, cell.kind), row)  # k = 0 comes first
            row["cost_ratio"] = cost_ratio  # measured speedup, and the speedup model's
            if row["error"] is None and base["error"] is None:
                row["speedup"] = ratio(row["tps_median"], base["tps_median"])
            if cell.k == 0:
                row["theory"] = 1.0 if row["error"] is None else None
            elif row["proposed"] and cost_ratio is not None:
                k = row["k_mean"]
                row["alpha"] = per_token_acceptance(row["accepted"] / row["proposed"], k)
                row["theory"] = theoretical_speedup(row["alpha"], k, cost_ratio)
            cell_rows.append(row)
        if len(cell_rows) == 2:
            first, second = cell_rows
            r = ratio(first["tps_median"], second["tps_median"])
            for row, other in ((first, second), (second, first)):
                row["compare_with"], row["compare_ratio"] = other["server"], r
        yield from cell_rows


def table(rows: list[dict]) -> list[list[str]]:
    """The header, then a line per row (the console's table and `report`'s)."""
    compare = any(r["compare_with"] for r in rows)
    servers = len({r["server"] for r in rows}) > 1
    lines = [(["server"] if servers else []) + [
        "kind", "k", "tok/s median [IQR]", "speedup", "theory", "accepted/proposed",
        "from_draft", "peak GB", "flag"] + (["ratio"] if compare else [])]
    for r in rows:
        flag = f"ERROR {r['error'][:60]}" if r["error"] else "CV>0.10" if r["flagged"] else ""
        tps = "-" if r["tps_median"] is None else f"{r['tps_median']:.1f} [{r['tps_iqr']:.1f}]"
        acc = "-" if not r["k"] or r["proposed"] is None else \
            f"{r['accepted']}/{r['proposed']} {num(r['accept_rate_median'], '.3f', 'n/a')}"
        lines.append(([r["server"]] if servers else []) + [
            r["kind"], str(r["k"] or "base"), tps, num(r["speedup"], ".2f", suffix="x"),
            num(r["theory"], ".2f", suffix="x"), acc,
            num(r["from_draft_median"], ".3f") if r["k"] else "-",
            num(r["peak_gb_median"], ".3f"), flag,
        ] + ([num(r["compare_ratio"], ".2f")] if compare else []))
    return lines


def plot(rows: list[dict], path: Path, *, title: str = "") -> None:
    """tok/s vs k per prompt kind (the baseline dashed, the IQR shaded), acceptance on the right."""
    from matplotlib.figure import Figure

    kinds = list(dict.fromkeys(r["kind"] for r in rows)) or [""]
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig = Figure(figsize=(5.5 * len(kinds), 4.2))
    fig.subplots_adjust(bottom=0.13, top=0.86, wspace=0.45)
    for ax, kind in zip(fig.subplots(1, len(kinds), squeeze=False)[0], kinds, strict=True):
        acc_ax = ax.twinx()
        for i, server in enumerate(servers):
            mine = sorted((r for r in _ok(rows) if r["kind"] == kind and r["server"] == server),
                          key=lambda r: r["k"])
            name, style = f"{server}: " if len(servers) > 1 else "", {"color": f"C{i}"}
            for r in (r for r in mine if r["k"] == 0):
                ax.axhline(r["tps_median"], ls="--", label=f"{name}baseline", **style)
            if spec := [r for r in mine if r["k"]]:
                ks = [r["k"] for r in spec]
                ax.plot(ks, [r["tps_median"] for r in spec], marker="o",
                        label=f"{name}speculative", **style)
                ax.fill_between(ks, [r["tps_q1"] for r in spec], [r["tps_q3"] for r in spec],
                                alpha=0.2, **style)
                acc_ax.plot(ks, [r["accept_rate_median"] for r in spec], marker="s", ls=":",
                            label=f"{name}acceptance", **style)
                ax.set_xscale("log", base=2)
                ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(title=kind, xlabel="draft tokens per round (k)",
               ylabel="generation tok/s (median, IQR)")
        acc_ax.set(ylabel="accepted / proposed", ylim=(0, 1.05))
        h, a = ax.get_legend_handles_labels(), acc_ax.get_legend_handles_labels()
        if h[0] or a[0]:
            acc_ax.legend(h[0] + a[0], h[1] + a[1], fontsize="small", loc="best")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in PROMPT_KINDS for k in kinds):
        raise argparse.ArgumentTypeError(
            f"unknown prompt kind(s) {text!r}; choose from {', '.join(PROMPT_KINDS)}")
    return list(dict.fromkeys(kinds))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = results.parser("sweep", __doc__, api=True)
    a, spec = p.add_argument, SpeculationParams()
    a("--target-model", help="Target (default: models/demo/target, else the generated pair).")
    a("--draft-model", help="Draft model (default: the target's pair).")
    a("--draft-tokens", type=results.int_list, default=[1, 2, 4, 8, 16], metavar="K,...",
      help="Draft lengths to sweep.")
    a("--prompt-kinds", type=_kinds, default=["structured", "open_ended"], metavar="KIND,...",
      help=f"Of {', '.join(PROMPT_KINDS)}.")
    a("--reps", type=int, default=5, help="Measured runs per cell.")
    a("--warmup", type=int, default=1, help="Discarded runs first.")
    a("--max-tokens", type=int, default=320, help="Tokens per run.")
    a("--temp", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    a("--smoke", action="store_true", help="1 rep, no warm-up, the first kind, the first 2 k.")
    a("--draft", choices=[d.value for d in DraftSource], default="model",
      help="Draft with the draft model, by prompt lookup, or hybrid (lookup when it matches).")
    a("--acceptance", choices=["exact", "rejection"], default=spec.acceptance,
      help="Acceptance rule at --temp > 0.")
    a("--adaptive", action=argparse.BooleanOptionalAction, default=False, help="Adapt k per round.")
    a("--draft-p-min", type=float, default=0.0, help="The requests' draft_p_min.")
    a("--hybrid-min-match", type=int, choices=(1, 2, 3), default=spec.hybrid_min_match,
      help="--draft hybrid: look up only after this many matching tokens.")
    a("--cost-ratio", type=float, help="Draft/target cost per token, c; measured when not given.")
    a("--server", metavar="URL", help="Run the cells through this OpenAI-compatible server.")
    a("--compare", metavar="URL2", help="Also run every cell on URL2, interleaved; ratios.")
    a("--timeout", type=float, default=TIMEOUT_S, help="Seconds a server may stay silent.")
    args = p.parse_args(argv)
    results.check(p, [
        (args.reps < 1, "--reps must be >= 1"), (args.warmup < 0, "--warmup must be >= 0"),
        (args.max_tokens < 2, "--max-tokens must be >= 2 (tok/s needs two tokens)"),
        (args.temp < 0, "--temp must be >= 0"), (args.timeout <= 0, "--timeout must be > 0"),
        (args.compare and not args.server, "--compare URL2 needs --server URL"),
        (args.draft == "prompt_lookup" and args.draft_model,
         "--draft prompt_lookup drafts from the prompt: drop --draft-model"),
        (not args.server and args.draft != "prompt_lookup" and args.target_model
         and not args.draft_model, "--target-model needs --draft-model (or --draft prompt_lookup)"),
    ])
    if args.smoke:
        args.reps, args.warmup = 1, 0
        args.prompt_kinds, args.draft_tokens = args.prompt_kinds[:1], args.draft_tokens[:2]
    return args


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    target, draft = args.target_model, args.draft_model
    if target is None:
        target, paired = demo_or_generated_pair()
        draft = draft or paired
    return target, (None if args.draft == "prompt_lookup" else draft)


def speculation_of(args: argparse.Namespace) -> SpeculationParams:
    return SpeculationParams(source=args.draft, acceptance=args.acceptance,
                             adaptive=args.adaptive, draft_p_min=args.draft_p_min,
                             hybrid_min_match=args.hybrid_min_match)


def make_runners(args: argparse.Namespace, log) -> tuple[list, dict]:
    """The runners and the models they loaded (for the metadata)."""
    spec = speculation_of(args)
    if args.server:
        made = [HttpRunner(url, speculation=spec, temperature=args.temp, api=args.api,
                           api_key=args.api_key, timeout=args.timeout)
                for url in (args.server, args.compare) if url]
        if len(made) == 2 and made[0].label == made[1].label:  # an A/A test of the noise
            made[1].label += " (again)"
        return made, {}
    target, draft = resolve_models(args)
    print(f"Loading target {target}" + (f" and draft {draft}" if draft else ""), file=log)
    runner = EngineRunner(target, draft, speculation=spec, temperature=args.temp)
    return [runner], {"target_model": target, "draft_model": draft}


def main(argv: list[str]) -> int:
    args, log = parse_args(argv), sys.stderr
    try:
        runners, models = make_runners(args, log)
    except (ModelLoadError, IncompatibleDraft, StreamFailed) as e:
        print(f"error: {e}", file=log)
        return 1
    c = args.cost_ratio  # for the theory column: given, 0 for lookup, measured, or N/A
    if c is None and (args.draft == "prompt_lookup" or not args.server):
        c = 0.0 if args.draft == "prompt_lookup" else runners[0].cost_ratio()
    cells = plan_cells(args.prompt_kinds, args.draft_tokens)
    writer, started = results.ResultsWriter(args.results_dir, "sweep", args.tag), time.time()
    meta = {**results.environment(**models), "cost_ratio": c,
            "runners": [r.describe() for r in runners]}
    print(f"{len(cells)} cells x {len(runners)} runner(s), {args.warmup} warm-up + {args.reps} "
          f"reps, {args.max_tokens} tokens; c = {num(c, '.3f', 'n/a')}", file=log)
    rows: list[dict] = []
    try:
        for row in sweep(runners, cells, args, c, log):
            writer.write_row(row)
            rows.append(row)
    except KeyboardInterrupt:
        print("\ninterrupted: writing what was done", file=log)
        meta["interrupted"] = True
    finally:
        for runner in runners:
            runner.close()
    found = verdicts(rows)
    meta["elapsed_s"] = round(time.time() - started, 2)
    results.save("sweep", argv, args, meta, rows, table, writer=writer, plot=plot,
                 footer="\n\n" + "\n".join(f"{v.id} {v.verdict:<4}  {v.claim}"
                                + (f" [{v.server}]" if v.server else "") + f": {v.detail}"
                                for v in found), verdicts=[v._asdict() for v in found])
    return 130 if meta.get("interrupted") else 0
