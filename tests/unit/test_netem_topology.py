"""Topologies as data: validation with plain messages, the DT-FM cut, and a lossless round trip;
the delay proxy's relay holds data for its delay and keeps every byte in order (loopback only)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from benchmarks.netem.delay_proxy import relay
from benchmarks.netem.topology import LinkSpec, TopologyError, from_dtfm_case, load_topology, topology_from_dict

WORLD4 = "benchmarks/topologies/world4.json"


def _raw(**changes):
    raw = {
        "name": "t",
        "regions": ["a", "b"],
        "intra_region": {"rtt_ms": 1, "bandwidth_mbit": 100},
        "links": [{"regions": ["a", "b"], "rtt_ms": 50, "bandwidth_mbit": 10}],
        "hosts": {"x": "a", "y": "b"},
    }
    raw.update(changes)
    return raw


def test_a_valid_topology_answers_links_by_host_and_region():
    t = topology_from_dict(_raw())
    assert t.host_link("x", "y") == LinkSpec(50, 10) == t.host_link("y", "x")
    assert t.host_link("x", "x") == LinkSpec(1, 100)
    assert t.link("a", "b").one_way_delay_s == pytest.approx(0.025)
    assert t.link("a", "b").bytes_per_s == pytest.approx(1.25e6)
    assert topology_from_dict(t.to_dict()) == t


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"links": []}, "no link between regions 'a' and 'b'"),
        ({"hosts": {"x": "mars"}}, "not one of"),
        ({"links": [{"regions": ["a", "b"], "rtt_ms": 5, "bandwidth_mbit": 10}] * 2}, "listed twice"),
        ({"links": [{"regions": ["a", "a"], "rtt_ms": 5, "bandwidth_mbit": 10}]}, "two distinct"),
        ({"links": [{"regions": ["a", "b"], "rtt_ms": 5}]}, "missing 'bandwidth_mbit'"),
        ({"links": [{"regions": ["a", "b"], "rtt_ms": -1, "bandwidth_mbit": 10}]}, "rtt_ms must lie"),
        ({"links": [{"regions": ["a", "b"], "rtt_ms": 1, "bandwidth_mbit": "fast"}]}, "must be numbers"),
        ({"hosts": {"Bad Name": "a"}}, "lower-case"),
        ({"regions": "a"}, "list of names"),
    ],
)
def test_invalid_topologies_say_what_to_fix(changes, message):
    with pytest.raises(TopologyError, match=message):
        topology_from_dict(_raw(**changes))


def test_world4_is_cut_from_case5_as_recorded():
    """The shipped file equals what its recorded command computes from the DT-FM scenario."""
    world4 = load_topology(WORLD4)
    source = world4.source
    case = json.load(open(f"benchmarks/dtfm_scenarios/{source['scenario']}.json"))
    again = from_dtfm_case(
        case,
        source["devices"],
        intra_region_pair=tuple(source["intra_region_pair"]),
        bandwidth_divisor=source["bandwidth_divisor"],
        name=world4.name,
        hosts=world4.hosts,
    )
    assert again.links == world4.links and again.intra_region == world4.intra_region
    # case5: Oregon (device 0) - London (device 40) is 136 ms and 0.42 Gbit/s.
    assert world4.link("oregon", "london").rtt_ms == 136.0
    assert world4.link("oregon", "london").bandwidth_mbit == pytest.approx(420 / source["bandwidth_divisor"], abs=1e-3)


def test_relay_delays_every_chunk_and_keeps_the_bytes():
    async def scenario():
        received = bytearray()
        arrived = asyncio.Event()
        payload = bytes(range(256)) * 4096  # 1 MiB

        async def sink(reader, writer):
            while chunk := await reader.read(1 << 16):
                received.extend(chunk)
            arrived.set()
            writer.close()

        async def entry(reader, writer):
            _, upstream = await asyncio.open_connection("127.0.0.1", sink_port)
            await relay(reader, upstream, delay_s=0.15)
            upstream.close()
            writer.close()

        sink_server = await asyncio.start_server(sink, "127.0.0.1", 0)
        sink_port = sink_server.sockets[0].getsockname()[1]
        entry_server = await asyncio.start_server(entry, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", entry_server.sockets[0].getsockname()[1])
        started = time.perf_counter()
        writer.write(payload)
        writer.write_eof()
        await asyncio.wait_for(arrived.wait(), timeout=10)
        elapsed = time.perf_counter() - started
        writer.close()
        for server in (entry_server, sink_server):
            server.close()
        return bytes(received) == payload, elapsed

    same, elapsed = asyncio.run(scenario())
    assert same
    assert 0.15 <= elapsed < 1.0
