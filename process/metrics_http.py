"""The `/metrics` HTTP endpoint every process kind serves its Prometheus registry on, and the
checks of its flags. Shared plumbing: peers and trainers import it; it imports no project package."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from process.config import ConfigError

# How often the serving thread looks for a stop request: `close()` waits up to this long. The
# socketserver default (0.5 s) was half a second added to every process's exit.
POLL_INTERVAL_S = 0.05


class MetricsServerError(ConfigError):
    """The metrics HTTP endpoint could not start (port taken, bad address)."""


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per scrape (prometheus_client's server, with the address family of its host)."""

    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's signature)
        """Scrapes are not logged."""


@dataclass
class MetricsEndpoint:
    """A running `/metrics` HTTP server; `close()` stops it and frees the port."""

    host: str
    port: int
    _server: WSGIServer

    @property
    def url(self) -> str:
        return f"http://{_host_port(self.host, self.port)}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint | None:
    """Serve `registry` on host:port in a daemon thread; port 0 picks a free port, -1 serves nothing."""
    if port == -1:
        return None
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    except OSError as e:
        raise MetricsServerError(
            f"cannot serve metrics on {_host_port(host, port)}: {e.strerror or e}; choose "
            f"another --metrics-port (0 = any free port, -1 = off)"
        ) from None
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S}, name="metrics-http", daemon=True
    )
    thread.start()
    return MetricsEndpoint(host=host, port=server.server_address[1], _server=server)


def validate_metrics_options(host: str, port: int) -> None:
    """Raise a ConfigError for a port outside [-1, 65535] or a host that is not an IP address."""
    if not -1 <= port <= 65535:
        raise ConfigError(f"--metrics-port must be -1 (off), 0 (any free port) or a port number, not {port}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"--metrics-host must be an IP address (127.0.0.1, 0.0.0.0, ::), not {host!r}") from None


def advertised_metrics_addr(
    bound_host: str, port: int, *, announce_maddrs: Sequence[str] = (), host_maddrs: Sequence[str] = ()
) -> str | None:
    """The host:port others should scrape, or None when no reachable address is known.

    A concrete bound address is used as is. For a wildcard bind (0.0.0.0, ::) the IP of the first
    /ip4 or /ip6 announce multiaddr is used (the address the peer tells others to dial), else the
    first non-wildcard listen multiaddr."""
    if not ipaddress.ip_address(bound_host).is_unspecified:
        return _host_port(bound_host, port)
    for maddr in [*announce_maddrs, *host_maddrs]:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                ip = ipaddress.ip_address(parts[2])
            except ValueError:
                continue
            if not ip.is_unspecified:
                return _host_port(str(ip), port)
    return None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for tests and tools that must name a port up front)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
