"""The learning rate at each optimizer step: a linear warmup, then a constant rate or a decay
(cosine or linear) to a floor. Pure: a function of the step count only.

Every replica of every stage applies it at its own `steps_done`, which is the run's step: all
stages step on each of the trainer's commits, and a joining or catching-up replica takes the step
count with the state it loads, so the whole pipeline moves along one schedule. A peer restarted
from its checkpoint resumes the schedule where it was.

    rate(step) = lr * (step + 1) / warmup_steps                         while step < warmup_steps
               = lr * (floor + (1 - floor) * shape(progress))           after it, progress in [0, 1]
    shape: constant 1, linear 1 - p, cosine (1 + cos(pi p)) / 2;  progress = (step - warmup) / decay_steps
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LearningRateSchedule:
    lr: float
    warmup_steps: int = 0
    decay: str = "constant"
    decay_steps: int = 0  # steps after warmup over which the rate falls to lr * floor; 0 with "constant"
    floor: float = 0.1  # the final rate, as a fraction of lr

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"lr decay {self.decay!r} is not one of {', '.join(DECAYS)}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup and decay steps must be 0 or more")
        if self.decay != "constant" and self.decay_steps == 0:
            raise ValueError(f"a {self.decay} decay needs the number of steps it lasts (lr_decay_steps)")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError("the learning-rate floor must lie in [0, 1]")

    def rate(self, step: int) -> float:
        """The learning rate of the optimizer step taken when `step` steps are done."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        progress = min((step - self.warmup_steps) / self.decay_steps, 1.0)
        shape = 1.0 - progress if self.decay == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
        return self.lr * (self.floor + (1.0 - self.floor) * shape)


@dataclass(frozen=True)
class ScheduleHistory:
    """The learning rate of a run across the versions of its spec: `base` from step 0, then each
    change from its step on (changes sorted by step; rate(step) is the latest change's rate at that
    step, so a change that takes over mid-warmup continues at the step count, not from its start)."""

    base: LearningRateSchedule
    changes: tuple[tuple[int, LearningRateSchedule], ...] = ()

    def __post_init__(self) -> None:
        steps = [step for step, _ in self.changes]
        if steps != sorted(set(steps)):
            raise ValueError(f"schedule changes must take effect at increasing steps, got {steps}")

    def schedule_at(self, step: int) -> LearningRateSchedule:
        for from_step, schedule in reversed(self.changes):
            if step >= from_step:
                return schedule
        return self.base

    def in_force_from(self, step: int) -> int:
        """The step from which the schedule in force at `step` applies (0: the base)."""
        return next((from_step for from_step, _ in reversed(self.changes) if step >= from_step), 0)

    def rate(self, step: int) -> float:
        return self.schedule_at(step).rate(step)


__all__ = ["DECAYS", "LearningRateSchedule", "ScheduleHistory"]
