"""SIGTERM/SIGINT: drain the engine, then let uvicorn close.

uvicorn stops accepting connections and waits for open ones; streams would hold it for as long
as they run. So on the first signal the engine stops admitting (new and queued requests get
503), running streams get `drain_timeout_s` to finish, then end with an in-band error chunk
and `[DONE]`; uvicorn's own graceful timeout is a backstop a little later.
"""

from __future__ import annotations

import logging
import threading

import uvicorn
from fastapi import FastAPI

from server.engine.scheduler import ShuttingDown

log = logging.getLogger(__name__)
BACKSTOP_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, *, host: str, port: int, log_level: str,
                 drain_timeout_s: float):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=int(drain_timeout_s + BACKSTOP_S))
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if not self._draining:
            self._draining = True
            self._begin_drain()
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        scheduler = self.app.state.engine.scheduler
        if scheduler is None:
            return
        log.info("shutting down: no new requests; running ones have %.0f s to finish",
                 self.drain_timeout_s)
        scheduler.begin_drain()

        def cut_running():
            scheduler.call(lambda: scheduler.fail_running(
                ShuttingDown("the server is shutting down")), lambda result, error: None)

        timer = threading.Timer(self.drain_timeout_s, cut_running)
        timer.daemon = True
        timer.start()
