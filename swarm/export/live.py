"""Stages from a live swarm: every online replica's current state, through the state RPC that a
joining peer uses (peers/replicas/state_transfer.py), with a progress bar over the downloads.

The split comes from the swarm's split records (dht/split_agreement.py). A stage with no online
replica is waited for up to `wait_s`, then refused in one line that names it. While a trainer is
running, stage 0 may step between two downloads: `download_snapshot` takes the snapshot again
(a few times) until every stage's chosen replica is at the same step.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tqdm import tqdm

from dht.announce import fetch_stage_records_async
from dht.records import PeerRecord, PeerState
from dht.split_agreement import fetch_split_records_async, split_in_force
from peers.compute.checkpoint import CheckpointError
from peers.replicas.state_transfer import download_state
from swarm.export.assemble import ExportError, StagePart, agreed_part, choose_replica
from wire.protocol import ProtocolError, StateRequest

logger = logging.getLogger(__name__)
POLL_S = 1.0


async def find_split(dht, model: str, num_stages: int | None, wait_s: float) -> tuple[int, tuple[int, ...] | None]:
    """(num_stages, boundaries or None when no peer states a split), waiting up to `wait_s` for a
    first record of the model."""
    deadline = time.monotonic() + wait_s
    while True:
        claim = split_in_force(await fetch_split_records_async(dht, model))
        if claim is not None:
            if num_stages is not None and claim.num_stages != num_stages:
                raise ExportError(
                    f"the swarm splits {model} into {claim.num_stages} stages, not --num-stages {num_stages}"
                )
            return claim.num_stages, claim.boundaries
        first = await fetch_stage_records_async(dht, model, 0)
        if num_stages is not None or first:
            return num_stages or max(r.num_stages for r in first), None
        if time.monotonic() > deadline:
            raise ExportError(
                f"no peer of model {model} found on the DHT (waited {wait_s:.0f} s); is it the swarm's --model?"
            )
        await asyncio.sleep(POLL_S)


async def online_replicas(dht, model: str, stage: int, num_stages: int, wait_s: float) -> list[PeerRecord]:
    """The stage's online replicas, waiting up to `wait_s` for one; ExportError naming the stage if none comes."""
    started = time.monotonic()
    while True:
        records = [
            r
            for r in await fetch_stage_records_async(dht, model, stage)
            if r.state == PeerState.ONLINE and r.num_stages == num_stages
        ]
        if records:
            return sorted({r.peer_id: r for r in records}.values(), key=lambda r: r.peer_id)
        waited = time.monotonic() - started
        if waited > wait_s:
            raise ExportError(
                f"stage {stage} of {model} has no live replica (waited {waited:.0f} s); start a peer for it "
                f"or export from the peers' checkpoints with --checkpoint-dir"
            )
        await asyncio.sleep(POLL_S)


async def download_parts(
    p2p,
    model: str,
    stage_records: dict[int, list[PeerRecord]],
    num_stages: int,
    *,
    timeout_s: float,
    credential: str | None = None,
) -> dict[int, list[StagePart]]:
    """Every replica's state, by stage; a replica that fails to answer is skipped with a warning
    (a stage none of whose replicas answered is refused)."""
    parts: dict[int, list[StagePart]] = {}
    total = sum(len(rs) for rs in stage_records.values())
    with tqdm(total=total, desc="downloading stages", unit="replica", leave=False, disable=None) as bar:
        for stage, records in sorted(stage_records.items()):
            request = StateRequest(model=model, stage=stage, num_stages=num_stages, credential=credential)
            errors = []
            for record in records:
                source = f"replica …{record.peer_id[-8:]}"
                bar.set_postfix_str(f"stage {stage}, {source}")
                try:
                    meta, module_state, optimizer_state = await download_state(
                        p2p, record.peer_id, request, timeout_s=timeout_s
                    )
                    if (meta.model, meta.stage, meta.num_stages) != (model, stage, num_stages):
                        raise ProtocolError(f"it sent {meta.model} stage {meta.stage}/{meta.num_stages}")
                    module_state, source = agreed_part(module_state, optimizer_state, source)
                    parts.setdefault(stage, []).append(
                        StagePart(stage, num_stages, meta.steps_done, module_state, source)
                    )
                except (TimeoutError, CheckpointError, ProtocolError, OSError) as e:
                    errors.append(f"{source}: {type(e).__name__}: {e}")
                    logger.warning(f"could not download stage {stage} from {source}: {e}")
                except Exception as e:  # a replica may vanish mid-transfer in many ways
                    errors.append(f"{source}: {type(e).__name__}: {e}")
                bar.update(1)
            if stage not in parts:
                raise ExportError(f"no replica of stage {stage} sent its state ({'; '.join(errors)})")
    return parts


async def download_snapshot(
    dht,
    model: str,
    num_stages: int,
    *,
    wait_s: float,
    timeout_s: float,
    attempts: int = 3,
    say=print,
    credential: str | None = None,
) -> dict[int, list[StagePart]]:
    """Every stage's replicas, downloaded until the most-trained replica of every stage is at one step.
    `credential`: ours, in a run with an authority (its peers send state only to credential holders)."""
    p2p = await dht.replicate_p2p()
    for attempt in range(1, attempts + 1):
        stage_records = {s: await online_replicas(dht, model, s, num_stages, wait_s) for s in range(num_stages)}
        counts = ", ".join(f"stage {s}: {len(rs)}" for s, rs in stage_records.items())
        say(f"[export] live replicas: {counts}")
        parts = await download_parts(p2p, model, stage_records, num_stages, timeout_s=timeout_s, credential=credential)
        steps = {s: choose_replica(ps).part.steps_done for s, ps in parts.items()}
        if len(set(steps.values())) == 1 or attempt == attempts:
            return parts
        say(f"[export] the stages were at different steps ({steps}): training is running; taking the snapshot again")
        await asyncio.sleep(2.0)
    raise AssertionError("unreachable")
