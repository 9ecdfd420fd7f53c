"""The other ranks of a sharded target: load this rank's part, then do what rank 0 says.

A follower serves no HTTP and decides nothing: it applies rank 0's cache operations to its
own caches and runs the same target forwards (`server.engine.distributed.mirror`), until rank 0
sends
`stop`. It exits by itself when rank 0 goes silent for longer than `timeout_s` (rank 0 sends
a heartbeat every few seconds while idle), or when its own collective fails. SIGTERM and
SIGINT (`mlx.launch` or a terminal sends them to every rank) do not stop it at once: rank 0
drains first and then sends `stop`; the follower exits on its own if no `stop` comes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from server.engine.distributed.mirror import OpChannel, apply_op
from server.engine.distributed.service import (
    EXIT_RANK_LOST,
    DistributedLayout,
    body_and_head,
    load_sharded,
    rank_memory,
)

log = logging.getLogger(__name__)

# After SIGTERM, how long past rank 0's drain a follower waits for `stop` before it exits.
STOP_GRACE_S = 15.0


class Follower:
    def __init__(self, layout: DistributedLayout, model, *, timeout_s: float,
                 drain_timeout_s: float):
        self.layout = layout
        self.model = model
        self.body, _ = body_and_head(model)
        self.channel = OpChannel(layout.group)
        self.caches: dict = {}
        self.timeout_s = timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.forwards = 0
        self._waiting_since: float | None = None
        self._deadline: float | None = None
        self._parent = os.getppid()

    def run(self) -> None:
        """Follow rank 0 until `stop`. The main thread keeps the signals and the watch; the
        collectives, which block in MLX, run on another thread."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop_soon)
        done = threading.Event()
        threading.Thread(target=self._follow, args=(done,), name="follower", daemon=True).start()
        while not done.wait(0.5):
            self._check()
        log.info("rank %d: stopped by rank 0 after %d forwards", self.layout.rank, self.forwards)

    def _follow(self, done: threading.Event) -> None:
        try:
            while True:
                self._waiting_since = time.monotonic()
                ops = self.channel.receive()
                self._waiting_since = None
                if self._apply(ops):
                    done.set()
                    return
        except Exception as e:  # noqa: BLE001 - a closed connection (rank 0 gone), or a bug
            log.exception("rank %d: following failed", self.layout.rank)
            self._exit(f"following rank 0 failed: {type(e).__name__}: {e}")

    def _apply(self, ops: list) -> bool:
        """Apply one message; True on `stop`."""
        for op in ops:
            kind = op[0]
            if kind == "stop":
                return True
            if kind == "forward":
                self._forward(op[1], op[2])
            elif kind == "memory":
                rank_memory(self.channel)
            else:
                apply_op(op, self.caches, lambda: make_prompt_cache(self.model))
        return False

    def _forward(self, inputs, handles: list[int]) -> None:
        hidden = self.body(mx.array(inputs), cache=[self.caches[h] for h in handles])
        mx.eval(hidden)
        self.forwards += 1

    def _stop_soon(self, signum, _frame) -> None:
        """A signal: rank 0 drains, then sends `stop`; exit anyway if it never comes."""
        if self._deadline is None:
            log.info("rank %d: signal %d, waiting for rank 0 to stop every rank",
                     self.layout.rank, signum)
            self._deadline = time.monotonic() + self.drain_timeout_s + STOP_GRACE_S

    def _check(self) -> None:
        now = time.monotonic()
        since = self._waiting_since
        if since is not None and now - since > self.timeout_s:
            self._exit(f"no word from rank 0 for {self.timeout_s:.0f} s")
        if self._deadline is not None and now > self._deadline:
            self._exit("no stop from rank 0 after the signal")
        if os.getppid() != self._parent and self._deadline is None:
            self._stop_soon(0, None)  # mlx.launch went away: rank 0 drains and stops us

    def _exit(self, reason: str) -> None:
        log.error("rank %d exits: %s", self.layout.rank, reason)
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)


def run_follower(layout: DistributedLayout, model_path: str, *, dtype: str = "auto",
                 timeout_s: float, drain_timeout_s: float) -> None:
    """Load this rank's part of the target (with rank 0, collectively) and follow."""
    log.info("rank %d of %d (pid %d): loading %s (%s parallel over %s)", layout.rank,
             layout.world_size, os.getpid(), model_path, layout.mode, layout.backend)
    model, _, _ = load_sharded(model_path, layout, dtype=dtype)
    follower = Follower(layout, model, timeout_s=timeout_s, drain_timeout_s=drain_timeout_s)
    rank_memory(follower.channel)  # rank 0 gathers every rank's memory after the load
    follower.run()
