"""`ragblend serve`: the RAG server on 127.0.0.1:8000 with the embedded model, FAISS and the disk KV tier."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from app.commands.exit_codes import ExitCode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default from config: 8000)")
    parser.add_argument("--data-dir", type=Path, help="documents, index and KV live here (default ./data)")
    parser.add_argument("--config", type=Path, help="a YAML file of settings (docs/configuration.md) layered over the defaults")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--allow-insecure-public", action="store_true",
                        help="listen on a non-loopback host without an API key (server.allow_public_without_key)")


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    server: dict[str, Any] = {name: value for name, value in (("host", args.host), ("port", args.port))
                              if value is not None}
    if args.allow_insecure_public:
        server["allow_public_without_key"] = True
    if server:
        overrides["server"] = server
    return overrides


def run(args: argparse.Namespace) -> int:
    from app.server import Server, ServeError, bind_socket, check_exposure, lock_data_dir, uvicorn_config
    from configs.settings import load_settings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings(args.config, **overrides_from(args))
    try:
        check_exposure(settings.server)
        lock_fd = lock_data_dir(settings.data_dir)  # held until the process ends
        try:
            sock = bind_socket(settings.server.host, settings.server.port)
        except ServeError:
            os.close(lock_fd)
            raise
    except ServeError as exc:
        print(f"ragblend serve: {exc}", file=sys.stderr)
        return ExitCode.CANNOT_START
    from app.main import create_app  # torch and the rest: imported only once the port is ours

    config = uvicorn_config(create_app(settings), settings, settings.server.host, settings.server.port,
                            args.log_level)
    try:
        with sock:
            Server(config).run(sockets=[sock])
    finally:
        os.close(lock_fd)  # after the lifespan has closed the stores
    return ExitCode.OK
