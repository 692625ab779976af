"""The HTTP floor of ingest: uvicorn, configured as ``gpuwatch server`` runs it, serving
an ASGI app that reads the request body whole and answers a fixed ``accepted`` reply.

No framework, no validation, no database: what any Python server on this stack pays
per request before doing any work. ``bench.server`` compares ingest and the raw
inserts against it. Run as ``python -m bench.http_floor``; it prints
``listening on http://...`` to stderr, as ``gpuwatch server`` does.

``--validate``: the same, and every POST body is also parsed and validated with the
published request model (``gpuwatch.wire.IngestRequest``), which any server that
checks what agents send against gpuwatch's schema must do. ``bench.load`` measures it
beside the floor, for how much of a snapshot's CPU the validation alone takes.
"""

from __future__ import annotations

import sys
from typing import Any

from gpuwatch.wire import IngestRequest

REPLY = b'{"accepted":1,"duplicate":0,"results":["accepted"]}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":  # lifespan is off; nothing else is expected
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await _reply(send)


async def validating_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body, more = bytearray(), True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["method"] == "POST":  # not the readiness probe's GET /healthz
        IngestRequest.model_validate_json(body)
    await _reply(send)


async def _reply(send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            # With a length, as Starlette sends it (without, h11 chunks the body).
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(REPLY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": REPLY})


def main() -> None:
    import uvicorn

    from gpuwatch.cli.server import bind_listen_socket
    from gpuwatch.server.protocol import server_config
    from gpuwatch.settings import ServerSettings

    # gpuwatch's own binding: a socket made without IPPROTO_TCP gets connections that
    # asyncio leaves with Nagle on, and every reply then waits ~40 ms for a delayed ACK.
    sock = bind_listen_socket("127.0.0.1", 0)
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    # gpuwatch server's own uvicorn configuration, so both servers differ only in the app.
    served = validating_app if "--validate" in sys.argv[1:] else app
    arrival = ServerSettings.model_fields["request_arrival_seconds"].default
    config = server_config(served, arrival_seconds=arrival, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
