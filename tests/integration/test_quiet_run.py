"""A healthy run says what matters and nothing else: a short local demo whose every process log
holds no traceback and no warning, and one start-up line per process with its peer id instead of
the whole configuration."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from process.lifetime import die_with_parent


@pytest.mark.slow
def test_a_short_demo_logs_no_traceback_and_no_warning(tmp_path):
    workdir = tmp_path / "work"
    args = ["demo", "--model", "tiny", "--peers", "2", "--stages", "2", "--steps", "4", "--tokenizer", "bytes",
            "--batch-size", "8", "--eval-every", "2", "--eval-batches", "1", "--workdir", str(workdir)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("SWARM_LOGLEVEL", "SWARM_VERBOSE")}
    demo = subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
        preexec_fn=die_with_parent(),
    )
    try:
        output, _ = demo.communicate(timeout=300)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, output
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
    assert re.search(r"^trainer Qm\w+ starting: tiny", logs["trainer.log"], re.MULTILINE), logs["trainer.log"]
