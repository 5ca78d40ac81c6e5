"""A healthy run says what matters and nothing else: a short local demo whose every process log
holds no traceback and no warning, and one start-up line per process with its peer id instead of
the whole configuration."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from process.lifetime import die_with_parent
from tests.integration.polling import wait_for


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["completed", "ctrl-c"])
def test_a_short_demo_logs_no_traceback_and_no_warning(tmp_path, ending):
    """Run to the end, or Ctrl-C (SIGINT to the demo's whole process group, as a terminal sends it)
    after a few steps."""
    workdir = tmp_path / "work"
    steps = "4" if ending == "completed" else "100000"
    args = ["demo", "--model", "tiny", "--peers", "2", "--stages", "2", "--steps", steps, "--tokenizer", "bytes",
            "--batch-size", "8", "--eval-every", "2", "--eval-batches", "1", "--workdir", str(workdir)]  # fmt: skip
    log_path = tmp_path / "demo.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below, once the demo is done)
    env = {k: v for k, v in os.environ.items() if k not in ("SWARM_LOGLEVEL", "SWARM_VERBOSE")}
    demo = subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    try:
        if ending == "ctrl-c":
            wait_for(lambda: "step    3/" in log_path.read_text() or demo.poll() is not None, 180, "step 3")
            os.killpg(demo.pid, signal.SIGINT)
        demo.wait(timeout=300)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    log.close()
    output = log_path.read_text()
    assert demo.returncode == (0 if ending == "completed" else 130), output
    assert "all processes stopped" in output
    logs = {"demo": output} | {path.name: path.read_text() for path in Path(workdir).glob("*.log")}
    assert {"bootstrap.log", "trainer.log"} <= set(logs) and sum(name.startswith("peer-") for name in logs) == 2
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text}"
        noisy = [line for line in text.splitlines() if re.search(r"warn|error", line, re.IGNORECASE)]
        assert not noisy, f"{name}: {noisy}"
        assert "Config:" not in text, f"{name} printed its whole configuration:\n{text}"
    for name, text in logs.items():
        if name.startswith("peer-"):
            assert re.search(r"^peer Qm\w+ starting: tiny, stage \d of 2", text, re.MULTILINE), text
    assert re.search(r"^trainer Qm\w+ starting: \d+ steps", logs["trainer.log"], re.MULTILINE), logs["trainer.log"]


@pytest.mark.parametrize("level, shown", [(None, False), ("INFO", True)])
def test_a_library_line_a_user_cannot_act_on_is_shown_only_when_asked_for(level, shown):
    """asyncio's "socket.send() raised exception." (a caller that went away mid-answer) once ended a
    healthy demo's peer log; other asyncio warnings still show."""
    script = (
        "import logging; from swarm.cli import _configure_logging; _configure_logging(); "
        "log = logging.getLogger('asyncio'); log.warning('socket.send() raised exception.'); log.warning('other')"
    )
    env = {k: v for k, v in os.environ.items() if k != "SWARM_LOGLEVEL"} | ({"SWARM_LOGLEVEL": level} if level else {})
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ("socket.send() raised exception." in result.stderr) == shown and "other" in result.stderr


CANCELLED_HANDLER = """
import asyncio
from swarm.cli import _configure_logging

_configure_logging()


async def main():
    async def handler(reader, writer):
        await reader.readexactly(1)  # a stream that arrives as the process stops

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    connection = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    await asyncio.sleep(0.2)  # asyncio.run then cancels the handler, the connection still open
    return connection


asyncio.run(main())
"""


@pytest.mark.parametrize("level, shown", [(None, False), ("INFO", True)])
def test_a_connection_handler_cancelled_at_shutdown_prints_no_traceback(level, shown):
    """Python 3.11 logs a traceback when a connection handler task is cancelled (its done-callback
    calls `task.exception()`); hivemind serves each incoming p2pd stream that way, so a peer that
    stopped cleanly while a stream arrived ended its log with one (CI, session 33)."""
    env = {k: v for k, v in os.environ.items() if k != "SWARM_LOGLEVEL"} | ({"SWARM_LOGLEVEL": level} if level else {})
    result = subprocess.run(
        [sys.executable, "-c", CANCELLED_HANDLER], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert ("CancelledError" in result.stderr) == shown and ("Traceback" in result.stderr) == shown, result.stderr
