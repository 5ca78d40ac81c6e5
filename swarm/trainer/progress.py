"""The trainer's progress on its terminal: a bar redrawn in place when stdout is a terminal, plain
lines (every `log_every` steps, the format scripts and tests read) when it is not."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

CLEAR_LINE = "\r\x1b[K"


def _loss(loss: float | None) -> str:
    return "     -" if loss is None else f"{loss:.4f}"


@dataclass(frozen=True)
class StepProgress:
    step: int  # steps completed
    total_steps: int
    loss: float | None  # None: the other trainers finished this global step before ours sent anything
    tokens_per_s: float  # average since training started
    live_replicas: Sequence[int]  # per stage
    calls_retried: int
    elapsed_s: float
    eval_loss: float | None = None  # the last validation loss measured (--eval-every), if any


def format_line(p: StepProgress) -> str:
    """The plain progress line (unchanged from before the bar existed: tests parse `step N/`)."""
    return (
        f"step {p.step:>4}/{p.total_steps}  loss {_loss(p.loss)}  {p.tokens_per_s:,.0f} tok/s  "
        f"replicas {list(p.live_replicas)}  retried {p.calls_retried}"
        + (f"  val {p.eval_loss:.4f}" if p.eval_loss is not None else "")
    )


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def format_bar(p: StepProgress, width: int = 24) -> str:
    """`[#######.........]  30% step 30/100  loss 3.2100  1,234 tok/s  peers 4 [2, 2]  retried 0  eta 1m05s`"""
    fraction = min(1.0, p.step / p.total_steps) if p.total_steps else 1.0
    filled = int(fraction * width)
    eta_s = p.elapsed_s / p.step * (p.total_steps - p.step) if p.step else 0.0
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {fraction:>4.0%} step {p.step}/{p.total_steps}  "
        f"loss {_loss(p.loss)}  {'' if p.eval_loss is None else f'val {p.eval_loss:.4f}  '}{p.tokens_per_s:,.0f} tok/s  peers {sum(p.live_replicas)} {list(p.live_replicas)}  "
        f"retried {p.calls_retried}  eta {format_duration(eta_s)}"
    )


class TrainingProgress:
    """Shows each step. On a terminal the bar stays on the last line and other messages (`say`)
    print above it; elsewhere every `log_every`-th step (and the last) prints one plain line."""

    def __init__(
        self,
        total_steps: int,
        *,
        log_every: int = 1,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        say: Callable[[str], None] = print,
    ):
        self.total_steps, self.log_every = total_steps, log_every
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self._say = say
        self._bar: str | None = None

    def say(self, message: str) -> None:
        if self.interactive and self._bar is not None:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
        self._say(message)
        if self.interactive and self._bar is not None:
            self._draw()

    def update(self, progress: StepProgress) -> None:
        if self.interactive:
            self._bar = format_bar(progress)
            self._draw()
        elif progress.step % self.log_every == 0 or progress.step == progress.total_steps:
            self._say(format_line(progress))

    def close(self) -> None:
        """End the bar's line so what follows starts on a fresh one."""
        if self.interactive and self._bar is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._bar = None

    def _draw(self) -> None:
        columns = shutil.get_terminal_size(fallback=(160, 24)).columns
        self.stream.write(CLEAR_LINE + self._bar[: max(columns - 1, 20)])  # a wrapped line could not be redrawn
        self.stream.flush()
