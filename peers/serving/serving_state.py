"""What a peer's services share and change while it serves, in one small explicit object.

`ServingState` holds the stage served now (its runtime and averager, swapped together by a move),
the peer's state on the DHT (joining, online, standby, offline), the stage a move is heading for,
the request counters, the compute clock (how busy the stage computes), the requests' phase times
and the trainers' commits handled (peers/serving/commit_order.py). peers/serving/host.py builds one
and hands it to every service that reads or changes it: the stage RPCs, replica sync, moves, the
announcer and the checkpointer.

Threads: the event loop changes the state and the counters; `swap` runs on the compute thread
(through the compute executor), so a request computes on either the old stage or the new one,
never on half of each.
"""

from __future__ import annotations

import dataclasses
import time

from dht.records import PeerState
from peers.compute.faults import FaultyStageRuntime
from peers.compute.stage_runtime import StageRuntime
from peers.compute.utilization import ComputeClock
from peers.metrics import PeerMetrics
from peers.replicas.averaging import GradientSync, ParameterAveraging
from peers.serving.commit_order import CommitOrder
from process.phase_times import PhaseTimes
from wire import compression

Averaging = GradientSync | ParameterAveraging | None
Runtime = StageRuntime | FaultyStageRuntime


@dataclasses.dataclass(eq=False)
class ServingState:
    runtime: Runtime
    averaging: Averaging
    metrics: PeerMetrics
    state: PeerState = PeerState.JOINING
    moving_to: int | None = None  # while moving: the stage announced as joining
    in_flight: int = 0  # requests being received, queued or computed
    requests_served: int = 0
    requests_failed: int = 0
    announced_online_at: float | None = None  # when the first `online` record was stored
    # Top-k residuals of the gradients this peer sends back: they belong to the served stage's tensors.
    feedback: compression.ErrorFeedback = dataclasses.field(default_factory=compression.ErrorFeedback)
    # how busy the stage's compute is (peers/compute/utilization.py), and where the requests' time goes
    # by phase (peers/metrics.py names them); both outlive a move
    compute_clock: ComputeClock = dataclasses.field(default_factory=ComputeClock)
    phases: PhaseTimes = dataclasses.field(default_factory=PhaseTimes)
    # the trainers' commits handled, which calls sent while a commit travelled wait for
    commits: CommitOrder = dataclasses.field(default_factory=CommitOrder)

    def served_one(self) -> None:
        """Count a request served (either RPC: a stage call or a chain's hop); the first one also says
        how long after the peer went online it came."""
        self.requests_served += 1
        if self.requests_served == 1 and self.announced_online_at is not None:
            print(
                f"first request served {time.monotonic() - self.announced_online_at:.2f} s after the "
                f"online record was stored",
                flush=True,
            )

    def set_state(self, state: PeerState) -> None:
        self.state = state
        self.metrics.set_state(state.value)

    @property
    def announced_stage(self) -> int:
        """The stage this peer's record names: a move's target while it moves, else the one served."""
        return self.moving_to if self.moving_to is not None else self.runtime.stage

    def swap(self, runtime: Runtime, averaging: Averaging) -> None:
        """Serve another stage from now on. Call it on the compute thread."""
        self.runtime, self.averaging = runtime, averaging
        self.feedback = compression.ErrorFeedback()
