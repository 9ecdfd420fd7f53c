"""What every subcommand shares: result files `<subcommand>-<stamp>[-<tag>]` in `--results-dir`
(`.jsonl` as measured, `.csv`, `.png` where drawn, and the `.json` that `report` renders), their
metadata, summaries, small parsers and tables; and `report`, the page made of them.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

PROMPTS = yaml.safe_load(Path(__file__).with_name("prompts.yaml").read_text(encoding="utf-8"))
IQR_TO_SIGMA = 1.349  # IQR / 1.349 estimates a normal distribution's standard deviation
NOISY_CV = 0.10


def int_list(text: str) -> list[int]:
    """`1,2,4` -> [1, 2, 4]: positive, in the order given, repeats dropped."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4: {text!r}")
    return list(dict.fromkeys(values))


def named_url(text: str) -> tuple[str, str]:
    """`URL` or `NAME=URL` -> (name, url without a trailing `/` or `/v1`; name defaults to it)."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    url = url.rstrip("/").removesuffix("/v1")
    return name or url, url


def parser(subcommand: str, doc: str, *, api: bool = False,
           servers: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser with the options they share: --results-dir and --tag; with `api`
    --api and --api-key; with `servers` ("optional" or "required") named --server/--compare."""
    from server.bench.runners import API_PATHS

    p = argparse.ArgumentParser(prog=f"mlx-spec-bench {subcommand}", description=doc.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--results-dir", type=Path, default=Path("bench-results"), help="Where the files go.")
    a("--tag", help="Appended to the results' file name.")
    if api:
        a("--api", choices=list(API_PATHS), default="chat", help="The streaming API.")
        a("--api-key", help="Bearer key for the server(s).")
    if servers:
        a("--server", type=named_url, metavar="[NAME=]URL", required=servers == "required",
          help="Ours: ratios are ours over each other server's.")
        a("--compare", type=named_url, action="append", default=[], metavar="[NAME=]URL",
          help="Another server to compare with (repeatable).")
    return p


def check(p: argparse.ArgumentParser, rules: list[tuple[object, str]]) -> None:
    """Exit through `p.error` with the message of the first rule that is true."""
    if failed := [message for bad, message in rules if bad]:
        p.error(failed[0])


def auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def command_line(subcommand: str, argv: Sequence[str]) -> str:
    """The command as `mlx-spec-bench` takes it, with any `--api-key` value hidden."""
    words = ["--api-key=***" if w.startswith("--api-key=") else w for w in argv]
    words = ["***" if i and words[i - 1] == "--api-key" else w for i, w in enumerate(words)]
    return shlex.join(["mlx-spec-bench", subcommand, *words])


def environment(**models) -> dict:
    """Date, machine, cores, versions, git commit; plus the models named by the caller."""
    import mlx.core as mx
    import mlx_lm

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "os": platform.platform(), "python": platform.python_version(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "mlx_device": str(mx.default_device()), "git_commit": commit, **models}


class ResultsWriter:
    """Appends each row to the `.jsonl` and flushes it; `finish` writes the rest."""

    def __init__(self, results_dir: Path, subcommand: str, tag: str | None = None):
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9._-]+", "-", tag).strip("-") if tag else ""
        self.subcommand = subcommand
        self.name = f"{subcommand}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-{safe}" if safe else "")
        self.paths = {ext: Path(results_dir) / f"{self.name}.{ext}"
                      for ext in ("jsonl", "csv", "json", "png")}
        self._jsonl = open(self.paths["jsonl"], "a", encoding="utf-8")  # noqa: SIM115

    def write_row(self, row: dict) -> None:
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())

    def finish(self, command: str, metadata: dict, rows: list[dict], *,
               plot: Callable[..., object] | None = None, **extra) -> dict:
        """The `.csv`, the plot (`plot(rows, path, title=...)`: a failed one costs only the
        picture) and the `.json`."""
        self._jsonl.close()
        def cell(value):  # lists `;`-joined, None an empty field, dicts as JSON
            if isinstance(value, (list, tuple)):
                return ";".join("" if v is None else repr(v) for v in value)
            return "" if value is None else json.dumps(value) if isinstance(value, dict) else value

        columns = list(dict.fromkeys(k for row in rows for k in row))
        with open(self.paths["csv"], "w", newline="", encoding="utf-8") as f:
            out = csv.DictWriter(f, fieldnames=columns)
            out.writeheader()
            out.writerows({k: cell(row.get(k)) for k in columns} for row in rows)
        written = {ext: self.paths[ext] for ext in ("jsonl", "csv")}
        if plot is not None:
            try:
                plot(rows, self.paths["png"], title=self.name)
                written["png"] = self.paths["png"]
            except Exception as e:  # a plot is a convenience; never lose the data over it
                metadata = {**metadata, "plot_error": f"{type(e).__name__}: {e}"}
        doc = {"subcommand": self.subcommand, "command": command, "metadata": metadata,
               "rows": rows, **extra}
        self.paths["json"].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        return {**written, "json": self.paths["json"]}


def save(subcommand: str, argv: Sequence[str], args, metadata: dict, rows: list[dict],
         table: Callable[[list[dict]], list[list[str]]], *, writer: ResultsWriter | None = None,
         footer: str = "", **extra) -> dict:
    """Write the files (the rows already in `writer` if given); print the table and the files."""
    if writer is None:
        writer = ResultsWriter(args.results_dir, subcommand, args.tag)
        for row in rows:
            writer.write_row(row)
    written = writer.finish(command_line(subcommand, argv), metadata, rows, **extra)
    print(f"\n{aligned(table(rows))}{footer}\n", *(f"wrote {p}" for p in written.values()),
          sep="\n")
    return written


class Summary(NamedTuple):
    median: float | None
    iqr: float | None
    cv: float | None  # robust coefficient of variation: IQR / median / 1.349
    q1: float | None = None
    q3: float | None = None

    @property
    def noisy(self) -> bool:
        return self.cv is not None and self.cv > NOISY_CV


def summarize(values: Sequence[float | None]) -> Summary:
    """Median, quartiles (linear interpolation, numpy's default), IQR and robust CV."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return Summary(None, None, None)
    q1, med, q3 = (float(x) for x in np.percentile(vals, [25, 50, 75]))
    return Summary(med, q3 - q1, (q3 - q1) / med / IQR_TO_SIGMA if med else None, q1, q3)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


# -- tables and the benchmark page ---------------------------------------------------------
GENERATED = "_Generated by `mlx-spec-bench report` from {manifest}: do not edit this file; " \
            "edit the manifest or rerun the benchmarks, then `mlx-spec-bench report`._"


def num(value, fmt: str, missing: str = "-", suffix: str = "") -> str:
    """`value` formatted with `fmt` (plus `suffix`), or `missing` when there is none."""
    return missing if value is None else format(value, fmt) + suffix


def aligned(lines: list[list]) -> str:
    """Rows of cells (the first the header) as left-aligned columns, a rule under the header."""
    cells = [[str(c) for c in line] for line in lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in cells]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def markdown_table(lines: list[list]) -> str:
    def row(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([row(lines[0]), row(["---"] * len(lines[0])), *map(row, lines[1:])])


def render_json(path: Path) -> str:
    from server.bench import SUBCOMMANDS

    doc = json.loads(path.read_text(encoding="utf-8"))
    if doc.get("subcommand") not in SUBCOMMANDS:
        raise ValueError(f"{path}: not a result of mlx-spec-bench (no known 'subcommand')")
    module = importlib.import_module(SUBCOMMANDS[doc["subcommand"]][0])
    parts = [markdown_table(module.table(doc["rows"]))]
    if verdicts := doc.get("verdicts"):
        parts.append("\n".join(f"- **{v['id']} {v['verdict']}** {v['claim']}"
                               + (f" [{v['server']}]" if v.get("server") else "")
                               + f": {v['detail']}" for v in verdicts))
    if (notes := getattr(module, "notes", None)) is not None and (text := notes(doc)):
        parts.append(text)  # what a subcommand measured besides its table
    m = doc.get("metadata", {})
    commit = (m.get("git_commit") or "?")[:10]
    parts.append(f"`{doc['command']}`: {m.get('date', '?')}, {m.get('machine', '?')}, "
                 f"{m.get('cpu_count', '?')} cores, {m.get('mlx_device', '?')}, mlx "
                 f"{m.get('mlx', '?')}, mlx-lm {m.get('mlx_lm', '?')}, commit {commit}")
    return "\n\n".join(parts)


def render_file(name: str, root: Path, out_dir: Path) -> str:
    path = root / name
    if not path.is_file():
        raise FileNotFoundError(f"cited file is missing: {name}")
    if path.suffix == ".json":
        return render_json(path)
    if path.suffix in (".txt", ".md"):
        text = path.read_text(encoding="utf-8").rstrip("\n")
        fence = "~~~~" if "```" in text else "```"
        return f"`{name}`:\n\n{fence}\n{text}\n{fence}"
    if path.suffix == ".png":
        rel = Path(os.path.relpath(path.resolve(), out_dir.resolve())).as_posix()
        return f"![{path.stem}]({rel})"
    raise ValueError(f"{name}: only .json, .txt, .md and .png files can be cited")


def render(manifest: dict, *, root: Path, out_dir: Path, manifest_name: str) -> str:
    parts = [GENERATED.format(manifest=f"`{manifest_name}`"),
             f"# {manifest.get('title', 'Benchmarks')}"]
    if manifest.get("intro"):
        parts.append(manifest["intro"].strip())
    for section in manifest.get("sections") or []:
        parts.append(f"## {section['title']}")
        if section.get("text"):
            parts.append(section["text"].strip())
        if section.get("command"):
            parts.append(f"```bash\n{section['command'].strip()}\n```")
        parts += [render_file(name, root, out_dir) for name in section.get("files") or []]
    if manifest.get("tried"):
        parts += ["## Tried, and did not pay",
                  "\n".join(f"- {t['what']}: {t['figure']}" for t in manifest["tried"])]
    return "\n\n".join(parts) + "\n"


def report_main(argv: Sequence[str] | None = None) -> int:
    """`mlx-spec-bench report`: docs/benchmarks.md from its manifest and the files it cites.

    The manifest: `title`, `intro`, `sections` (each `title`, `text`, `command`, `files`) and
    `tried`; a `.json` result becomes its table, `.txt`/`.md` a code block, `.png` an image."""
    p = argparse.ArgumentParser(prog="mlx-spec-bench report",
                                description=report_main.__doc__.split(": ", 1)[1].split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--manifest", type=Path, default=Path("docs/benchmarks.yaml"), help="The manifest.")
    a("--out", type=Path, default=Path("docs/benchmarks.md"), help="The page to write.")
    a("--root", type=Path, default=Path("."), help="What the manifest's paths are relative to.")
    a("--check", action="store_true", help="Write nothing; exit 1 if the page is out of date.")
    args = p.parse_args(argv)
    manifest_path, out = args.root / args.manifest, args.root / args.out
    try:
        manifest = yaml.safe_load(manifest_path.read_text(encoding="utf-8"))
        text = render(manifest, root=args.root, out_dir=out.parent,
                      manifest_name=args.manifest.as_posix())
    except (OSError, ValueError, KeyError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.check:
        if (out.read_text(encoding="utf-8") if out.is_file() else None) != text:
            print(f"{out} is out of date: run `mlx-spec-bench report`", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0
