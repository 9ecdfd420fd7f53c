"""`python -m server`: serve the configured models over the OpenAI API.

Flags override `config.yaml`; `--draft-model none` starts without a draft, `--draft-model
auto` with the smallest local model that can draft for the target. Under
`mlx.launch -n N`, rank 0 serves with the target sharded over the N processes and the others
follow it (`server.engine.distributed`).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import socket
import ssl
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from server.blas import ensure_fast_blas, log_blas
from server.config import Settings
from server.engine.distributed import DistributedLayout, launched_layout

log = logging.getLogger("server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=None, help="YAML settings file.")
    p.add_argument("--model", help="Target model: local mlx_lm folder or hub id.")
    p.add_argument("--model-name", help="The name clients send as `model` (default: the"
                   " --model path or id).")
    p.add_argument("--adapter-path", help="An mlx_lm.lora adapter folder for the target.")
    p.add_argument("--chat-template", help="A Jinja chat template, or its file, instead of the"
                   " tokenizer's.")
    p.add_argument("--chat-template-args", type=json.loads, metavar="JSON",
                   help='Variables every chat is rendered with, e.g. \'{"enable_thinking":'
                        ' false}\'.')
    p.add_argument("--embedding-model", help="A model for /v1/embeddings (default: none).")
    p.add_argument("--draft-model", help="Draft model path or hub id; 'auto': the smallest local"
                   " model that can draft for the target; 'none' for no draft.")
    p.add_argument("--num-draft-tokens", type=int, help="Draft tokens per round.")
    p.add_argument("--host", help="Interface to bind (default 127.0.0.1).")
    p.add_argument("--port", type=int, help="TCP port (default 8000).")
    p.add_argument("--ssl-certfile", help="A PEM certificate file: serve HTTPS (with"
                   " --ssl-keyfile).")
    p.add_argument("--ssl-keyfile", help="The certificate's PEM private key file.")
    p.add_argument("--state-dir", help="A folder that keeps stored responses, conversations,"
                   " files and batches across restarts (default: memory only).")
    p.add_argument("--distributed-mode", choices=["tensor", "pipeline"],
                   help="Under mlx.launch: shard the target tensor parallel (default) or"
                        " pipeline parallel.")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    models = {k: v for k, v in {
        "model": args.model, "model_name": args.model_name, "draft_model": args.draft_model,
        "adapter_path": args.adapter_path, "num_draft_tokens": args.num_draft_tokens,
        "chat_template": args.chat_template, "chat_template_kwargs": args.chat_template_args,
        "embedding_model": args.embedding_model,
    }.items() if v is not None}
    server = {k: v for k, v in {"host": args.host, "port": args.port,
                                "state_dir": args.state_dir, "ssl_certfile": args.ssl_certfile,
                                "ssl_keyfile": args.ssl_keyfile}.items() if v is not None}
    distributed = {"mode": args.distributed_mode} if args.distributed_mode else {}
    return Settings.load(args.config, models=models, server=server, distributed=distributed)


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
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    layout = launched_layout(settings.distributed.mode)
    follower = layout is not None and layout.rank > 0  # mlx.launch: rank 0 serves HTTP
    if not follower:
        check_tls(settings.server.ssl_certfile, settings.server.ssl_keyfile)
    sock = None if follower else listen(settings.server.host, settings.server.port)
    log_blas()
    serve(settings, sock, layout)


def serve(settings: Settings, sock: socket.socket | None,
          layout: DistributedLayout | None) -> None:
    from server.engine.follower import run_follower
    from server.http.app import create_app
    from server.http.shutdown import DrainingServer
    from server.http.state_db import StateError
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
    DrainingServer(app, host=settings.server.host, port=settings.server.port,
                   log_level=settings.server.log_level,
                   drain_timeout_s=settings.engine.drain_timeout_s,
                   ssl_certfile=settings.server.ssl_certfile,
                   ssl_keyfile=settings.server.ssl_keyfile).run(sockets=[sock])


if __name__ == "__main__":
    main()
