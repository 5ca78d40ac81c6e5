"""The emulated network does what it is asked: two namespaces joined by a shaped, delayed link
measure within 20% of the asked RTT and rate, and nothing is left behind afterwards, also when
the code inside the `with` fails. Skipped without root, `ip`, `tc`, `iptables` or htb."""

from __future__ import annotations

import subprocess
import time

import pytest

from benchmarks.netem.network import EmulatedNetwork, list_namespaces, missing_requirements
from benchmarks.netem.probe import probe_link
from benchmarks.netem.topology import LinkSpec, Topology

REASON = missing_requirements()
# serial: the link's measured rate and RTT must be within 20% of the asked ones, so nothing runs beside it.
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

RTT_MS, MBIT = 80.0, 20.0


def two_hosts() -> Topology:
    return Topology(
        name="pair",
        regions=("east", "west"),
        intra_region=LinkSpec(rtt_ms=1.0, bandwidth_mbit=1000.0),
        links={frozenset(("east", "west")): LinkSpec(rtt_ms=RTT_MS, bandwidth_mbit=MBIT)},
        hosts={"a": "east", "b": "west"},
    )


def _our_state(net: EmulatedNetwork) -> dict:
    """Everything of this network that could outlive it: namespaces and processes inside them."""
    return {"namespaces": net.leftovers(), "pids": net.pids()}


def test_shaped_link_measures_as_asked_and_is_torn_down(tmp_path):
    net = EmulatedNetwork(two_hosts(), workdir=str(tmp_path))
    with net:
        assert sorted(net.leftovers()) == sorted([net.hub, *(h.namespace for h in net.hosts.values())])
        assert len(net.pids()) == 2  # one delay proxy per host
        m = probe_link(net, "a", "b", seconds=1.0)
        # Both directions of the same link, and the same link dialled from the other side.
        back = probe_link(net, "b", "a", seconds=0.5)
    for measurement in (m, back):
        assert abs(measurement.rtt_ms - RTT_MS) <= 0.2 * RTT_MS, measurement
        assert abs(measurement.forward_mbit - MBIT) <= 0.2 * MBIT, measurement
        assert abs(measurement.reverse_mbit - MBIT) <= 0.2 * MBIT, measurement
    assert measurement.errors(tolerance=0.2) == []
    assert _our_state(net) == {"namespaces": [], "pids": []}
    assert not [n for n in list_namespaces() if n.startswith(net.hub.split(".")[0])]


def test_unshaped_pairs_are_not_delayed(tmp_path):
    """The RTT really comes from the proxy: hosts in one region (1 ms asked) answer in a few ms."""
    topology = two_hosts().with_hosts({"a": "east", "b": "east"})
    with EmulatedNetwork(topology, workdir=str(tmp_path)) as net:
        m = probe_link(net, "a", "b", seconds=0.2)
    assert m.rtt_ms < 10.0, m
    assert net.leftovers() == []


def test_torn_down_when_the_run_fails(tmp_path):
    net = EmulatedNetwork(two_hosts(), workdir=str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            # A process started inside a namespace and never stopped by its owner.
            stray = subprocess.Popen([*net.exec_prefix("a"), "sleep", "300"], start_new_session=True)
            deadline = time.monotonic() + 10.0
            while stray.pid not in net.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stray.pid in net.pids()
            raise RuntimeError("boom")
    assert stray.wait(timeout=10) == -9  # killed by the teardown
    assert _our_state(net) == {"namespaces": [], "pids": []}


def test_only_addresses_inside_the_namespaces(tmp_path):
    """Hosts get addresses from the private subnet; the machine's own namespace gains none."""
    before = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    with EmulatedNetwork(two_hosts(), workdir=str(tmp_path)) as net:
        during = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert all(h.ip.startswith("10.213.0.") for h in net.hosts.values())
    assert during == before
