"""Sync averaging with a one-step delay (`--averaging sync --sync-delay 1`): agreement overlapped
with compute, as hivemind's Optimizer does with `delay_optimizer_step` / `delay_grad_averaging`.

The commit of step t, on the compute thread: moves step t's gradients aside, finishes the round of
step t-1 and applies its averaged gradient with one optimizer step, starts step t's round in the
averager's process, and answers at once with step t-1's outcome (`pending` for step t). So every
update lands exactly one step late, on every replica alike, and a one-process run with the same
delay computes the same parameters.

- The first steps take the exact barrier (`--sync-delay-from`, by default the warmup's steps).
- Weight prediction (`--weight-prediction`, peers/compute/weight_prediction.py) computes each step
  on the parameters plus a guess at the update they lack.
- The trainer's last commit is followed by a flush (`CommitRequest.flush`) that applies the last
  round; with `--clip-grad-norm`, `prepare` and `apply_prepared` clip the update applied.
- A failed round puts its gradients back into the accumulation; a one-sided failure is repaired
  by the trainer as in exact mode.

Not covered: a replica that joins mid-run, or a stage move, leaves that replica one update apart.
The schedule step by step, and what it costs: docs/design/replicas.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from hivemind.averaging.control import StepControl

from peers.replicas.averaging import AveragingOutcome, GradientSync, round_has_samples, samples_in_round
from peers.replicas.averaging_members import MIN_WEIGHT

logger = logging.getLogger(__name__)

SYNC_DELAYS = (0, 1)  # steps an update may lag: 0, the exact barrier; 1, overlapped with the next step


@dataclass
class InFlightRound:
    """A step's gradients on their way to the update: averaging with the group, or waiting alone."""

    control: StepControl | None  # None: no round (alone in the stage, or it could not start)
    gradients: list[torch.Tensor]  # this replica's mean gradients of the step (applied alone, or carried over)
    samples: int
    caps: dict[str, int] | None
    alone: bool


class DelayedGradientSync(GradientSync):
    """`sync` with `--sync-delay 1`: each commit applies the previous step's averaged update and
    starts the averaging of this one, answering without waiting for it. The stage's first
    `exact_steps` steps are exact (`--sync-delay-from`; default: the learning-rate warmup's)."""

    def __init__(self, *args, exact_steps: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.exact_steps = exact_steps
        self.in_flight: InFlightRound | None = None
        self.held: tuple[AveragingOutcome, list[torch.Tensor]] | None = None  # clipping: an update prepared

    def wait_in_flight(self, timeout_s: float | None = None) -> None:
        """Block until the round in flight (if any) is over; touches no tensor, so call it on any
        thread but the compute thread, before `commit`, which then finds the round done."""
        in_flight = self.in_flight
        if in_flight is None or in_flight.control is None:
            return
        try:
            in_flight.control.result(timeout=timeout_s if timeout_s is not None else 2 * self.timeout_s + 5.0)
        except Exception:  # noqa: BLE001 - the outcome is read (and logged) by `finish_round` on the compute thread
            pass

    def commit(
        self, step_id: str, group_size: int, samples: Mapping[str, int] | None = None, *, flush: bool = False
    ) -> AveragingOutcome:
        """Apply the update in flight, then start averaging this step's gradients (none with `flush`).
        Answers with the outcome of the update applied. A repeated commit (a trainer retry) does
        nothing. A flush whose round failed averages its gradients again at once, as exact mode does
        (with a partner whose round did not fail, this one waits for the round's timeout in vain, and
        then the trainer's repair loads the partner's state)."""
        if not flush and self.exact_now():
            outcome = super().commit(step_id, group_size, samples)
            self.runtime.stop_predicting()  # last-update's guess would move an exact step
            return outcome
        if not self._first_commit_of(step_id):
            if step_id in self.outcomes:  # an exact step's commit, repeated after the delay began
                return self._repeated(step_id)
            return AveragingOutcome(False, 1, 0, stepped=False, pending=self.in_flight is not None)
        outcome, update = self.next_update(step_id, group_size, samples, flush=flush)
        if update is not None:
            self.runtime.apply_gradients(update)
        self.predict_next_update()
        return outcome

    def prepare(
        self, step_id: str, group_size: int, samples: Mapping[str, int] | None = None, *, flush: bool = False
    ) -> AveragingOutcome:
        """Clipping by the global norm with the delay, first phase: `commit`, except that the update
        of the previous step is held instead of applied. The answer says `stepped=False` and carries
        the held update's squared norm (None when there is none, or it is not finite); every stage's
        replicas answer for the same step, one step late, so the trainer's global norm is that
        step's. `apply_prepared` then applies it, scaled, before the next step computes."""
        if not flush and self.exact_now():
            return super().prepare(step_id, group_size, samples)
        if not self._first_commit_of(step_id):
            return self._repeated(step_id)
        outcome, update = self.next_update(step_id, group_size, samples, flush=flush)
        self.held = (outcome, update) if update is not None else None
        norm_sq = None if update is None else float(sum(g.double().pow(2).sum() for g in update))
        return self._remember(
            step_id,
            replace(
                outcome, stepped=False, grad_norm_sq=norm_sq if norm_sq is not None and math.isfinite(norm_sq) else None
            ),
        )

    def apply_prepared(self, step_id: str, scale: float) -> AveragingOutcome:
        """Clipping's second phase: apply the update `prepare` holds, times `scale`."""
        if self.prepared is not None:  # an exact step's (`exact_now` when it was prepared)
            outcome = super().apply_prepared(step_id, scale)
            self.runtime.stop_predicting()
            return outcome
        if not self._first_commit_of(step_id):
            return self._repeated(step_id)
        held, self.held = self.held, None
        if held is None:
            self.predict_next_update()
            return self._remember(
                step_id, AveragingOutcome(False, 1, 0, stepped=False, pending=self.in_flight is not None)
            )
        outcome, update = held
        self.runtime.apply_gradients([gradient * scale for gradient in update])
        self.predict_next_update()
        return self._remember(step_id, outcome)

    def exact_now(self) -> bool:
        """Whether this commit takes the exact barrier: the stage has taken fewer than `exact_steps`
        steps and nothing is in flight or held. Every replica of a stage steps on the same rounds,
        so all of them switch to the delay at the same step, and stay there."""
        return self.runtime.steps_done < self.exact_steps and self.in_flight is None and self.held is None

    def predict_next_update(self) -> None:
        """Weight prediction `local-step`: the next step computes on the parameters plus the update
        this replica's own gradients of the round in flight would make (none: no round in flight)."""
        in_flight = self.in_flight
        self.runtime.predict_local_step(None if in_flight is None or not in_flight.samples else in_flight.gradients)

    def next_update(
        self, step_id: str, group_size: int, samples: Mapping[str, int] | None, *, flush: bool
    ) -> tuple[AveragingOutcome, list[torch.Tensor] | None]:
        """The heart of a commit: end the round in flight, then start this step's (none with `flush`).
        Returns the outcome to answer and the update to apply (the previous step's mean gradients;
        None if there is none), which the caller applies, at once or scaled by clipping."""
        gradients, local_samples = self.runtime.take_accumulated()
        outcome, update = self.finish_in_flight()
        if flush:
            self.runtime.add_accumulated(gradients, local_samples)  # none, after the trainer's last commit
            if outcome.stepped or self.runtime.samples_accumulated == 0:
                return outcome, update
            # the last round failed (its gradients are back in the accumulation): average them now, exactly
            outcome = self.average_gradients(group_size, samples, step_id)
            return outcome, (self.averaged_gradients() if outcome.stepped else None)
        self.start_round(gradients, local_samples, group_size, dict(samples) if samples else None, step_id)
        return replace(outcome, pending=True), update

    def start_round(
        self,
        gradients: list[torch.Tensor],
        samples: int,
        group_size: int,
        caps: dict[str, int] | None,
        step_id: str | None = None,
    ) -> None:
        """Average `gradients` with the group in the averager's process; the next commit applies them."""
        if group_size < 2:
            self.in_flight = InFlightRound(None, gradients, samples, caps, alone=True)
            return
        with self.held_buffers() as buffers:
            for buffer, mean in zip(buffers, gradients):
                buffer.copy_(mean)
        self.averager.set_weight_caps(caps)
        control = self.try_begin_round(
            group_size, weight=max(float(samples), MIN_WEIGHT), named=self.named_group(step_id, caps)
        )
        self.in_flight = InFlightRound(control, gradients, samples, caps, alone=False)

    def finish_in_flight(self) -> tuple[AveragingOutcome, list[torch.Tensor] | None]:
        """Wait for the round in flight, if any: its outcome, and the mean gradients to step on (None:
        no step). A failed round's gradients go back into the accumulation. Call on the compute thread."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return AveragingOutcome(False, 1, 0, stepped=False), None
        if in_flight.alone:
            if in_flight.samples == 0:
                return AveragingOutcome(False, 1, 0, stepped=False), None
            return AveragingOutcome(False, 1, in_flight.samples, stepped=True), in_flight.gradients
        gathered = None if in_flight.control is None else self.finish_round(in_flight.control)
        if gathered is None:
            if not self.closing:
                logger.warning(
                    f"stage {self.runtime.stage}: the previous step's averaging round failed; not stepping, "
                    f"its gradients carry over to the next round"
                )
            self.runtime.add_accumulated(in_flight.gradients, in_flight.samples)
            return AveragingOutcome(False, 1, 0, stepped=False), None
        if not round_has_samples(gathered):
            return AveragingOutcome(True, len(gathered), 0, stepped=False), None
        outcome = AveragingOutcome(True, len(gathered), samples_in_round(gathered, in_flight.caps), stepped=True)
        return outcome, self.averaged_gradients()
