"""The link probe without a network: the echo handler, the estimate from echo times, whom a round
probes, what it publishes, and that a round in progress never holds up the peer's shutdown."""

from __future__ import annotations

import asyncio
import random

import pytest
from hivemind.proto import runtime_pb2

from dht.link_records import LinkMeasurement
from peers.placement import link_probe
from peers.placement.link_probe import LinkProber, ProbeSettings, choose_probe_targets, measure_link, rpc_probe
from wire.protocol import PROBE_CHUNK_BYTES, ProbeRequest, ProbeResponse, decode_header, encode_header


async def _collect(stream) -> list:
    return [message async for message in stream]


async def _requests(header_bytes: int, payload_bytes: int):
    parts = link_probe._payload_parts(payload_bytes)
    yield runtime_pb2.ExpertRequest(metadata=encode_header(ProbeRequest(payload_bytes=header_bytes)), tensors=parts[:1])
    for part in parts[1:]:
        yield runtime_pb2.ExpertRequest(tensors=[part])


@pytest.mark.parametrize("size", [0, 64, PROBE_CHUNK_BYTES, 2 * PROBE_CHUNK_BYTES + 5])
def test_the_probe_handler_echoes_the_payload(size: int) -> None:
    replies = asyncio.run(_collect(rpc_probe(_requests(size, size), None)))
    assert decode_header(ProbeResponse, replies[0].metadata) == ProbeResponse(payload_bytes=size)
    assert sum(len(t.buffer) for reply in replies for t in reply.tensors) == size
    assert all(len(t.buffer) <= PROBE_CHUNK_BYTES for reply in replies for t in reply.tensors)


def test_the_probe_handler_answers_a_bad_request_with_an_error() -> None:
    replies = asyncio.run(_collect(rpc_probe(_requests(100, 50), None)))
    header = decode_header(ProbeResponse, replies[0].metadata)
    assert "announced 100 bytes, 50 came" in header.error
    assert len(replies) == 1 and not replies[0].tensors


def test_measure_link_recovers_the_round_trip_and_bandwidth_of_a_simulated_link(monkeypatch) -> None:
    rtt_s, bits_per_s = 0.020, 100e6  # 20 ms, 100 Mbit/s
    sizes = []

    async def fake_echo(p2p, peer_id, payload_bytes):
        sizes.append(payload_bytes)
        return rtt_s + 2 * payload_bytes * 8 / bits_per_s  # the payload crosses both ways

    monkeypatch.setattr(link_probe, "echo", fake_echo)
    settings = ProbeSettings(bulk_start_bytes=64 << 10, bulk_max_bytes=4 << 20, bulk_target_s=0.1)
    measured = asyncio.run(measure_link(None, "PEER", settings))
    assert measured.rtt_ms == pytest.approx(20.0 + 2 * 64 * 8 / 1e5, rel=1e-6)  # tiny echoes carry 64 bytes
    assert measured.bandwidth_gbps == pytest.approx(0.1, rel=0.01)
    # 1 uncounted + 5 tiny echoes, then 64 KiB (0.03 s < 0.1 s target) grows 4x to 256 KiB (0.06 s), 1 MiB.
    assert sizes == [64] * 6 + [64 << 10, 256 << 10, 1 << 20]


def test_measure_link_gives_up_at_its_time_limit(monkeypatch) -> None:
    async def slow_echo(p2p, peer_id, payload_bytes):
        await asyncio.sleep(10)
        return 10.0

    monkeypatch.setattr(link_probe, "echo", slow_echo)
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(measure_link(None, "PEER", ProbeSettings(timeout_s=0.05)))


def test_a_probe_whose_stream_closes_as_it_is_cancelled_leaves_no_unretrieved_error(monkeypatch) -> None:
    """At a demo's Ctrl-C a stage-0 peer's log once ended in asyncio's ERROR "Task exception was never
    retrieved" (StreamClosedError): its prober was cancelled just as the probed peer, stopping too,
    closed the stream, so the echo ended in that error rather than cancelled. Under `wait_for` the
    probe ran as a task of its own whose error nobody read; the error now reaches the round."""
    import gc

    from wire.protocol import StreamClosedError

    echoing = asyncio.Event()

    async def echo_closed_under_cancel(p2p, peer_id, payload_bytes):
        echoing.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:  # the stream closed in the same instant: the read fails instead
            raise StreamClosedError("empty stream: closed before any message") from None
        return 0.0

    monkeypatch.setattr(link_probe, "echo", echo_closed_under_cancel)
    reported = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        probing = asyncio.create_task(measure_link(None, "PEER", ProbeSettings(timeout_s=30.0)))
        await echoing.wait()
        probing.cancel()  # the prober stopping
        result = (await asyncio.gather(probing, return_exceptions=True))[0]
        gc.collect()  # an unretrieved task exception is reported when the task is collected
        await asyncio.sleep(0)
        return result

    result = asyncio.run(scenario())
    assert isinstance(result, (StreamClosedError, asyncio.CancelledError)) and reported == []


def test_probe_targets_never_measured_first_then_oldest_and_bounded() -> None:
    measured = {"A": 50.0, "B": 10.0, "C": 30.0}
    chosen = choose_probe_targets(["A", "B", "C", "D", "E"], measured, limit=4, rng=random.Random(0))
    assert sorted(chosen[:2]) == ["D", "E"] and chosen[2:] == ["B", "C"]
    assert choose_probe_targets(["A", "B"], {}, limit=5, rng=random.Random(0)) in (["A", "B"], ["B", "A"])
    assert choose_probe_targets([], {}, limit=3, rng=random.Random(0)) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(period_s=0),
        dict(max_peers=0),
        dict(timeout_s=-1),
        dict(bulk_start_bytes=8 << 20, bulk_max_bytes=1 << 20),
        dict(bulk_max_bytes=64 << 20),
    ],
)
def test_probe_settings_refuse_impossible_values(kwargs) -> None:
    with pytest.raises(ValueError):
        ProbeSettings(**kwargs)


class FakeProber(LinkProber):
    """A prober whose DHT and links are simulated: `peers` is who is online, `dead` fail to answer."""

    def __init__(self, peers: set[str], dead: set[str] = frozenset(), **settings):
        super().__init__(
            None,
            None,
            peer_id="SELF",
            model="tiny",
            num_stages=2,
            stage=lambda: 1,
            throughput=lambda: 12.5,
            settings=ProbeSettings(**settings),
            rng=random.Random(0),
        )
        self.peers, self.dead, self.published, self.probed = peers, dead, [], []

    async def other_peers(self) -> set[str]:
        return set(self.peers)


@pytest.fixture
def fake_network(monkeypatch):
    clock = {"now": 1000.0}

    async def fake_measure(p2p, peer_id, settings):
        prober.probed.append(peer_id)
        if peer_id in prober.dead:
            raise ConnectionError("peer gone")
        return LinkMeasurement(rtt_ms=1.0, bandwidth_gbps=1.0, measured_at=clock["now"])

    async def fake_publish(dht, record, **kwargs):
        prober.published.append(record)
        return True

    monkeypatch.setattr(link_probe, "measure_link", fake_measure)
    monkeypatch.setattr(link_probe, "publish_links_async", fake_publish)
    monkeypatch.setattr(link_probe, "get_dht_time", lambda: clock["now"])
    prober = FakeProber({"A", "B", "C"}, max_peers=2, period_s=10.0)
    return prober, clock


def test_a_round_probes_a_bounded_number_and_publishes_what_it_knows(fake_network) -> None:
    prober, clock = fake_network
    first = asyncio.run(prober.probe_round())
    assert len(prober.probed) == 2 and set(first.links) == set(prober.probed)
    assert (first.peer_id, first.stage, first.num_stages, first.throughput) == ("SELF", 1, 2, 12.5)
    assert first.expires_at > clock["now"]
    clock["now"] += 10
    second = asyncio.run(prober.probe_round())
    assert set(second.links) == {"A", "B", "C"}  # the one left out last round went first this round


def test_a_round_forgets_peers_that_left_or_went_stale_but_not_after_one_failure(fake_network) -> None:
    prober, clock = fake_network
    prober.settings = ProbeSettings(max_peers=3, period_s=10.0, max_age_s=25.0)
    assert set(asyncio.run(prober.probe_round()).links) == {"A", "B", "C"}
    clock["now"] += 10
    prober.peers, prober.dead = {"A", "B"}, {"B"}  # C left, B failed this probe
    record = asyncio.run(prober.probe_round())
    assert set(record.links) == {"A", "B"} and record.links["B"].measured_at == clock["now"] - 10
    clock["now"] += 20  # B's only measurement is now 30 s old
    record = asyncio.run(prober.probe_round())
    assert set(record.links) == {"A"}
    clock["now"] += 30
    prober.peers, prober.settings = {"A", "D"}, ProbeSettings(max_peers=1, period_s=10.0, max_age_s=25.0)
    record = asyncio.run(prober.probe_round())  # probes the new D only; A's measurement is 30 s old
    assert prober.probed[-1] == "D" and set(record.links) == {"D"}


def test_stopping_cancels_a_round_in_progress(monkeypatch) -> None:
    started = asyncio.Event()

    async def stuck_round(self):
        started.set()
        await asyncio.sleep(60)

    monkeypatch.setattr(FakeProber, "probe_round", stuck_round)

    async def scenario() -> float:
        prober = FakeProber({"A"}, period_s=0.01)
        stop = asyncio.Event()
        task = asyncio.create_task(prober.run(stop))
        await asyncio.wait_for(started.wait(), timeout=5)
        loop = asyncio.get_running_loop()
        begun = loop.time()
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        return loop.time() - begun

    assert asyncio.run(scenario()) < 1.0


def test_a_failing_round_does_not_end_the_loop(monkeypatch) -> None:
    rounds = []

    async def failing_round(self):
        rounds.append(1)
        raise TimeoutError("DHT hiccup")

    monkeypatch.setattr(FakeProber, "probe_round", failing_round)

    async def scenario() -> None:
        prober = FakeProber({"A"}, period_s=0.01)
        stop = asyncio.Event()
        task = asyncio.create_task(prober.run(stop))
        deadline = asyncio.get_running_loop().time() + 5
        while len(rounds) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(scenario())
    assert len(rounds) >= 3


def test_a_record_keeps_only_the_newest_links_when_there_are_too_many(fake_network, monkeypatch) -> None:
    prober, clock = fake_network
    monkeypatch.setattr(link_probe, "MAX_LINKS_PER_RECORD", 2)
    prober.settings = ProbeSettings(max_peers=1, period_s=10.0)
    for _ in range(3):  # one new peer measured per round: A, B, C (in some order)
        record = asyncio.run(prober.probe_round())
        clock["now"] += 1
    assert list(record.links) == prober.probed[:0:-1]  # the two newest, newest first


def test_one_slow_probe_does_not_move_the_published_link(fake_network, monkeypatch) -> None:
    prober, clock = fake_network
    prober.peers, prober.settings = {"A"}, ProbeSettings(max_peers=1, period_s=10.0, history=3)
    results = iter([(2.0, 1.0), (2.2, 1.1), (80.0, 0.01), (2.1, 0.9)])  # the third: a CPU hiccup

    async def measure(p2p, peer_id, settings):
        rtt, bandwidth = next(results)
        return LinkMeasurement(rtt_ms=rtt, bandwidth_gbps=bandwidth, measured_at=clock["now"])

    monkeypatch.setattr(link_probe, "measure_link", measure)
    published = []
    for _ in range(4):
        published.append(asyncio.run(prober.probe_round()).links["A"])
        clock["now"] += 10
    assert [link.rtt_ms for link in published] == [2.0, 2.1, 2.2, 2.2]
    assert [link.bandwidth_gbps for link in published] == [1.0, 1.05, 1.0, 0.9]
    assert published[-1].measured_at == clock["now"] - 10


def test_one_caller_holds_one_probe_at_a_time_and_a_trickling_probe_is_cut_off() -> None:
    """Issue #60: a caller re-opening probe streams that never finished held every slot; 2 of 6
    honest echoes were answered within 10 s."""
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    def context(n: int):
        return SimpleNamespace(remote_id=PeerID(bytes([0x12, 0x20]) + bytes([n]) * 32))

    async def trickle():
        yield runtime_pb2.ExpertRequest(metadata=encode_header(ProbeRequest(payload_bytes=64)))
        await asyncio.sleep(30)  # the rest never comes in time

    async def run():
        handler = link_probe.bounded_probe_handler(max_concurrent=2, deadline_s=0.5)
        stuck = asyncio.ensure_future(_collect(handler(trickle(), context(1))))
        await asyncio.sleep(0.05)
        again = await _collect(handler(_requests(64, 64), context(1)))  # the same caller: refused at once
        honest = await _collect(handler(_requests(64, 64), context(2)))  # another caller: served
        return again, honest, await stuck

    again, honest, stuck = asyncio.run(run())
    assert "in progress" in decode_header(ProbeResponse, again[0].metadata).error
    assert decode_header(ProbeResponse, honest[0].metadata) == ProbeResponse(payload_bytes=64)
    assert "did not arrive within" in decode_header(ProbeResponse, stuck[0].metadata).error
