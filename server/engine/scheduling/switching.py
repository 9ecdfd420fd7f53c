"""Several targets, one at a time: a request that names another configured target waits until
the requests on the current one have finished, then the server switches to it (the rule of
`mlx_lm.server` and llama-swap). Runs on the event loop.

Requests pass a gate (`TargetSwitcher.hold`) from before their prompt is tokenized until they
are in the scheduler. While a switch waits, every new request queues behind it, so a busy
target cannot starve the others: waiters are served in arrival order, and each switch admits
every request that was waiting for its target. The switch itself runs on the MLX thread once
no request waits or runs there (`Scheduler.call_when_idle`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.errors import QueueFull, ShuttingDown, TargetUnavailable

if TYPE_CHECKING:
    from server.engine.service import InferenceEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetEntry:
    """A target the server may serve, as configured (`models.model` or `models.more_targets`)."""

    path: str
    name: str
    draft: str | None = None
    num_draft_tokens: int | None = None  # None: the server's configured k
    adapter_path: str | None = None
    chat_template: str | None = None

    def named(self, name: str | None) -> bool:
        return name in (self.name, self.path)


@dataclass(eq=False)
class _Waiter:
    entry: TargetEntry | None  # None: any target (the request named none, or an alias)
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                     .create_future())


class TargetSwitcher:
    def __init__(self, engine: InferenceEngine, entries: list[TargetEntry], max_waiting: int):
        self._engine = engine
        self.entries = entries  # empty: no switching, the target serves every request
        self._max_waiting = max_waiting
        self._holders = 0  # requests past the gate, not yet in the scheduler
        self._queue: deque[_Waiter] = deque()
        self._switch: asyncio.Task | None = None
        self.switches = 0

    @property
    def waiting(self) -> int:
        """Requests waiting for a switch (or behind one)."""
        return len(self._queue)

    def entry_named(self, name: str | None) -> TargetEntry | None:
        return next((e for e in self.entries if e.named(name)), None)

    def standby(self) -> list[TargetEntry]:
        """The configured targets not serving now."""
        return [e for e in self.entries if not self._serves(e)]

    @asynccontextmanager
    async def hold(self, name: str | None) -> AsyncIterator[None]:
        """Serve the target `name` selects (a configured entry's name or path; any other name:
        whichever serves) for the block: no switch happens until it exits."""
        entry = self.entry_named(name)
        if self._queue or self._switch is not None or not self._serves(entry):
            await self._wait(entry)
        else:
            self._holders += 1
        try:
            yield
        finally:
            self._holders -= 1
            self._pump()

    def _serves(self, entry: TargetEntry | None) -> bool:
        return entry is None or self._engine.serving_entry is entry

    async def _wait(self, entry: TargetEntry | None) -> None:
        if len(self._queue) >= self._max_waiting:
            raise QueueFull(f"{len(self._queue)} requests already wait for a model switch")
        waiter = _Waiter(entry)
        self._queue.append(waiter)
        self._pump()
        try:
            await waiter.admitted
        except asyncio.CancelledError:
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif not waiter.admitted.cancelled() and waiter.admitted.exception() is None:
                self._holders -= 1  # admitted just as it was cancelled
            self._pump()
            raise

    def _pump(self) -> None:
        """Admit the waiters at the head that the current target serves; once nobody holds it,
        switch to the target the head waits for."""
        if self._switch is not None:
            return
        while self._queue and self._serves(self._queue[0].entry):
            self._admit(self._queue.popleft())
        if self._queue and self._holders == 0:
            self._switch = asyncio.get_running_loop().create_task(
                self._switch_to(self._queue[0].entry))

    def _admit(self, waiter: _Waiter) -> None:
        if not waiter.admitted.done():
            self._holders += 1
            waiter.admitted.set_result(None)

    async def _switch_to(self, entry: TargetEntry) -> None:
        waiting = sum(w.entry is entry for w in self._queue)
        log.info("switching the target to %s (requests waiting for it: %d)", entry.name, waiting)
        try:
            await self._engine.switch_target(entry)
            self.switches += 1
        except Exception as e:  # noqa: BLE001 - the requests that wanted it get the error
            log.error("switching the target to %s failed: %s", entry.name, e)
            if not isinstance(e, ShuttingDown):
                e = TargetUnavailable(f"model {entry.name!r} could not be loaded: {e}")
            for waiter in [w for w in self._queue if w.entry is entry]:
                self._queue.remove(waiter)
                if not waiter.admitted.done():
                    waiter.admitted.set_exception(e)
        finally:
            self._switch = None
            for waiter in [w for w in self._queue if self._serves(w.entry)]:
                self._queue.remove(waiter)
                self._admit(waiter)
            self._pump()
