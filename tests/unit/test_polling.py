"""The integration tests' wait: it fails at once, naming the process, when what it waits on has exited."""

import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.integration.polling import wait_for


@dataclass
class Process:  # the two things wait_for reads of swarm.local_swarm.ManagedProcess
    name: str
    popen: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


def test_a_wait_on_an_exited_process_fails_at_once_and_names_it():
    exited = Process("trainer", subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
    exited.popen.wait()
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"trainer \(exit 3\) exited while waiting for step 4"):
        wait_for(lambda: False, 60, "step 4", while_running=[exited])
    assert time.monotonic() - started < 5


def test_a_condition_that_held_when_the_process_exited_is_returned():
    exited = Process("trainer", subprocess.Popen([sys.executable, "-c", "pass"]))
    exited.popen.wait()
    answers = iter([None, "step 4"])  # false at the first look, true at the look after the exit
    assert wait_for(lambda: next(answers), 60, "step 4", while_running=[exited]) == "step 4"


def test_without_processes_it_times_out_with_what_it_waited_for():
    with pytest.raises(AssertionError, match=r"timed out after 0.3 s waiting for nothing"):
        wait_for(lambda: False, 0.3, "nothing", poll_s=0.05)
