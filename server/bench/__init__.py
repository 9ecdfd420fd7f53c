"""`mlx-spec-bench SUBCOMMAND` (= `python -m server.bench SUBCOMMAND`): the maintained benchmarks,
their results in `--results-dir` (plots need the `bench` extra). A flag first runs `sweep`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {  # name: (the module, whose `main` it runs, or module:function; what it does)
    "sweep": ("server.bench.sweep", "draft length k: speedup, theory, P1-P3, plot"),
    "load": ("server.bench.load", "concurrent streams, ours against other servers, or in process"),
    "chat": ("server.bench.chat", "multi-turn TTFT and a shared prompt: the prefix cache"),
    "held-out": ("server.bench.held_out", "drafting settings on requests no draft trained on"),
    "structured": ("server.bench.structured", "a grammar's cost, and speculation under it"),
    "prediction": ("server.bench.prediction", "a guess of the answer (OpenAI's prediction)"),
    "suffix": ("server.bench.suffix", "repeated requests and an agent: suffix drafting"),
    "restart": ("server.bench.chat:restart_main", "TTFT after a restart, from the disk cache"),
    "distributed": ("server.bench.load:distributed_main", "a sharded target vs one process"),
    "flood": ("server.bench.flood", "long prompts at once in a memory cgroup, vs mlx_lm.server"),
    "report": ("server.bench.results:report_main", "docs/benchmarks.md from its manifest"),
}


def entry(name: str):
    """The subcommand's `main` (or the function a `module:function` entry names)."""
    module, _, function = SUBCOMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), function or "main")


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
    print("usage: mlx-spec-bench SUBCOMMAND [--help] [options]\n\nsubcommands:",
          *(f"  {name:<11} {what}" for name, (_, what) in SUBCOMMANDS.items()), sep="\n",
          file=sys.stdout if asked else sys.stderr)
    if argv and not asked:
        print(f"\nerror: unknown subcommand {argv[0]!r}", file=sys.stderr)
    return 0 if asked else 2
