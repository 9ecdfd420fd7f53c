"""The one thread that touches MLX. Jobs wait in a bounded queue; results flow back to asyncio.

A job is a function run on the worker thread. Generation jobs push their events into an
asyncio.Queue as they come; the caller sets `cancelled` when its client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()
END_OF_STREAM = object()

# CPython hands the GIL to a waiting thread only every `switchinterval` (default 5 ms). Here the
# event loop wakes for every streamed token while this thread builds the next MLX graph, and the
# default interval cost ~10% of speculative decode speed through the server (bursts of k + 1
# tokens per round); 0.5 ms brought it back to within a few percent of a single thread.
GIL_SWITCH_INTERVAL_S = 0.0005


class QueueFull(Exception):
    """The worker's queue is full: the caller should answer 503 with Retry-After."""


class StreamJob:
    """Events of one generation, produced on the worker, consumed on the event loop."""

    def __init__(self, produce: Callable[[Callable[[], bool]], Iterator[Any]],
                 loop: asyncio.AbstractEventLoop):
        self.produce = produce
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.produced = 0  # events produced so far (worker thread)
        self.produced_at_cancel: int | None = None

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self.produced_at_cancel = self.produced
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def run(self) -> None:
        put = self.loop.call_soon_threadsafe
        try:
            if self.cancelled:
                return
            events = self.produce(self._cancelled.is_set)
            try:
                for event in events:
                    self.produced += 1
                    put(self.events.put_nowait, event)
                    if self.cancelled:
                        break
            finally:
                events.close()
        except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
            put(self.events.put_nowait, e)
        finally:
            put(self.events.put_nowait, END_OF_STREAM)

    async def __aiter__(self):
        while True:
            event = await self.events.get()
            if event is END_OF_STREAM:
                return
            if isinstance(event, BaseException):
                raise event
            yield event


class CallJob:
    """A single call (load, unload, check) whose result resolves an asyncio future."""

    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop):
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    def run(self) -> None:
        try:
            result = self.fn()
        except BaseException as e:  # noqa: BLE001
            self.loop.call_soon_threadsafe(_set_exception, self.future, e)
        else:
            self.loop.call_soon_threadsafe(_set_result, self.future, result)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class GenerationWorker:
    def __init__(self, max_queue_size: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._thread = threading.Thread(target=self._loop, name="mlx-worker", daemon=True)
        self._stopped = threading.Event()
        self.busy = False

    def start(self) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Finish the running job, then park the thread (see `_loop`)."""
        if self._thread.is_alive() and not self._stopped.is_set():
            self._queue.put(_STOP)
            self._stopped.wait(timeout)

    @property
    def depth(self) -> int:
        """Jobs waiting plus the one running."""
        return self._queue.qsize() + int(self.busy)

    def submit(self, job: StreamJob | CallJob) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None

    def call_soon(self, fn: Callable[[], Any]) -> asyncio.Future:
        job = CallJob(fn, asyncio.get_running_loop())
        self.submit(job)
        return job.future

    def run_sync(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker from a thread that has no event loop (start-up, tests)."""
        done, box = threading.Event(), {}

        def wrapped():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001
                box["error"] = e
            finally:
                done.set()

        self._queue.put(_SyncJob(wrapped))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                self._stopped.set()
                # Never let this OS thread exit: MLX's thread-local compile cache calls into
                # Python from its TLS destructor, which aborts the process ("terminate called
                # without an active exception") if the interpreter is finalizing meanwhile.
                # A parked daemon thread is simply dropped at exit.
                threading.Event().wait()
            self.busy = True
            try:
                job.run()
            except Exception:  # a job must never kill the worker
                log.exception("worker job failed")
            finally:
                self.busy = False


class _SyncJob:
    def __init__(self, fn: Callable[[], None]):
        self.run = fn
