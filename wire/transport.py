"""How this process calls a peer's streamed RPC: over the data plane when it reaches the peer, else p2pd.

    transport = Transport(p2p, DataPlaneClient(p2p, credential=...))   (None: p2pd only)
    answers = await transport.iterate(peer_id, RPC_FORWARD, requests, runtime_pb2.ExpertResponse, limits)

`iterate` is `wire.bounded_streams.iterate_bounded` with the transport chosen per call: a data plane
connection to the peer if one is kept or can be made now (wire/data_plane.py), else a p2pd stream
kept from an earlier call (`StreamPool`) or a new one. Only what happens before the request is sent
chooses: a peer without a data plane, an offer refused, or a port that cannot be reached sends the
call through p2pd, and that peer is tried again later. Once the request is on its way, a failure is
the call's, whatever carried it: a connection that breaks mid-call fails it as a broken stream does
(the caller's failover and exactly-once rules decide what happens next), never sent again here.
`stats` counts calls and payload bytes per transport, for the process's metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from hivemind.p2p import P2P, PeerID

from wire.bounded_streams import StreamLimits, StreamPool, iterate_bounded
from wire.data_plane import DataPlaneClient
from wire.transport_stats import TransportStats


class Transport:
    def __init__(self, p2p: P2P, data_plane: DataPlaneClient | None = None, *, stats: TransportStats | None = None):
        self.p2p, self.data_plane = p2p, data_plane
        self.stats = stats or (data_plane.stats if data_plane is not None else TransportStats())
        if data_plane is not None:
            data_plane.stats = self.stats
        self.streams = StreamPool()  # p2pd streams, kept open from call to call

    async def iterate(
        self, peer_id: str, name: str, requests: AsyncIterator, response_type: type, limits: StreamLimits
    ) -> AsyncIterator:
        """The answers to one call of `name` on `peer_id` (see the module's docstring)."""
        if self.data_plane is not None:
            connection = await self.data_plane.connection(peer_id)
            if connection is not None:
                return self.data_plane.call(connection, name, requests, response_type, limits)
        stats = self.stats
        stats.call("p2pd", "made", name)
        answers = await iterate_bounded(
            self.p2p,
            PeerID.from_base58(peer_id),
            name,
            _counted(requests, stats),
            response_type,
            limits,
            pool=self.streams,
        )
        return _counted(answers, stats, "received")

    async def direct(self, peer_id: str) -> bool:
        """Whether the next call to `peer_id` goes over the data plane (a connection is kept or made
        for it now)."""
        if self.data_plane is None:
            return False
        connection = await self.data_plane.connection(peer_id)
        if connection is None:
            return False
        self.data_plane.keep(connection)
        return True

    def close(self) -> None:
        """Close every kept stream and connection (their handlers end now, not at their idle timeout)."""
        self.streams.close()
        if self.data_plane is not None:
            self.data_plane.close()


async def _counted(messages: AsyncIterator, stats: TransportStats, direction: str = "sent") -> AsyncIterator:
    async for message in messages:
        stats.message("p2pd", direction, message)
        yield message
