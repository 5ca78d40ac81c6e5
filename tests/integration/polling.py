"""Waiting on real processes: poll a condition until it holds or a deadline passes.

Integration tests watch processes that run on their own clock (peers announcing, a trainer
stepping), so they poll instead of sleeping a fixed time: a fast machine finishes early, a loaded one
gets the whole deadline, and a miss fails with what was awaited.
"""

from __future__ import annotations

import re
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2, *, while_running=()):
    """Return condition()'s first truthy value; fail the test after timeout_s seconds, or as soon as
    a process of `while_running` (what the condition needs alive) has exited without it holding."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        gone = [process for process in while_running if not process.alive]
        if gone:
            value = condition()  # it may have exited right after the condition came to hold
            if value:
                return value
            exits = ", ".join(f"{process.name} (exit {process.popen.returncode})" for process in gone)
            raise AssertionError(f"{exits} exited while waiting for {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def trainer_step(trainer) -> int:
    """The last step a `swarm train` process printed (0 before its first)."""
    steps = re.findall(r"step\s+(\d+)/", trainer.log())
    return int(steps[-1]) if steps else 0


def scrape(process) -> dict[tuple[str, tuple], float]:
    """A process's /metrics (the address its log names) as {(name, sorted label pairs): value}."""
    match = re.search(r"metrics on (http://\S+/metrics)", process.log())
    assert match, process.log()[-2000:]
    with urllib.request.urlopen(match.group(1), timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
