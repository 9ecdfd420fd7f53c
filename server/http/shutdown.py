"""SIGTERM/SIGINT: drain the engine, then let uvicorn close.

uvicorn stops accepting connections and waits for open ones; streams would hold it for as long
as they run. So on the first signal the engine stops admitting (new and queued requests get
503), running streams get `drain_timeout_s` to finish, then end with an in-band error chunk
and `[DONE]`; uvicorn's own graceful timeout is a backstop a little later. A drained server
returns, so the process exits 0 (`make serve` too); a second signal exits at once, by it. A
dead engine ends the process with status 70 instead (`EXIT_ENGINE_FAILED`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG
from uvicorn.server import HANDLED_SIGNALS

log = logging.getLogger(__name__)
BACKSTOP_S = 5.0
FLUSH_S = 0.3
# A dead engine: its requests' errors (and /health's 503) go out for FAILED_FLUSH_S, then
# uvicorn stops; the process exits with EXIT_ENGINE_FAILED (EX_SOFTWARE) at the latest
# FAILED_EXIT_S after the failure, for its supervisor to start it again.
EXIT_ENGINE_FAILED = 70
FAILED_FLUSH_S = 1.0
FAILED_EXIT_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, *, host: str, port: int, log_level: str,
                 drain_timeout_s: float, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, log_config: dict | None = None):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=int(drain_timeout_s + BACKSTOP_S),
                                ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                                log_config=log_config or LOGGING_CONFIG)
        super().__init__(config)
        self.scheme = "https" if ssl_certfile else "http"
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self._draining = False
        self._forced: int | None = None  # the second signal, which cut the drain short
        self.engine_failed = False
        app.state.engine.on_failure(self._engine_failed)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn logs its address only for sockets it binds
            for sock in sockets:
                host, port = sock.getsockname()[:2]
                log.info("serving on %s://%s:%d (Ctrl+C to quit)", self.scheme,
                         f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig, frame) -> None:
        # sse-starlette ends every open stream abruptly once uvicorn starts to exit, so uvicorn
        # is told only after the drain: streams end first, with their final chunk or error.
        engine = self.app.state.engine
        if self._draining or engine.scheduler is None:
            if self._draining:
                self._forced = sig
            super().handle_exit(sig, frame)  # a second signal: exit now
            return
        self._draining = True
        log.info("shutting down: no new requests; running ones have %.0f s to finish",
                 self.drain_timeout_s)
        threading.Thread(target=self._drain_then_exit, args=(engine, sig, frame),
                         name="drain", daemon=True).start()

    @contextmanager
    def capture_signals(self):
        """uvicorn's, less raising the signal again once the server has shut down (which ends
        the process by the signal: exit status 143 or 130, make's "Error 143"): after a clean
        drain `serve` returns and the process exits 0. A second signal is raised again."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
        if self._forced is not None:
            signal.raise_signal(self._forced)

    def _engine_failed(self, error: BaseException) -> None:
        """The MLX worker died (called on its thread): every request got the error; stop
        serving, and exit non-zero within `FAILED_EXIT_S` whatever holds uvicorn."""
        if self.engine_failed:
            return
        log.critical("the inference engine failed: exiting with status %d for a supervisor to"
                     " restart the server (%s)", EXIT_ENGINE_FAILED, error)
        self.engine_failed = True
        threading.Thread(target=self._exit_after_failure, name="engine-failed",
                         daemon=True).start()

    def _exit_after_failure(self) -> None:
        time.sleep(FAILED_FLUSH_S)
        self.should_exit = True
        time.sleep(FAILED_EXIT_S - FAILED_FLUSH_S)
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAILED)

    def _drain_then_exit(self, engine, sig, frame) -> None:
        engine.drain(self.drain_timeout_s, BACKSTOP_S)
        time.sleep(FLUSH_S)  # let the event loop send the last chunks
        super().handle_exit(sig, frame)
