"""`--averaging auto`: a replica's averaging, settled as it builds its stage (at start, and after a
move) and then kept.

- A stage whose online replicas average already (sync or outer) keeps its mode: the new replica
  takes theirs, outer rounds with the settings their records carry, so that their rounds meet.
- The first replica of a stage measures its link to others (the link probe's echoes, to up to
  two online peers of the model, the stage's first) and lets averaging_choice.py choose from the
  slowest: exact sync on fast links, outer rounds on slow ones. The link to a partner that comes
  later is not known yet; the links to the swarm's other peers stand for it.
- Nobody to measure (the swarm's first peers start together): exact sync.
The reason goes into the peer's record (`PeerRecord.averaging_reason`), which `swarm status` and
the trainer's report show.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

from hivemind.p2p import P2P

from dht.announce import fetch_stage_records
from dht.records import OuterRoundsRecord, PeerRecord, PeerState
from peers.placement.link_probe import ProbeSettings, measure_link
from peers.replicas.averaging_choice import choose_averaging
from wire.compression import LinkEstimate

logger = logging.getLogger(__name__)

PROBED_PEERS = 2
# short: sync needs a link that carries a stage's gradient in a tenth of a step, which one echo of up
# to 1 MiB tells apart from a home link without measuring it closely
STARTUP_PROBE = ProbeSettings(
    timeout_s=10.0, tiny_repeats=2, bulk_start_bytes=64 << 10, bulk_max_bytes=1 << 20, bulk_target_s=0.1
)


def adopted(records: list[PeerRecord]) -> tuple[str, OuterRoundsRecord | None] | None:
    """The mode (and outer settings) most of a stage's averaging replicas run, or None."""
    modes = Counter(r.averaging for r in records if r.averaging in ("sync", "outer"))
    if not modes:
        return None
    mode = modes.most_common(1)[0][0]
    settings = Counter(r.outer for r in records if r.averaging == "outer" and r.outer is not None)
    return mode, (settings.most_common(1)[0][0] if settings else None)


def with_outer(replicas, settings: OuterRoundsRecord):
    return dataclasses.replace(
        replicas,
        averaging="outer",
        averaging_period_s=None,
        averaging_every_steps=settings.every_steps,
        outer_fragments=settings.fragments,
        outer_overlap=settings.overlap,
        outer_codec=settings.codec,
        outer_topk_fraction=settings.topk_fraction,
        outer_lr=settings.outer_lr,
        outer_momentum=settings.outer_momentum,
    )


def outer_record(replicas) -> OuterRoundsRecord:
    """The outer settings of a replica's config, as its record states them."""
    schedule, step, codec = replicas.outer_schedule, replicas.outer_step_settings, replicas.outer_codec_settings
    return OuterRoundsRecord(
        every_steps=schedule.every_steps,
        fragments=schedule.fragments,
        overlap=schedule.overlap,
        codec=codec.codec,
        topk_fraction=codec.topk_fraction,
        outer_lr=step.lr,
        outer_momentum=step.momentum,
    )


async def _daemon_maddr(_dht, node):
    return node.p2p.daemon_listen_maddr


async def slowest_link(dht, peers: list[str]) -> LinkEstimate | None:
    """The slowest of the links to `peers` (the first PROBED_PEERS), on a p2pd client of this probe's
    own: hivemind's `replicate_p2p` keeps the first client it makes for the whole process, and one made
    in this short-lived event loop would be dead in the peer's (the peer then never came online)."""
    p2p = await P2P.replicate(dht.run_coroutine(_daemon_maddr))
    measured = []
    try:
        for peer in peers[:PROBED_PEERS]:
            try:
                measured.append(await measure_link(p2p, peer, STARTUP_PROBE))
            except Exception as e:  # noqa: BLE001 - a peer that does not answer a probe is not measured
                logger.info(f"--averaging auto: probing {peer[-8:]} failed: {type(e).__name__}: {e}")
    finally:
        await p2p.shutdown()
    if not measured:
        return None
    slowest = min(measured, key=lambda m: m.bandwidth_gbps)
    return LinkEstimate(bandwidth_bytes_per_s=slowest.bandwidth_gbps * 1e9 / 8, latency_s=slowest.rtt_ms / 2e3)


def resolve_auto(
    replicas, *, dht, model: str, stage: int, num_stages: int, peer_id: str, num_values: int, step_s: float
):
    """(the replica settings to build with, why): `replicas` with `averaging` settled."""
    online = [
        r
        for s in range(num_stages)
        for r in fetch_stage_records(dht, model, s)
        if r.state == PeerState.ONLINE and r.peer_id != peer_id and r.num_stages == num_stages
    ]
    same_stage = [r for r in online if r.stage == stage]
    taken = adopted(same_stage)
    if taken is not None:
        mode, settings = taken
        why = f"the stage's replicas run {mode}"
        if mode == "outer":
            return (
                (with_outer(replicas, settings), why)
                if settings
                else (dataclasses.replace(replicas, averaging="outer"), why)
            )
        return dataclasses.replace(replicas, averaging="sync", averaging_every_steps=None), why
    peers = [r.peer_id for r in same_stage] + [r.peer_id for r in online if r.stage != stage]
    link = asyncio.run(slowest_link(dht, list(dict.fromkeys(peers)))) if peers else None
    choice = choose_averaging(
        num_values=num_values, group_size=2, step_s=step_s, link=link, loss_budget=replicas.averaging_loss_budget
    )
    if choice.mode == "sync":
        return dataclasses.replace(replicas, averaging="sync", averaging_every_steps=None), choice.reason
    option = choice.option
    settings = OuterRoundsRecord(
        every_steps=option.every_steps,
        fragments=option.fragments,
        overlap=option.overlap,
        codec=option.codec,
        topk_fraction=option.topk_fraction,
        outer_lr=option.outer_lr,
        outer_momentum=option.outer_momentum,
    )
    return with_outer(replicas, settings), choice.reason
