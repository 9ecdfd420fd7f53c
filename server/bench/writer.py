"""Results on disk: `<name>.jsonl` row by row as cells finish, then `.csv`, `.json` and `.png`;
and the `.json` files read back."""

from __future__ import annotations

import csv
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from server.bench.stats import Verdict


def results_name(tag: str | None, now: float | None = None, *, prefix: str = "bench") -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", tag).strip("-") if tag else ""
    return f"{prefix}-{stamp}" + (f"-{safe}" if safe else "")


def csv_value(value):
    """Lists become `;`-joined, None an empty field; everything else as is."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ";".join("" if v is None else repr(v) for v in value)
    return value


class ResultsWriter:
    """Appends each row to the `.jsonl` and flushes it, so a crash keeps what was done."""

    def __init__(self, results_dir: Path, name: str):
        self.dir = Path(results_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.paths = {ext: self.dir / f"{name}.{ext}" for ext in ("jsonl", "csv", "json", "png")}
        self._jsonl = open(self.paths["jsonl"], "a", encoding="utf-8")  # noqa: SIM115

    def write_row(self, row: dict) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())

    def finish(self, metadata: dict, rows: list[dict], verdicts: list[Verdict],
               plot: Callable[..., Path] | None = None) -> dict:
        """Write the `.csv`, `.json` and plot; returns the paths written (plot may fail).

        `plot(rows, path, title=...)` draws the picture (default: the k sweep's); matplotlib,
        a `bench` extra, is imported only then, so a missing one costs the picture, not the data.
        """
        self._jsonl.close()
        self._write_csv(rows)
        written = {ext: self.paths[ext] for ext in ("jsonl", "csv")}
        try:
            if plot is None:
                from server.bench.plot import plot_sweep as plot
            plot(rows, self.paths["png"], title=self.name)
            written["png"] = self.paths["png"]
        except Exception as e:  # a plot is a convenience; never lose the data over it
            metadata = {**metadata, "plot_error": f"{type(e).__name__}: {e}"}
        doc = {"metadata": metadata, "rows": rows, "verdicts": [asdict(v) for v in verdicts]}
        self.paths["json"].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        written["json"] = self.paths["json"]
        return written

    def _write_csv(self, rows: list[dict]) -> None:
        columns: list[str] = []
        for row in rows:
            columns += [k for k in row if k not in columns]
        with open(self.paths["csv"], "w", newline="", encoding="utf-8") as f:
            out = csv.DictWriter(f, fieldnames=columns)
            out.writeheader()
            for row in rows:
                out.writerow({k: csv_value(row.get(k)) for k in columns})


def drafting_runs(paths: list[str]) -> Iterator[tuple[dict, list[dict]]]:
    """Per result `.json` file: the bench's arguments and the rows that drafted (k > 0) without
    an error."""
    for p in paths:
        result = json.loads(Path(p).read_text())
        rows = [row for row in result["rows"] if row["error"] is None and row["k"]]
        yield result["metadata"]["args"], rows
