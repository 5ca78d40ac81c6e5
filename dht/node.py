"""Starting a hivemind DHT node with errors a user can act on, and the network settings every
process kind shares."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Collection, Coroutine
from typing import Any, TypeVar

import base58
import hivemind
import torch.multiprocessing
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError

from dht.record_policy import SwarmRecordValidator, protected_keys, record_store_senders
from dht.signing import IdentityError, load_identity, new_identity_file, register, validators
from process.config import ConfigError, option

logger = logging.getLogger(__name__)

T = TypeVar("T")

# hivemind shares its futures' state and its averagers' tensors with its child processes through
# torch's "file_system" strategy, which starts a torch_shm_manager in every process that shares a
# tensor: a binary that loads libtorch, about 0.5 s of CPU in each peer, trainer and DHT node, and
# one more process each. Passed as file descriptors (torch's own default on Linux), the shared memory
# needs no manager, and a killed process leaves no file in /dev/shm. HIVEMIND_MEMORY_SHARING_STRATEGY,
# where set, still decides, as hivemind documents.
if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
    torch.multiprocessing.set_sharing_strategy("file_descriptor")


class BootstrapError(RuntimeError):
    """The DHT node could not start or could not reach its initial peers."""


@dataclasses.dataclass(kw_only=True)
class NetworkConfig:
    """How a process joins the swarm's DHT (shared by the bootstrap node, peers and trainers)."""

    initial_peers: list[str] = option(
        default_factory=list, help="multiaddrs of running DHT nodes to join (e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...)"
    )
    host_maddrs: list[str] = option(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        help="multiaddrs to listen on; use /ip4/0.0.0.0/tcp/PORT to accept other machines",
    )
    announce_maddrs: list[str] = option(
        default_factory=list, help="public multiaddrs others should dial (behind NAT or a port map)"
    )
    identity_path: str | None = option(None, help="private key file for a stable peer id (created if missing)")
    startup_timeout_s: float = option(30.0, help="give up starting the DHT node after this many seconds")
    allowed_peers: list[str] = option(
        default_factory=list,
        help="private swarm: only these peer ids may announce "
        "records this node reads and call this node's RPCs (give every process a stable "
        "--identity-path and list their ids); empty: an open swarm",
    )
    plan_signers: list[str] = option(
        default_factory=list,
        help="peer ids whose placement plans (swarm plan --publish) this node stores and follows; "
        "empty: those of --allowed-peers in a private swarm, any peer's signed plan in an open one",
    )
    use_relay: bool = option(
        True,
        help="let libp2p circuit relays carry traffic to and from this node (libp2p's "
        "relay transport; needed to reach or be reached through a relay)",
    )
    use_auto_relay: bool = option(
        False,
        help="behind NAT or a firewall: look for relays among the swarm's public "
        "peers and become reachable through them",
    )

    def __post_init__(self) -> None:
        for flag, peer_ids in (("--allowed-peers", self.allowed_peers), ("--plan-signers", self.plan_signers)):
            for peer_id in peer_ids:
                if not _is_peer_id(peer_id):
                    raise ConfigError(f"{flag}: {peer_id!r} is not a peer id (they look like Qm... or 12D3KooW...)")
        for maddr in [*self.initial_peers, *self.host_maddrs, *self.announce_maddrs]:
            if not maddr.startswith("/"):
                raise ConfigError(f"{maddr!r} is not a multiaddr (they look like /ip4/127.0.0.1/tcp/31337/p2p/Qm...)")


def _is_peer_id(text: str) -> bool:
    try:
        return 30 <= len(base58.b58decode(text)) <= 64
    except ValueError:
        return False


def start_dht(network: NetworkConfig, *, client_mode: bool = False, models: Collection[str] = ()) -> hivemind.DHT:
    """Start a DHT node in its own process, signing its records with its RSA identity and
    validating everyone else's (dht/signing.py); on the keys of `models`, keeping only records
    dht/record_policy.py accepts. Raises `BootstrapError` with a plain message."""
    kwargs = dict(
        host_maddrs=network.host_maddrs,
        startup_timeout=network.startup_timeout_s,
        use_relay=network.use_relay,
        use_auto_relay=network.use_auto_relay,
    )
    if network.announce_maddrs:
        kwargs["announce_maddrs"] = network.announce_maddrs
    scratch = None
    identity_path = network.identity_path
    if identity_path is None:  # a fresh identity for this run, deleted once p2pd has read it
        scratch = tempfile.mkdtemp(prefix="swarm-identity-")
        identity_path = os.path.join(scratch, "identity.key")
    try:
        if not os.path.exists(identity_path):
            try:
                identity = new_identity_file(identity_path)
            except OSError as e:
                raise BootstrapError(f"cannot write the identity file {identity_path!r}: {e.strerror}") from None
            kwargs["check_if_identity_free"] = False  # just made: nobody else can hold it
        else:
            try:
                identity = load_identity(identity_path)
            except IdentityError as e:
                raise BootstrapError(str(e)) from None
        guard = SwarmRecordValidator(
            protected_keys(models, allowed_peers=network.allowed_peers, plan_signers=network.plan_signers),
            cap_subkeys=not client_mode,  # a client stores nothing for others
        )
        record_store_senders()  # the guard's budget per sender knows who asked (before the node forks)
        dht = _start(network, client_mode, validators(identity, guard), identity_path, kwargs)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if dht.peer_id.to_base58() != identity.peer_id:  # p2pd derives its id from the same key
        dht.shutdown()
        raise BootstrapError(f"the p2p daemon runs as {dht.peer_id}, not as the identity {identity.peer_id}")
    register(dht, identity, allowed_peers=network.allowed_peers, plan_signers=network.plan_signers)
    return dht


def protect_models(
    dht: hivemind.DHT, network: NetworkConfig, models: Collection[str], *, num_stages: int, client_mode: bool = False
) -> None:
    """Guard the keys of `models` (split into `num_stages`) too from now on: a process that learned
    its model from the run's spec. (The rules travel to the DHT's process through a pipe that does
    not take the thousands of stage keys `start_dht` guards: only this split's.)"""
    rules = protected_keys(
        models,
        allowed_peers=network.allowed_peers,
        plan_signers=network.plan_signers,
        max_stages=num_stages,
        runs=False,
    )
    dht.add_validators([SwarmRecordValidator(rules, cap_subkeys=not client_mode)])


async def with_p2p_client(dht: hivemind.DHT, main: Coroutine[Any, Any, T]) -> T:
    """Await `main`, a role's whole async main, with this process's client of the DHT node's p2pd
    open (hivemind's `replicate_p2p`, which returns the same one to every later call in the process),
    and close it after. hivemind never closes it: each process would leave its socket behind
    (`/tmp/hivemind-p2pclient-*.sock`)."""
    try:
        p2p = await dht.replicate_p2p()
    except BaseException:
        main.close()  # never started: no "never awaited" warning on top of the error
        raise
    try:
        return await main
    finally:
        await p2p.shutdown()


def _start(
    network: NetworkConfig, client_mode: bool, record_validators: list, identity_path: str, kwargs: dict
) -> hivemind.DHT:
    try:
        return hivemind.DHT(
            initial_peers=network.initial_peers,
            client_mode=client_mode,
            start=True,
            await_ready=True,
            record_validators=record_validators,
            identity_path=identity_path,
            **kwargs,
        )
    except P2PDaemonError as e:
        text = str(e)
        if "bootstrap" in text.lower():
            raise BootstrapError(
                f"could not reach any of the initial peers {network.initial_peers}: is the "
                f"bootstrap node running and is the address (including /p2p/<id>) right?"
            ) from None
        if "already taken" in text:
            raise BootstrapError(
                f"another running peer uses the identity in {network.identity_path!r}: give each "
                f"peer its own --identity-path"
            ) from None
        raise BootstrapError(f"the p2p daemon failed to start: {text}") from None
    except (ValueError, TimeoutError) as e:
        raise BootstrapError(f"could not start the DHT node: {e}") from None
