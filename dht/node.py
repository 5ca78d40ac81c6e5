"""Starting a hivemind DHT node with errors a user can act on, and the network settings every
process kind shares."""

from __future__ import annotations

import dataclasses
import logging
import os

import hivemind
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError

from dht.configuration import ConfigError, option

logger = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """The DHT node could not start or could not reach its initial peers."""


@dataclasses.dataclass(kw_only=True)
class NetworkConfig:
    """How a process joins the swarm's DHT (shared by the bootstrap node, peers and trainers)."""

    initial_peers: list[str] = option(default_factory=list, help="multiaddrs of running DHT nodes to join "
                                      "(e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...)")
    host_maddrs: list[str] = option(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
                                    help="multiaddrs to listen on; use /ip4/0.0.0.0/tcp/PORT to accept other machines")
    announce_maddrs: list[str] = option(default_factory=list, help="public multiaddrs others should dial (behind NAT or a port map)")
    identity_path: str | None = option(None, help="private key file for a stable peer id (created if missing)")
    startup_timeout_s: float = option(30.0, help="give up starting the DHT node after this many seconds")
    use_relay: bool = option(True, help="let libp2p circuit relays carry traffic to and from this node (libp2p's "
                             "relay transport; needed to reach or be reached through a relay)")
    use_auto_relay: bool = option(False, help="behind NAT or a firewall: look for relays among the swarm's public "
                                  "peers and become reachable through them")

    def __post_init__(self) -> None:
        for maddr in [*self.initial_peers, *self.host_maddrs, *self.announce_maddrs]:
            if not maddr.startswith("/"):
                raise ConfigError(f"{maddr!r} is not a multiaddr (they look like /ip4/127.0.0.1/tcp/31337/p2p/Qm...)")


def check_identity_file(path: str) -> None:
    """An existing identity file must hold a private key hivemind can read (a missing one is created)."""
    if not os.path.exists(path):
        return
    try:
        with open(path, "rb") as f:
            PeerID.from_identity(f.read())
    except OSError as e:
        raise BootstrapError(f"cannot read the identity file {path!r}: {e.strerror}") from None
    except Exception as e:  # protobuf and key-parsing errors have no common base class
        raise BootstrapError(f"the identity file {path!r} does not hold a private key ({type(e).__name__}); move it "
                             f"away and a new identity (a new peer id) is created") from None


def start_dht(network: NetworkConfig, *, client_mode: bool = False) -> hivemind.DHT:
    """Start a DHT node in its own process. Raises `BootstrapError` with a plain message."""
    kwargs = dict(host_maddrs=network.host_maddrs, startup_timeout=network.startup_timeout_s,
                  use_relay=network.use_relay, use_auto_relay=network.use_auto_relay)
    if network.announce_maddrs:
        kwargs["announce_maddrs"] = network.announce_maddrs
    if network.identity_path:
        check_identity_file(network.identity_path)
        kwargs["identity_path"] = network.identity_path
    try:
        return hivemind.DHT(initial_peers=network.initial_peers, client_mode=client_mode, start=True,
                            await_ready=True, **kwargs)
    except P2PDaemonError as e:
        text = str(e)
        if "bootstrap" in text.lower():
            raise BootstrapError(f"could not reach any of the initial peers {network.initial_peers}: is the "
                                 f"bootstrap node running and is the address (including /p2p/<id>) right?") from None
        if "already taken" in text:
            raise BootstrapError(f"another running peer uses the identity in {network.identity_path!r}: give each "
                                 f"peer its own --identity-path") from None
        raise BootstrapError(f"the p2p daemon failed to start: {text}") from None
    except (ValueError, TimeoutError) as e:
        raise BootstrapError(f"could not start the DHT node: {e}") from None
