"""The trainer's progress display: a bar on a terminal, the same plain lines as before elsewhere."""

from __future__ import annotations

import io
import re

from swarm.trainer.progress import CLEAR_LINE, StepProgress, TrainingProgress, format_bar, format_duration, format_line


def progress(step: int, total: int = 10, **kw) -> StepProgress:
    values = dict(loss=3.25, tokens_per_s=1234.4, live_replicas=[2, 1], calls_retried=3, elapsed_s=2.0 * step)
    values.update(kw)
    return StepProgress(step=step, total_steps=total, **values)


def test_the_plain_line_keeps_its_format():
    assert format_line(progress(7)) == "step    7/10  loss 3.2500  1,234 tok/s  replicas [2, 1]  retried 3"
    assert re.findall(r"step\s+(\d+)/", format_line(progress(7))) == ["7"]  # what tests and scripts parse


def test_the_last_validation_loss_is_shown_once_measured():
    assert format_line(progress(7, eval_loss=2.5)).endswith("retried 3  val 2.5000")
    assert "loss 3.2500  val 2.5000  1,234 tok/s" in format_bar(progress(7, eval_loss=2.5))
    assert "val" not in format_line(progress(7)) + format_bar(progress(7))


def test_the_bar_shows_progress_loss_speed_peers_and_eta():
    bar = format_bar(progress(5), width=10)
    assert bar.startswith("[#####.....]  50% step 5/10  loss 3.2500  1,234 tok/s  peers 3 [2, 1]  retried 3")
    assert bar.endswith("eta 0m10s")  # 5 steps left at 2 s each
    assert format_bar(progress(10), width=10).startswith("[##########] 100%")
    assert format_duration(3725) == "1h02m" and format_duration(59.6) == "1m00s"


def test_not_a_terminal_prints_every_log_every_steps_and_the_last():
    lines = []
    shown = TrainingProgress(10, log_every=4, interactive=False, say=lines.append)
    for step in range(1, 11):
        shown.update(progress(step))
    shown.close()
    assert [re.match(r"step\s+(\d+)/", line).group(1) for line in lines] == ["4", "8", "10"]


def test_on_a_terminal_the_bar_is_redrawn_and_messages_print_above_it():
    stream, lines = io.StringIO(), []
    shown = TrainingProgress(10, stream=stream, interactive=True, say=lines.append)
    shown.say("before the first step")
    assert stream.getvalue() == ""  # no bar yet, nothing to clear
    shown.update(progress(1))
    shown.update(progress(2))
    shown.say("waiting for a live replica of stage 1")
    shown.close()
    out = stream.getvalue()
    assert lines == ["before the first step", "waiting for a live replica of stage 1"]
    assert out.count(CLEAR_LINE) == 4  # two draws, one clear for the message, one redraw after it
    assert out.endswith("\n") and "step 2/10" in out.rsplit(CLEAR_LINE, 1)[1]
