"""`python -m server.bench.ab BENCH.json ...`: two (or more) drafts measured taking turns, one
line per draft, drafter and prompt kind, from server-bench results (`python -m server.bench
--server ...`, each run with its own baseline).

Per line: the speedup of every run in file order, their median, the median of the runs' tok/s,
and the accepted/proposed counts (summed over a run's reps; under greedy decoding every run
gives the same, else all distinct counts are listed). A single run moves by 0.1-0.2x on a shared
machine; the median of alternated runs, and the counts, are what to compare."""

from __future__ import annotations

import argparse
import statistics

from server.bench.report import aligned
from server.bench.writer import drafting_runs


def collect(paths: list[str]) -> dict[tuple[str, str, str, int], list[dict]]:
    """{(draft folder or "-", drafter, kind, k): [the drafting row of each run, in file
    order]}."""
    runs: dict[tuple[str, str, str, int], list[dict]] = {}
    for args, rows in drafting_runs(paths):
        for row in rows:
            key = (args.get("draft_model") or "-", drafter_label(args), row["kind"], row["k"])
            runs.setdefault(key, []).append(row)
    return runs


def drafter_label(args: dict) -> str:
    """The drafter, with hybrid's minimum lookup match when the run recorded one and the
    draft model's confidence cut-off (`draft_p_min`) when it was set."""
    drafter = args.get("draft") or "model"
    match = args.get("hybrid_min_match")
    label = f"{drafter},match>={match}" if drafter == "hybrid" and match else drafter
    p_min = args.get("draft_p_min")
    return f"{label},p_min={p_min:g}" if p_min and drafter != "prompt_lookup" else label


def line(key: tuple[str, str, str, int], rows: list[dict], adaptive: bool) -> list[str]:
    folder, drafter, kind, k = key
    speedups = [r["speedup"] for r in rows]
    counts = list(dict.fromkeys(f"{r['accepted']}/{r['proposed']}" for r in rows))
    return [folder, drafter, kind, "adaptive" if adaptive else str(k),
            " ".join(f"{s:.2f}" for s in speedups), f"{statistics.median(speedups):.2f}x",
            f"{statistics.median(r['tps_median'] for r in rows):.1f}", " ".join(counts)]


def table(runs: dict[tuple[str, str, str, int], list[dict]]) -> str:
    lines = [["draft", "drafter", "kind", "k", "speedup per run", "median", "tok/s",
              "accepted/proposed"]]
    for key in sorted(runs, key=lambda key: (key[2], key[1], key[0], key[3])):
        rows = runs[key]
        lines.append(line(key, rows, bool(rows[0]["adaptive"])))
    return aligned(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m server.bench.ab", description=__doc__)
    ap.add_argument("results", nargs="+", help="bench JSON files (RESULTS/bench-*.json)")
    args = ap.parse_args(argv)
    print(table(collect(args.results)))
    print("speedup over the target alone in the same run; tok/s: median over the runs")


if __name__ == "__main__":
    main()
