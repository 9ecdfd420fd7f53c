"""`mlx-spec-bench SUBCOMMAND` (= `python -m server.bench SUBCOMMAND`): the maintained benchmarks.

Each writes its results into `--results-dir`; `report` renders them into `docs/benchmarks.md`.
Plots need the `bench` extra. A flag first (`--smoke ...`) runs `sweep`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {  # the module, or module:function; its docstring's first line is the usage's
    "sweep": "server.bench.sweep",  # draft length k: speedup, P1-P3, plot
    "load": "server.bench.load",  # concurrent streams, ours vs others; or in process
    "chat": "server.bench.chat",  # multi-turn TTFT, the prefix cache
    "held-out": "server.bench.held_out",  # drafting settings on held-out requests
    "structured": "server.bench.structured",  # a grammar's cost, speculation under it
    "restart": "server.bench.chat:restart_main",  # TTFT after a restart, from disk
    "distributed": "server.bench.load:distributed_main",  # a sharded target vs one process
    "report": "server.bench.results:report_main",  # docs/benchmarks.md from docs/benchmarks.yaml
}


def entry(name: str):
    """The subcommand's `main` (or the function a `module:function` entry names)."""
    module, _, function = SUBCOMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function or "main")


def usage() -> str:
    lines = ["usage: mlx-spec-bench SUBCOMMAND [--help] [options]", "", "subcommands:"]
    for name, where in SUBCOMMANDS.items():
        doc = entry(name).__doc__ if ":" in where else importlib.import_module(where).__doc__
        lines.append(f"  {name:<11} {doc.split(':', 1)[-1].splitlines()[0].strip()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # from the command line: OpenBLAS on a Linux CPU (server/blas.py)
        from server.blas import ensure_fast_blas

        ensure_fast_blas()
    argv = list(sys.argv[1:] if argv is None else argv)
    asked = argv[:1] in (["-h"], ["--help"])
    if argv and argv[0].startswith("-") and not asked:
        argv = ["sweep", *argv]  # the sweep's flags alone: as before the subcommands
    if argv and argv[0] in SUBCOMMANDS:
        status = entry(argv[0])(argv[1:])
        return status if isinstance(status, int) else 0
    print(usage(), file=sys.stdout if asked else sys.stderr)
    if argv and not asked:
        print(f"\nerror: unknown subcommand {argv[0]!r}", file=sys.stderr)
    return 0 if asked else 2
