"""The agent's HTTP port binds without asking DNS who it is."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler

from gpuwatch.agent.port import BoundedHTTPServer, PortPolicy


def test_server_name_is_the_bound_address_not_a_reverse_lookup() -> None:
    # http.server would set server_name to socket.getfqdn(host) ("localhost" here): a
    # reverse DNS query at every start, and the idna codec in the agent's memory.
    server = BoundedHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler, policy=PortPolicy())
    try:
        port = server.socket.getsockname()[1]
        assert port != 0
        assert (server.server_name, server.server_port) == ("127.0.0.1", port)
    finally:
        server.server_close()
