"""`python -m server.bench.draft_sizes BENCH.json ...`: one line per draft from server-bench
results (`python -m server.bench --server ...`, fixed k and `--adaptive` runs alike), to choose a
draft's size by the speedup it gives rather than by its acceptance.

Each result file names its draft (`args.draft_model`) and drafter (`args.draft`: the draft alone,
or hybrid); per draft and drafter the table gives its layers, its size on disk, its cost relative
to the target (the bench's measured `cost_ratio`), and per prompt kind the best fixed-k speedup
(with that k, its acceptance and its accepted/proposed counts, summed over the reps) and the
adaptive one. Speedups are over the target alone measured in the same run, so runs made at
different times compare; under greedy decoding the counts are the same in every run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from server.bench.report import aligned
from server.bench.writer import drafting_runs


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


def collect(paths: list[str]) -> dict[tuple[str, str], dict]:
    """{(draft folder, drafter): {"cost": c, ("fixed"|"adaptive", kind): [rows with k > 0]}}."""
    drafts: dict[tuple[str, str], dict] = {}
    for args, rows in drafting_runs(paths):
        entry = drafts.setdefault((args["draft_model"], args.get("draft") or "model"), {})
        mode = "adaptive" if args["adaptive"] else "fixed"
        for row in rows:
            entry.setdefault((mode, row["kind"]), []).append(row)
            entry.setdefault("cost", row["cost_ratio"])
    return drafts


def cell(rows: list[dict] | None, label_k: bool) -> str:
    if not rows:
        return "-"
    best = max(rows, key=lambda r: r["speedup"])
    k = f" k={best['k']}" if label_k else ""
    counts = f", {best['accepted']}/{best['proposed']}" if "proposed" in best else ""
    return f"{best['speedup']:.2f}x{k} ({best['accept_rate_median']:.2f}{counts})"


def table(drafts: dict[tuple[str, str], dict], kinds: tuple[str, ...]) -> str:
    head = ["draft", "drafter", "layers", "MB", "cost"]
    for kind in kinds:
        head += [f"{kind} best k (acc)", f"{kind} adaptive (acc)"]
    lines = [head]
    for (folder, drafter), entry in drafts.items():
        config = json.loads((Path(folder) / "config.json").read_text())
        line = [folder, drafter, str(config["num_hidden_layers"]), f"{folder_mb(Path(folder)):.1f}",
                f"{entry.get('cost') or 0:.3f}"]
        for kind in kinds:
            line += [cell(entry.get(("fixed", kind)), True),
                     cell(entry.get(("adaptive", kind)), False)]
        lines.append(line)
    return aligned(lines, rule=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m server.bench.draft_sizes", description=__doc__)
    ap.add_argument("results", nargs="+", help="bench JSON files (RESULTS/bench-*.json)")
    ap.add_argument("--kinds", default="structured,open_ended")
    args = ap.parse_args(argv)
    print(table(collect(args.results), tuple(args.kinds.split(","))))
    print("speedup over the target alone in the same run; (acceptance, accepted/proposed)")


if __name__ == "__main__":
    main()
