"""`--averaging outer`: a stage's replicas step on their own at every trainer commit and meet in
outer rounds every H local steps (peers/replicas/outer_rounds.py has the math, outer_exchange.py
the network). This is the replica's side on its compute thread: the local step, a round's begin
(its pseudo-gradient encoded from the stage's trainable values) and its finish (the outer step and
the values rebased onto the new anchor), and the round state that a joiner or a repaired replica
downloads with the stage (`state_dict`, saved and sent with the optimizer's, StageRuntime).

Every replica of a stage steps on every commit (one that served no sample counts an empty step),
so step counts stay aligned and the rounds begin at the same commits everywhere; a state download
copies the count. A replica alone in its stage still takes its rounds (its own payload is the
group's), so its anchor keeps up and a replica that joins later starts from a current one.
Loaded state (a download, a checkpoint) brings the anchors, bases, momenta and round counts; the
error-feedback residual is this replica's own and starts afresh, and a round in flight is dropped.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dht.records import OuterRoundsRecord
from peers.compute.stage_runtime import REPLICA_STATE_KEY, StageRuntime
from peers.replicas.averaging import AveragingRound
from peers.replicas.outer_rounds import BegunRound, Contribution, OuterRounds, OuterSchedule, PseudoGradientCodec
from peers.replicas.outer_step import OuterSettings
from wire.compression import CodecError

logger = logging.getLogger(__name__)

REMEMBERED_COMMITS = 64


@dataclass(frozen=True)
class OuterOutcome:
    """What one commit did, as its answer tells the trainer."""

    stepped: bool
    samples: int
    steps_done: int
    applied: int = 0  # rounds applied at this commit
    failed: int = 0  # rounds that failed at this commit
    group_size: int = 1
    pending: bool = False  # an overlapped round is in flight


@dataclass
class Begun:
    """A round this replica began: what the exchange sends, and with what weight and anchor."""

    round: BegunRound
    weight: float
    anchor: str


class OuterAveraging:
    mode = "outer"
    reason = ""  # why this mode (`--averaging auto`), as the peer's record states it

    def __init__(
        self,
        runtime: StageRuntime,
        *,
        schedule: OuterSchedule,
        settings: OuterSettings,
        codec: PseudoGradientCodec,
        robust: str = "clip",
        timeout_s: float = 30.0,
        on_round: Callable | None = None,
    ):
        self.runtime, self.schedule, self.timeout_s, self.on_round = runtime, schedule, timeout_s, on_round
        self.settings, self.codec, self.robust = settings, codec, robust
        runtime.auto_step = False  # one local step per trainer commit, so replicas count steps together
        self.state = self._fresh_state()
        self.served = [0] * schedule.fragments  # samples served since each fragment's round began
        self.outcomes: OrderedDict[str, OuterOutcome] = OrderedDict()
        self.rounds = self.failed_rounds = 0
        self.bytes_sent = self.bytes_received = 0
        self.closing = False
        self.members = None  # a run with an authority: the credentialed replicas (AveragingMembers)
        self.lock = threading.Lock()
        runtime.replica_state = self  # saved and sent with the optimizer's state
        if runtime.loaded_replica_state is not None:  # restored from a checkpoint before this was built
            self.load_state_dict(runtime.loaded_replica_state)
            runtime.loaded_replica_state = None

    def _fresh_state(self) -> OuterRounds:
        return OuterRounds(self.flat_values(), self.schedule, self.settings, self.codec, self.robust)

    # --- the stage's values as one flat buffer -------------------------------------------------------
    def flat_values(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.runtime.params])

    def write_values(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.runtime.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype))
                offset += p.numel()
        self.runtime.cache.clear()  # cached graphs hold activations of the values before the round

    # --- on the compute thread -------------------------------------------------------------------------
    def local_step(self, step_id: str) -> OuterOutcome | None:
        """Step on what this replica accumulated in the trainer's step; None for a repeated commit
        (a retry, another trainer's), which has its first answer in `outcomes`."""
        if step_id in self.outcomes:
            return None
        samples = self.runtime.samples_accumulated
        if samples > 0:
            self.runtime.step()
        else:
            self.runtime.count_empty_step()
        self.served = [s + samples for s in self.served]
        return OuterOutcome(True, samples, self.runtime.steps_done)

    def begin(self, fragment: int, begun_after: int) -> Begun:
        weight = float(max(self.served[fragment], 1))
        begun = self.state.begin(fragment, self.flat_values(), begun_after)
        self.served[fragment] = 0
        return Begun(begun, weight, self.state.anchor_digest(fragment))

    def finish(self, fragment: int, contributions: list[Contribution] | None, begun_after: int) -> bool:
        """Apply (or, with None, fail) the round of `fragment` begun after `begun_after`; False
        also when that round is no longer in flight here (state was loaded since)."""
        in_flight = self.state.fragments[fragment].in_flight
        if in_flight is None or in_flight.begun_after != begun_after:
            return False
        flat = self.flat_values()
        try:
            applied = self.state.finish(fragment, flat, contributions)
        except CodecError as e:  # a groupmate's payload that does not decode: the round fails here
            logger.warning(f"stage {self.runtime.stage}: an outer round's payload was refused: {e}")
            applied = self.state.finish(fragment, flat, None)
        if applied:
            self.write_values(flat)
        return applied

    # --- what the trainer sees ---------------------------------------------------------------------
    @property
    def outer_rounds(self) -> int:
        return sum(f.rounds_applied for f in self.state.fragments)

    def anchor_digest(self) -> str:
        digests = "".join(self.state.anchor_digest(f) for f in range(len(self.state.fragments)))
        return hashlib.sha256(digests.encode()).hexdigest()[:16]

    def remember(self, step_id: str, outcome: OuterOutcome) -> OuterOutcome:
        self.outcomes[step_id] = outcome
        while len(self.outcomes) > REMEMBERED_COMMITS:
            self.outcomes.popitem(last=False)
        return outcome

    def settings_record(self) -> OuterRoundsRecord:
        """What the peer's record says of these rounds (a replica joining with `--averaging auto` takes them)."""
        return OuterRoundsRecord(
            every_steps=self.schedule.every_steps,
            fragments=self.schedule.fragments,
            overlap=self.schedule.overlap,
            codec=self.codec.codec,
            topk_fraction=self.codec.topk_fraction,
            outer_lr=self.settings.lr,
            outer_momentum=self.settings.momentum,
        )

    def in_flight(self) -> list[BegunRound]:
        return self.state.in_flight()

    # --- saved and sent with the stage's state ------------------------------------------------------
    def state_dict(self) -> dict:
        fragments = self.state.fragments
        return {
            "names": list(self.runtime.param_names),  # the flat buffer's tensors, in order (`agreed_state`)
            "every_steps": self.schedule.every_steps,
            "fragments": self.schedule.fragments,
            "anchors": [f.anchor.clone() for f in fragments],
            "bases": [f.base.clone() for f in fragments],
            "velocities": [f.velocity.clone() for f in fragments],
            "rounds_applied": [f.rounds_applied for f in fragments],
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Rounds as a downloaded or saved state has them; without one (a state from a replica in
        another mode, an old checkpoint), the loaded values are the anchor and no round was taken."""
        self.state = self._fresh_state()
        self.served = [0] * self.schedule.fragments
        if not state:
            return
        sizes = [f.anchor.numel() for f in self.state.fragments]
        try:
            same = state["fragments"] == self.schedule.fragments and [t.numel() for t in state["anchors"]] == sizes
        except (KeyError, TypeError, AttributeError):
            same = False
        if not same:
            logger.warning(
                f"stage {self.runtime.stage}: the loaded state's outer rounds do not fit this schedule; "
                "starting them from the loaded values"
            )
            return
        for f, anchor, base, velocity, applied in zip(
            self.state.fragments, state["anchors"], state["bases"], state["velocities"], state["rounds_applied"]
        ):
            f.anchor, f.base, f.velocity = anchor.float().clone(), base.float().clone(), velocity.float().clone()
            f.rounds_applied = int(applied)

    def rounds_of_state(self, state: dict | None) -> int:
        """The rounds a loaded state had applied (0 without outer rounds)."""
        return sum(int(n) for n in (state or {}).get("rounds_applied", []))

    # --- the peer's life -------------------------------------------------------------------------------
    def record(self, ok: bool, group_size: int, sent: int, received: int) -> None:
        if ok:
            self.rounds += 1
        else:
            self.failed_rounds += 1
        self.bytes_sent += sent
        self.bytes_received += received
        if self.on_round is not None:
            self.on_round(AveragingRound("outer", ok, group_size if ok else 0, sent, received))

    @property
    def bytes_averaged(self) -> int:
        return self.bytes_sent + self.bytes_received

    def set_members(self, members) -> None:
        self.members = frozenset(members)

    def close(self) -> None:
        self.closing = True

    def shutdown(self) -> None:
        self.close()


def agreed_state(module_state: dict, optimizer_state: dict) -> tuple[dict, int] | None:
    """A downloaded or saved state of an outer-rounds replica with its trainable tensors replaced by
    the anchors, the values every replica of the stage agrees on after its last round (its own
    tensors hold what it learned since), and the rounds applied; None for a state of another mode."""
    rounds = optimizer_state.get(REPLICA_STATE_KEY) if isinstance(optimizer_state, dict) else None
    if not rounds or "names" not in rounds:
        return None
    flat = torch.cat([a.reshape(-1) for a in rounds["anchors"]])
    names = list(rounds["names"])
    if any(name not in module_state for name in names) or sum(module_state[n].numel() for n in names) != flat.numel():
        return None
    agreed, offset = dict(module_state), 0
    for name in names:
        tensor = module_state[name]
        agreed[name] = flat[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
        offset += tensor.numel()
    return agreed, sum(int(n) for n in rounds["rounds_applied"])
