"""The run's spec while a peer serves: announced under the runs key, and followed to new versions.

The peer re-announces the signed spec it serves (dht/run_specs.py) every half of its lifetime, so
the spec outlives its owner's publication, and reads the run's announcements every
`SPEC_REFRESH_S` for a later version signed by the same key. A later version changes only the
learning-rate schedule from a stated step (peers/run_spec.py); one that changes anything else is
ignored with a warning. The trainer's commit names the version its step follows, and a replica
steps on that version's schedule (`ensure` fetches it first when it is new here), so the replicas of
one step agree however late each learned of it; a replica that steps on its own follows the latest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import hivemind

from dht.run_specs import SPEC_TTL_S, SignedSpec, SpecError, announce_spec_async, fetch_runs_async
from peers.compute.lr_schedule import ScheduleHistory
from peers.run_spec import RunSpec, parse_spec

logger = logging.getLogger(__name__)

SPEC_REFRESH_S = 30.0  # how often a serving peer looks for a new version of its run's spec


class RunFollower:
    def __init__(
        self,
        dht: hivemind.DHT,
        signed: SignedSpec,
        spec: RunSpec,
        *,
        on_version: Callable[[RunSpec], None] | None = None,
        steps_done: Callable[[], int] = lambda: 0,
        refresh_s: float = SPEC_REFRESH_S,
    ):
        self.dht, self.signed, self.spec = dht, signed, spec
        self.on_version, self.steps_done, self.refresh_s = on_version, steps_done, refresh_s
        self._ignored: set[str] = set()  # digests of versions refused once (warned once)
        self._lock = asyncio.Lock()

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def version(self) -> int:
        return self.spec.version

    def schedule(self, version: int | None = None) -> ScheduleHistory:
        """The learning rates of the run as of `version` (None or 0: the latest this peer knows)."""
        return self.spec.schedule(version or None)

    async def announce(self) -> bool:
        return await announce_spec_async(self.dht, self.signed, ttl_s=SPEC_TTL_S)

    async def refresh(self) -> bool:
        """Look for a later version of this run; True when one was adopted."""
        async with self._lock:
            known = self.version
            for run in await fetch_runs_async(self.dht) or ():
                if run.identity != (self.spec.run_id, self.signed.signer_key) or run.header.version <= self.version:
                    continue
                if run.spec.digest in self._ignored:
                    continue
                self._adopt(run.spec)
            return self.version > known

    def _adopt(self, signed: SignedSpec) -> None:
        try:
            spec = parse_spec(signed)
        except SpecError as e:
            self._ignored.add(signed.digest)
            logger.warning(f"Ignoring a later version of run {self.run_id}: {e}")
            return
        if not spec.follows(self.spec):
            self._ignored.add(signed.digest)
            logger.warning(
                f"Ignoring version {spec.version} of run {self.run_id}: a later version may change only the "
                "learning-rate schedule from a step on (and keep the earlier versions' changes)"
            )
            return
        steps = self.steps_done()
        for change in spec.changes[len(self.spec.changes) :]:
            late = (
                f" (this stage is at step {steps} already: it applies from there)" if change.from_step < steps else ""
            )
            print(f"run {self.run_id} version {change.version}: {change.describe()}{late}", flush=True)
        self.spec, self.signed = spec, signed
        if self.on_version is not None:
            self.on_version(spec)
        asyncio.get_running_loop().create_task(self.announce())  # the new version lives on with this peer

    async def ensure(self, version: int, timeout_s: float = 10.0) -> bool:
        """Whether this peer knows `version` of the spec (looked for on the DHT when it does not yet)."""
        if version <= self.version:
            return True
        try:
            await asyncio.wait_for(self.refresh(), timeout=timeout_s)
        except TimeoutError:
            pass
        return version <= self.version

    async def run(self, stop: asyncio.Event) -> None:
        """Announce the spec every half of its lifetime and look for new versions every `refresh_s`."""
        announced_at = time.monotonic()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.refresh_s)
                return
            except TimeoutError:
                pass
            await self.refresh()
            if time.monotonic() - announced_at >= SPEC_TTL_S / 2:
                await self.announce()
                announced_at = time.monotonic()
