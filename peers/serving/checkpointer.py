"""Saving the served stage to `--checkpoint-dir`: every `--checkpoint-period-s`, before a move, and on exit.

A save runs on the compute thread, so it never sees a half-applied optimizer step; the file is
written atomically (peers/compute/checkpoint.py), and a failed save keeps the previous file and the
peer serving. The launcher restores from the same path (peers/compute/stage_builder.py).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from peers.compute.checkpoint import checkpoint_path
from peers.config import CheckpointSettings
from peers.metrics import PeerMetrics
from peers.serving.serving_state import ServingState

logger = logging.getLogger(__name__)


class Checkpointer:
    def __init__(
        self,
        serving: ServingState,
        compute: Executor,
        settings: CheckpointSettings,
        *,
        model: str,
        split_tag: str | None,
        metrics: PeerMetrics,
    ):
        if not settings.checkpoint_dir:
            raise ValueError("a Checkpointer needs a checkpoint_dir")
        self.serving, self.compute, self.settings = serving, compute, settings
        self.model, self.split_tag, self.metrics = model, split_tag, metrics

    def path(self) -> str:
        runtime = self.serving.runtime
        return checkpoint_path(
            self.settings.checkpoint_dir, self.model, runtime.stage, runtime.num_stages, self.split_tag
        )

    def save(self) -> None:
        """Call it on the compute thread."""
        try:
            self.serving.runtime.save(self.path(), self.model)
            self.metrics.checkpoint_saves.labels(result="ok").inc()
        except OSError as e:  # a full disk must not kill the peer; the previous checkpoint stays intact
            self.metrics.checkpoint_saves.labels(result="error").inc()
            logger.error(f"Could not save the checkpoint {self.path()!r}: {e}")

    async def save_now(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.compute, self.save)

    async def run(self, stop: asyncio.Event) -> None:
        """Save every `checkpoint_period_s` until `stop` (the final save is the host's, after serving ends)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.settings.checkpoint_period_s)
            except TimeoutError:
                await self.save_now()
