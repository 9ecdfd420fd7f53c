"""`python -m support.faulty_server ARGS`: `python -m server ARGS` whose MLX worker dies (fault
injection): after `FAULT_AFTER_ROUNDS` decoding rounds (of any rows) the next one raises, as
`FAULT_KIND` says: "mlx", the RuntimeError Metal raises when memory runs out; "exit", a
BaseException that ends the thread itself (a C++ error unwinding it)."""

from __future__ import annotations

import os

INJECTED = "[metal::malloc] Attempting to allocate 40000000000 bytes (injected fault)"


class ThreadKilled(BaseException):
    """Not an Exception: nothing on the way catches it."""


def inject(after_rounds: int, kind: str) -> None:
    from server.engine.scheduling.scheduler import Scheduler

    original = Scheduler._decode_step
    rounds = 0

    def faulty(self) -> bool:
        nonlocal rounds
        if len(self.target):
            rounds += 1
            if rounds > after_rounds:
                raise RuntimeError(INJECTED) if kind == "mlx" else ThreadKilled(INJECTED)
        return original(self)

    Scheduler._decode_step = faulty


if __name__ == "__main__":
    inject(int(os.environ["FAULT_AFTER_ROUNDS"]), os.environ.get("FAULT_KIND", "mlx"))
    from server.__main__ import main

    main()
