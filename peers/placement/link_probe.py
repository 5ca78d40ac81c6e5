"""Measuring links to other peers and publishing them for the live planner (`swarm plan --from-dht`).

The probe RPC (`RPC_PROBE`) echoes a payload: the caller streams a `ProbeRequest` header and
`payload_bytes` of data in 1 MiB parts; the peer answers with a `ProbeResponse` and the same parts
(both headers in `wire.protocol`).
Round-trip time is the fastest of a few tiny echoes (after one uncounted echo, which may
include dialing the peer); bandwidth comes from a larger echo whose size
grows until it takes a noticeable time (`bulk_target_s`) or reaches `bulk_max_bytes`:
bandwidth = 2 * size / (time - rtt), the payload crossing the link both ways.

`LinkProber` runs on the peer's event loop (peers/serving/host.py starts it unless probing is off): on a randomized period it finds the other peers of its
model on the DHT, probes a bounded number of them (never measured first, then the oldest
measurement), each under a time limit and one at a time (so probes do not measure each other), and
publishes a `LinkRecord` with an expiry: each link as the median of its last few measurements.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from dht.announce import fetch_stage_records_async
from dht.link_records import (
    MAX_LINKS_PER_RECORD,
    LinkMeasurement,
    LinkRecord,
    publish_links_async,
)
from dht.record_policy import MAX_RECORD_TTL_S
from dht.records import PeerState
from wire.bounded_streams import StreamLimits, iterate_bounded
from wire.messages import read_request, read_response, request_messages, response_messages
from wire.protocol import MAX_PROBE_BYTES, PROBE_CHUNK_BYTES, RPC_PROBE, ProbeRequest, ProbeResponse, ProtocolError

logger = logging.getLogger(__name__)

MAX_CONCURRENT_PROBES = 4  # echoes served at once: bounds the memory probes can take on a peer
PROBE_DEADLINE_S = 10.0  # a probe's request must arrive within this (the prober's own time limit per link)
MIN_TRANSFER_FRACTION = 0.05  # a bulk echo is never credited with less than 5% of its time for the transfer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeSettings:
    """How a peer measures its links.

    period_s: mean seconds between probe rounds (each round waits 0.75-1.25x this, at random).
    max_peers: peers probed per round, at most.
    timeout_s: time limit on measuring one link (tiny and bulk echoes together).
    tiny_bytes, tiny_repeats: payload and count of the echoes that measure the round trip (the
        fastest counts: the least disturbed by queueing or a busy CPU).
    bulk_start_bytes, bulk_max_bytes, bulk_target_s: the bandwidth echo starts at
        `bulk_start_bytes` and grows 4x while it takes under `bulk_target_s`, up to `bulk_max_bytes`.
    max_age_s: a measurement older than this is dropped from the published record (default 10 periods).
    history: a link is published as the median of its last `history` measurements.
    """

    period_s: float = 60.0
    max_peers: int = 8
    timeout_s: float = 10.0
    tiny_bytes: int = 64
    tiny_repeats: int = 5
    bulk_start_bytes: int = 256 << 10
    bulk_max_bytes: int = 4 << 20
    bulk_target_s: float = 0.25
    max_age_s: float | None = None
    history: int = 3

    def __post_init__(self) -> None:
        if not (self.period_s > 0 and self.timeout_s > 0 and self.bulk_target_s > 0):
            raise ValueError("period_s, timeout_s and bulk_target_s must be positive")
        if self.max_peers < 1 or self.tiny_repeats < 1 or self.history < 1:
            raise ValueError("max_peers, tiny_repeats and history must be at least 1")
        if not 0 < self.bulk_start_bytes <= self.bulk_max_bytes <= MAX_PROBE_BYTES:
            raise ValueError(f"need 0 < bulk_start_bytes <= bulk_max_bytes <= {MAX_PROBE_BYTES}")

    @property
    def record_ttl_s(self) -> float:
        """A link record outlives two missed rounds (and never what DHT nodes store)."""
        return min(3.0 * self.period_s * 1.25, MAX_RECORD_TTL_S)

    @property
    def link_max_age_s(self) -> float:
        return self.max_age_s if self.max_age_s is not None else 10.0 * self.period_s


# --- the RPC --------------------------------------------------------------------------------------


def _payload_parts(payload_bytes: int) -> list[runtime_pb2.Tensor]:
    block = bytes(min(payload_bytes, PROBE_CHUNK_BYTES))
    return [
        runtime_pb2.Tensor(buffer=block[: min(PROBE_CHUNK_BYTES, payload_bytes - offset)])
        for offset in range(0, payload_bytes, PROBE_CHUNK_BYTES)
    ]


async def rpc_probe(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], context, *, deadline_s: float | None = None
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Echo the payload back; a malformed request, or one that takes over `deadline_s` to arrive,
    gets a `ProbeResponse.error`, not a dropped stream."""
    try:
        reading = read_request(requests, ProbeRequest, max_parts=MAX_PROBE_BYTES // PROBE_CHUNK_BYTES + 1)
        try:
            request = await asyncio.wait_for(reading, timeout=deadline_s)
        except TimeoutError:
            raise ProtocolError(f"the probe did not arrive within {deadline_s:.0f} s") from None
        header, parts = request.header, request.parts
        received = sum(len(part.buffer) for part in parts)
        if received != header.payload_bytes:
            raise ProtocolError(f"the header announced {header.payload_bytes} bytes, {received} came")
        response = ProbeResponse(payload_bytes=received)
    except ProtocolError as e:
        response, parts = ProbeResponse(error=str(e)), []
    for message in response_messages(response, parts):
        yield message


async def _request_messages(payload_bytes: int) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for message in request_messages(ProbeRequest(payload_bytes=payload_bytes), _payload_parts(payload_bytes)):
        yield message


async def echo(p2p: P2P, peer_id: str, payload_bytes: int) -> float:
    """Seconds one echo of `payload_bytes` takes (no time limit here: callers set one)."""
    started = time.perf_counter()
    stream = await iterate_bounded(  # each echoed message within 4 MiB (callers bound the time)
        p2p,
        PeerID.from_base58(peer_id),
        RPC_PROBE,
        _request_messages(payload_bytes),
        runtime_pb2.ExpertResponse,
        StreamLimits(read_timeout_s=600.0),
    )
    answer = await read_response(stream, ProbeResponse, max_parts=MAX_PROBE_BYTES // PROBE_CHUNK_BYTES + 1)
    header, parts = answer.header, answer.parts
    elapsed = time.perf_counter() - started
    if header.error:
        raise ProtocolError(f"peer {peer_id[-8:]} refused the probe: {header.error}")
    if sum(len(part.buffer) for part in parts) != payload_bytes:
        raise ProtocolError(f"peer {peer_id[-8:]} echoed another payload than it was sent")
    return elapsed


async def measure_link(p2p: P2P, peer_id: str, settings: ProbeSettings) -> LinkMeasurement:
    """Round trip and bandwidth to one peer, within `settings.timeout_s` (asyncio.TimeoutError after)."""

    async def measure() -> LinkMeasurement:
        await echo(p2p, peer_id, settings.tiny_bytes)  # not counted: may include dialing the peer
        rtt_s = min([await echo(p2p, peer_id, settings.tiny_bytes) for _ in range(settings.tiny_repeats)])
        size = settings.bulk_start_bytes
        while True:
            elapsed = await echo(p2p, peer_id, size)
            if elapsed >= settings.bulk_target_s or size >= settings.bulk_max_bytes:
                break
            size = min(size * 4, settings.bulk_max_bytes)
        transfer_s = max(elapsed - rtt_s, elapsed * MIN_TRANSFER_FRACTION)
        return LinkMeasurement(
            rtt_ms=rtt_s * 1e3, bandwidth_gbps=2 * size * 8 / transfer_s / 1e9, measured_at=get_dht_time()
        )

    # Not `wait_for`, which (Python 3.11) runs `measure` as a task of its own: a probe cancelled in the
    # instant its stream closed (both peers stopping) ends in the stream's error, not cancelled, and
    # that task's error, read by nobody, was logged as an ERROR ("Task exception was never retrieved").
    async with asyncio.timeout(settings.timeout_s):
        return await measure()


# --- choosing whom to probe (pure) ----------------------------------------------------------------


def choose_probe_targets(
    candidates: Iterable[str], last_measured: Mapping[str, float], *, limit: int, rng: random.Random
) -> list[str]:
    """Up to `limit` peers: those never measured first (in random order), then the oldest measured."""
    pool = sorted(set(candidates))
    rng.shuffle(pool)
    pool.sort(key=lambda peer: last_measured.get(peer, float("-inf")))  # stable: ties stay shuffled
    return pool[:limit]


def median_link(history: Iterable[LinkMeasurement]) -> LinkMeasurement:
    """One link from its last measurements: the median round trip and bandwidth (a probe slowed by
    a busy CPU moves neither), stamped with the newest measurement's time."""
    history = list(history)
    return LinkMeasurement(
        rtt_ms=statistics.median(m.rtt_ms for m in history),
        bandwidth_gbps=statistics.median(m.bandwidth_gbps for m in history),
        measured_at=max(m.measured_at for m in history),
    )


# --- the loop on the peer -------------------------------------------------------------------------


class LinkProber:
    """Probes other peers of `model` periodically and publishes this peer's `LinkRecord`."""

    def __init__(
        self,
        dht: hivemind.DHT,
        p2p: P2P,
        *,
        peer_id: str,
        model: str,
        num_stages: int,
        stage: Callable[[], int | None],
        throughput: Callable[[], float],
        settings: ProbeSettings,
        rng: random.Random | None = None,
    ):
        self.dht, self.p2p, self.peer_id, self.model, self.num_stages = dht, p2p, peer_id, model, num_stages
        self.stage, self.throughput, self.settings = stage, throughput, settings
        self.rng = rng or random.Random()
        self.links: dict[str, LinkMeasurement] = {}  # what the record says: the median of each link's history
        self.history: dict[str, collections.deque[LinkMeasurement]] = {}
        self.rounds = 0

    async def other_peers(self) -> set[str]:
        """Peers of this model that are here now: an unexpired stage record that does not say offline
        (online, joining or standby). Link records alone do not count: they outlive their peer by
        up to their TTL, and probing a peer gone for minutes only fails."""
        results = await asyncio.gather(
            *[fetch_stage_records_async(self.dht, self.model, stage, timeout_s=5.0) for stage in range(self.num_stages)]
        )
        newest = {}
        for record in (r for records in results for r in records):
            if record.peer_id not in newest or record.expires_at > newest[record.peer_id].expires_at:
                newest[record.peer_id] = record
        peers = {peer for peer, record in newest.items() if record.state != PeerState.OFFLINE}
        peers.discard(self.peer_id)
        return peers

    async def probe_round(self) -> LinkRecord:
        """Measure up to `max_peers` links, forget stale or vanished ones, publish the record."""
        peers = await self.other_peers()
        measured_at = {peer: link.measured_at for peer, link in self.links.items()}
        for peer in choose_probe_targets(peers, measured_at, limit=self.settings.max_peers, rng=self.rng):
            # A failed probe adds nothing: the link keeps its earlier measurements until they grow
            # older than `link_max_age_s` or the peer leaves the DHT (a stream reset under load
            # must not make a good link look unmeasured).
            try:
                measurement = await measure_link(self.p2p, peer, self.settings)
            except TimeoutError:
                logger.warning(f"Probing {peer[-8:]} took over {self.settings.timeout_s} s; nothing measured")
                continue
            except Exception as e:  # dead or unreachable peers fail in assorted ways; the loop must go on
                logger.info(f"Probing {peer[-8:]} failed: {type(e).__name__}: {e}")  # a peer leaving: routine
                continue
            history = self.history.setdefault(peer, collections.deque(maxlen=self.settings.history))
            history.append(measurement)
            self.links[peer] = median_link(history)
        now = get_dht_time()
        fresh = sorted(
            (
                (peer, link)
                for peer, link in self.links.items()
                if peer in peers and now - link.measured_at <= self.settings.link_max_age_s
            ),
            key=lambda item: item[1].measured_at,
            reverse=True,
        )
        self.links = dict(fresh[:MAX_LINKS_PER_RECORD])  # a record holds a bounded number: the newest
        self.history = {peer: history for peer, history in self.history.items() if peer in self.links}
        stage = self.stage()
        record = LinkRecord(
            peer_id=self.peer_id,
            model=self.model,
            stage=stage,
            num_stages=self.num_stages,
            throughput=float(self.throughput()),
            measured_at=now,
            expires_at=now + self.settings.record_ttl_s,
            links=dict(self.links),
        )
        await publish_links_async(self.dht, record)
        self.rounds += 1
        return record

    async def run(self, stop: asyncio.Event) -> None:
        """Probe rounds until `stop` is set: the first soon after start, then every ~period. A round
        in progress when `stop` is set is cancelled, so the peer's shutdown never waits for probes."""
        delay = self.rng.uniform(0.2, 1.0) * min(self.settings.period_s, 5.0)
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
                return
            except TimeoutError:
                pass
            probing = asyncio.ensure_future(self.probe_round())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({probing, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not probing.done():
                probing.cancel()
                await asyncio.gather(probing, return_exceptions=True)
                return
            if probing.exception() is not None:  # a DHT hiccup must not end the loop
                error = probing.exception()
                logger.warning(f"Link probe round failed: {type(error).__name__}: {error}")
            delay = self.settings.period_s * self.rng.uniform(0.75, 1.25)


def bounded_probe_handler(
    *, max_concurrent: int = MAX_CONCURRENT_PROBES, per_caller: int = 1, deadline_s: float = PROBE_DEADLINE_S
):
    """The `RPC_PROBE` handler: at most `max_concurrent` echoes at once (the others wait), at most
    `per_caller` of them from one caller (the caller's next ones are refused at once), each request
    read within `deadline_s`. Before: a caller re-opening probe streams that trickled held every
    slot, and 2 of 6 honest echoes were answered within 10 s (issue #60). The peer registers it
    behind its admission guard (peers/serving/host.py)."""
    slots = asyncio.Semaphore(max_concurrent)
    active: collections.Counter[str] = collections.Counter()

    async def bounded_probe(requests, context):
        caller = _caller(context)
        if active[caller] >= per_caller:
            await _drain(requests, deadline_s)  # answering before the caller finished sending resets the stream
            for message in refused_probe(ProtocolError(f"a probe from {caller[-8:]} is in progress"), 0.0):
                yield message
            return
        active[caller] += 1
        try:
            async with slots:
                async for message in rpc_probe(requests, context, deadline_s=deadline_s):
                    yield message
        finally:
            active[caller] -= 1
            if not active[caller]:
                del active[caller]

    return bounded_probe


def _caller(context) -> str:
    remote = getattr(context, "remote_id", None)
    return remote.to_base58() if remote is not None else "unknown"


async def _drain(requests: AsyncIterator, deadline_s: float) -> None:
    """Read and drop what the caller sends (within the probe's size and `deadline_s`)."""
    try:
        async with asyncio.timeout(deadline_s):
            received = 0
            async for message in requests:
                received += sum(len(part.buffer) for part in message.tensors)
                if received > MAX_PROBE_BYTES:
                    return
    except (TimeoutError, ProtocolError):
        pass


def refused_probe(error: Exception, waited_s: float) -> list[runtime_pb2.ExpertResponse]:
    """What the probe RPC answers a caller the peer's admission guard refused."""
    return list(response_messages(ProbeResponse(error=str(error)[:1024]), []))
