"""The `/metrics` HTTP endpoint every process kind serves its Prometheus registry on, and the
checks of its flags. Shared plumbing: peers and trainers import it; it imports no project package."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from process.config import ConfigError


class MetricsServerError(ConfigError):
    """The metrics HTTP endpoint could not start (port taken, bad address)."""


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
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MetricsServerError(
            f"cannot serve metrics on {_host_port(host, port)}: {e.strerror or e}; choose "
            f"another --metrics-port (0 = any free port, -1 = off)"
        ) from None
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
