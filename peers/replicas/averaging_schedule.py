"""When `periodic` parameter averaging meets: every K local steps, or every T seconds of DHT time.

Pure: no clock, no network. The peer's loop (time) or its commit handler (steps) asks it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AveragingSchedule:
    """Exactly one of the two drives the rounds.

    * `every_steps` = K: a round right after every K-th local step (the replica's step count, which
      state transfer copies to a joiner). Replicas that step on the trainer's commit take their
      steps together, so they reach a multiple of K at the same commit.
    * `period_s` = T: a round at every multiple of T in DHT time, so replicas meet without talking.
    """

    period_s: float | None = None
    every_steps: int | None = None

    def __post_init__(self) -> None:
        if (self.period_s is None) == (self.every_steps is None):
            raise ValueError("an averaging schedule needs exactly one of period_s and every_steps")
        if self.period_s is not None and not self.period_s > 0:
            raise ValueError(f"period_s must be positive, got {self.period_s}")
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, got {self.every_steps}")

    @property
    def by_steps(self) -> bool:
        return self.every_steps is not None

    def due_after_step(self, steps_done: int) -> bool:
        """Whether a round follows the local step that brought the count to `steps_done`."""
        if self.every_steps is None:
            return False
        return steps_done > 0 and steps_done % self.every_steps == 0

    def next_round_time(self, now: float) -> float:
        """The first multiple of the period after `now` (DHT time): every replica picks the same moment."""
        if self.period_s is None:
            raise ValueError("this schedule counts steps, not seconds")
        return (int(now // self.period_s) + 1) * self.period_s

    def describe(self) -> str:
        if self.every_steps is not None:
            return f"every {self.every_steps} local step{'s' if self.every_steps > 1 else ''}"
        return f"every {self.period_s:g} s"
