"""RPC_DATA_PLANE: a caller asks this peer, over p2pd, how to reach its data plane (wire/data_plane.py).

The answer (`DataPlaneOffer`: the port, the TLS certificate's fingerprint, and a token naming the
caller) crosses the p2pd connection that authenticated both peer ids, so the caller learns the
certificate of this peer's identity and the data plane learns the caller's from its token. The
admission guard has admitted the caller (allow list, penalty box) before this runs; in a private
run only callers holding a credential of the run are told anything (`POLICY["connect"]`). A peer
without a data plane, or one it could not start, answers `error`: its callers stay on p2pd.
"""

from __future__ import annotations

from hivemind.proto import runtime_pb2

from peers.serving.admission import AdmissionGuard, NotAuthorizedError, caller_id
from wire.data_plane import DataPlaneServer
from wire.messages import read_unary, unary_response
from wire.protocol import DataPlaneOffer, DataPlaneRequest, ProtocolError


class DataPlaneOffers:
    def __init__(self, guard: AdmissionGuard, server: DataPlaneServer | None = None):
        self.guard, self.server = guard, server  # server: None while there is none (off, or not started)

    async def rpc_offer(self, request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        caller = caller_id(context)
        try:
            wanted = read_unary(request, DataPlaneRequest)
            self.guard.authorize(caller, wanted.credential, "connect")
        except ProtocolError as e:  # NotAuthorizedError is one
            if not isinstance(e, NotAuthorizedError):
                self.guard.penalize(caller)
            return unary_response(DataPlaneOffer(error=str(e)[:1000]))
        if self.server is None:
            return unary_response(DataPlaneOffer(error="this peer has no data plane (--no-data-plane)"))
        return unary_response(self.server.offer(caller))

    @staticmethod
    def refused(error: Exception, waited_s: float) -> runtime_pb2.ExpertResponse:
        return unary_response(DataPlaneOffer(error=str(error)[:1000]))
