"""The speculative-decoding benchmark: `python -m server.bench` (see `server.bench.cli`)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from server.bench.cli import main as cli_main

    return cli_main(argv)
