"""The benchmarks, developer tools on top of the server (never imported by it).

- `python -m server.bench`: the draft-length sweep (see `server.bench.cli`);
- `python -m server.bench.load`: concurrent streaming clients, our server against others;
- `python -m server.bench.overhead`: what the HTTP layer costs against `mlx_lm` directly.

Plots and progress bars need the `bench` extra (`pip install -e ".[bench]"`, part of `dev`).
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from server.bench.cli import main as cli_main

    return cli_main(argv)
