"""``gpuwatch server``: migrate the database, then serve the central API with uvicorn."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import typer

from gpuwatch.errors import ConfigError
from gpuwatch.host_origin import bound_to_loopback

log = logging.getLogger(__name__)

DATABASE_URL_HELP = (
    "SQLAlchemy URL (default: SQLite under the data dir; env GPUWATCH_SERVER_DATABASE_URL)."
)
CONFIG_HELP = "TOML config file (default /etc/gpuwatch/gpuwatch.toml; env GPUWATCH_CONFIG)."


def register(app: typer.Typer) -> None:
    @app.command()
    def server(
        listen: str | None = typer.Option(
            None, "--listen", metavar="HOST:PORT", help="Where to serve the API (port 0: any)."
        ),
        database_url: str | None = typer.Option(
            None, "--database-url", metavar="URL", help=DATABASE_URL_HELP
        ),
        config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
    ) -> None:
        """Run the central server: apply migrations, then serve ingest and the read API."""
        import uvicorn

        from gpuwatch.cli.agent import use_config_file
        from gpuwatch.server.app import create_app
        from gpuwatch.server.database import database_for
        from gpuwatch.server.database.migrate import upgrade
        from gpuwatch.server.protocol import server_config
        from gpuwatch.server.runtime import raise_open_files_limit, tune_gc
        from gpuwatch.settings import ServerSettings, load, parse_host_port

        use_config_file(config)
        settings = load(ServerSettings, listen=listen, database_url=database_url)
        refused = settings.token_refusal()
        if refused is not None:
            raise ConfigError(f"invalid server settings: {refused}")
        database = database_for(settings)
        upgrade(database)
        database.dispose()
        host, port = parse_host_port(settings.listen)
        if settings.read_token is None and not bound_to_loopback(host):
            log.warning(
                "listening on %s with no read_token: anyone who can reach it can read the "
                "fleet's history; set GPUWATCH_SERVER_READ_TOKEN",
                host,
            )
        sock = bind_listen_socket(host, port)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        print(f"gpuwatch server listening on http://{shown}:{bound}", file=sys.stderr, flush=True)
        app_ = create_app(settings)
        tune_gc()
        raise_open_files_limit()
        serving = server_config(app_, arrival_seconds=settings.request_arrival_seconds)
        uvicorn.Server(serving).run(sockets=[sock])


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind first, so a busy port is one clear error (and port 0 can be reported).

    The socket takes its protocol from getaddrinfo (IPPROTO_TCP), not 0: asyncio sets
    TCP_NODELAY only on connections of a socket that names it, and with Nagle on a
    keep-alive client waits ~40 ms for each reply's delayed ACK.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    sock.set_inheritable(True)
    return sock
