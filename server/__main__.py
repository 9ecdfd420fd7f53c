"""`python -m server`: serve the configured models over the OpenAI API.

Flags override `config.yaml`; `--draft-model none` starts without a draft, `--draft-model
auto` with the smallest local model that can draft for the target. Under
`mlx.launch -n N`, rank 0 serves with the target sharded over the N processes and the others
follow it (`server.engine.distributed.service`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import ssl
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from server import logs
from server.blas import ensure_fast_blas, log_blas
from server.config import Settings
from server.engine.distributed.service import DistributedLayout, launched_layout
from server.settings_flags import add_setting_flags, setting_overrides

log = logging.getLogger("server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=None, help="YAML settings file.")
    add_setting_flags(p)
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings.load(args.config, **setting_overrides(args))


def read_settings(args: argparse.Namespace) -> Settings:
    """`settings_from_args`, or an exit with what is wrong, one line per setting."""
    try:
        return settings_from_args(args)
    except ValidationError as e:
        sys.exit("error: invalid settings (the config file, MLX_SPEC_* variables and flags):\n"
                 + "\n".join(f"  {'.'.join(map(str, err['loc']))}: {err['msg']}"
                              + ("" if isinstance(err["input"], dict)
                                 else f" (got {err['input']!r})") for err in e.errors()))
    except (OSError, yaml.YAMLError) as e:
        sys.exit(f"error: cannot read the config file {args.config}: {e}")


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, claimed before any model loads: a taken port fails in
    milliseconds, not after the load. Exits with a clear message when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog; clients wait in it while the models load
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            sys.exit(f"error: port {port} on {host} is already in use (another server?): "
                     "stop it or choose another with --port")
        sys.exit(f"error: cannot listen on {host}:{port}: {e.strerror or e}")
    sock.set_inheritable(True)
    return sock


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """Exit with a clear message, before any model loads, when the certificate and key do not
    load (a missing file, a key that is not the certificate's)."""
    if certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        sys.exit(f"error: server.ssl_certfile {certfile} and server.ssl_keyfile {keyfile} do not"
                 f" load as a PEM certificate and its key: {e}")


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the command line (not a test calling main): fast BLAS first
        ensure_fast_blas()
    settings = read_settings(parse_args(argv))
    log_config = logs.configure(settings.server.log_level, settings.server.log_format)
    layout = launched_layout(settings.distributed.mode)
    follower = layout is not None and layout.rank > 0  # mlx.launch: rank 0 serves HTTP
    if not follower:
        check_tls(settings.server.ssl_certfile, settings.server.ssl_keyfile)
    sock = None if follower else listen(settings.server.host, settings.server.port)
    log_blas()
    serve(settings, sock, layout, log_config)


def serve(settings: Settings, sock: socket.socket | None,
          layout: DistributedLayout | None, log_config: dict | None = None) -> None:
    from server.engine.distributed.follower import run_follower
    from server.http.app import create_app
    from server.http.jobs.state_db import StateError
    from server.http.shutdown import EXIT_ENGINE_FAILED, DrainingServer
    from server.model_files.bundled import ensure_default_models

    settings = ensure_default_models(settings)
    if sock is None:  # a follower rank: no HTTP, it runs what rank 0 sends
        run_follower(layout, settings.models.model, dtype=settings.models.dtype,
                     timeout_s=settings.distributed.timeout_s,
                     drain_timeout_s=settings.engine.drain_timeout_s)
        return
    try:
        app = create_app(settings)
    except StateError as e:
        sys.exit(f"error: {e}")
    server = DrainingServer(app, host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level,
                            drain_timeout_s=settings.engine.drain_timeout_s,
                            ssl_certfile=settings.server.ssl_certfile,
                            ssl_keyfile=settings.server.ssl_keyfile,
                            log_config=log_config)
    server.run(sockets=[sock])
    if server.engine_failed:  # a supervisor (systemd, launchd, Docker) starts it again
        sys.exit(EXIT_ENGINE_FAILED)


if __name__ == "__main__":
    main()
