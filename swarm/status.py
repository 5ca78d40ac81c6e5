"""`swarm status`: the stages of a model, their peers, state, throughput and load, read from the DHT;
with `--report`, also what each peer did for a trainer, read from that trainer's JSON report.

A trainer publishes nothing on the DHT, and what it counts per peer (samples served, calls failed,
spot checks and their mismatches, bans) is its own view, which no other process could check. So
`swarm status` reads it from where the trainer writes it, its report (`swarm train --report`,
rewritten after every step), on a machine that can read that file; the same counts are on the
trainer's metrics endpoint (`swarm_trainer_peer_*`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from dht.announce import fetch_stage_records_async
from dht.node import NetworkConfig, start_dht
from dht.records import PeerRecord, PeerState
from process.config import option
from swarm.trainer.contributions import ReportedContribution, ReportError, read_reported_contributions
from swarm.trainer.stage_averaging import averaging_summary


@dataclasses.dataclass(kw_only=True)
class StatusConfig(NetworkConfig):
    model: str = option("small", help="model whose stages to show")
    num_stages: int | None = option(None, help="number of stages (default: read from the peers' records)")
    json: bool = option(False, help="print JSON instead of a table")
    report: str = option(
        "", help="a trainer's JSON report (swarm train --report): also show what each peer did for that trainer"
    )


async def collect_status(dht, model: str, num_stages: int | None) -> dict[int, list[PeerRecord]]:
    if num_stages is None:
        first = await fetch_stage_records_async(dht, model, 0)
        num_stages = max((r.num_stages for r in first), default=1)
    results = await asyncio.gather(*[fetch_stage_records_async(dht, model, s) for s in range(num_stages)])
    return dict(enumerate(results))


def format_table(model: str, stages: dict[int, list[PeerRecord]]) -> str:
    if not any(stages.values()):
        return (
            f"model {model}: no peers on the DHT (none online, and none that stopped recently); "
            "check --model and --initial-peers, or start peers with `swarm peer`"
        )
    lines = [f"model {model}: {len(stages)} stage{'s' if len(stages) != 1 else ''}"]
    header = (
        f"{'stage':>5}  {'peer':<14} {'state':<8} {'samples/s':>10} {'load':>5} {'busy':>5} {'steps':>6} {'rounds':>9}  "
        f"{'version':<8} metrics"
    )
    lines.append(header)
    for stage, records in stages.items():
        online = [r for r in records if r.state == PeerState.ONLINE]
        if not records:
            lines.append(f"{stage:>5}  (no peers)")
        for r in records:
            rounds = "-" if r.averaging == "none" else f"{r.averaging_rounds}/{r.averaging_rounds_failed}"
            lines.append(
                f"{stage:>5}  {'…' + r.peer_id[-12:]:<14} {r.state.value:<8} {r.throughput:>10.1f} "
                f"{r.load:>5.0f} {r.utilization:>5.0%} {r.steps_done:>6} {rounds:>9}  {r.version:<8} "
                f"{r.metrics_addr or '-'}"
            )
        lines.append(f"{'':>5}  stage {stage}: {len(online)} online, {sum(r.throughput for r in online):.1f} samples/s")
        if online:
            lines.append(f"{'':>5}  stage {stage}: averaging {averaging_summary(online)}")
    lines.append(f"{'':>5}  busy: the fraction of the last minute the peer's compute was busy")
    lines.append(f"{'':>5}  rounds: averaging rounds with the stage's other replicas, completed/failed")
    lines.extend(independent_replica_warnings(stages))
    lines.extend(failed_round_warnings(stages))
    return "\n".join(lines)


def format_contributions(contributions: dict[str, ReportedContribution]) -> str:
    """One line per peer that served the trainer: its counts, and why it was banned."""
    lines = [
        f"contributions to the trainer (its report): {len(contributions)} peers",
        f"{'stage':>5}  {'peer':<14} {'samples':>8} {'answered':>8} {'failed':>6} {'checked':>7} {'mismatch':>8} "
        f"{'disputes':>8} {'ok samples':>10} {'busy':>5}  banned",
    ]
    for peer_id, c in sorted(contributions.items(), key=lambda item: (item[1].stage, -item[1].samples_served)):
        lines.append(
            f"{c.stage:>5}  {'…' + peer_id[-12:]:<14} {c.samples_served:>8} {c.calls_answered:>8} {c.calls_failed:>6} "
            f"{c.calls_verified:>7} {c.mismatches:>8} {c.disputes:>8} {c.samples_verified:>10} "
            f"{'-' if c.utilization is None else f'{c.utilization:.0%}':>5}  {c.banned or '-'}"
        )
    lines.append(
        f"{'':>5}  checked: spot checks its answer took part in; ok samples: samples of its own calls a check found right"
    )
    return "\n".join(lines)


def independent_replica_warnings(stages: dict[int, list[PeerRecord]]) -> list[str]:
    """One warning per stage whose online replicas do not all average the same way (`--averaging
    none`, or modes that differ): such replicas train separate copies and the stage ends as no one model."""
    warnings = []
    for stage, records in stages.items():
        online = [r for r in records if r.state == PeerState.ONLINE]
        modes = sorted({r.averaging for r in online})
        if len(online) > 1 and ("none" in modes or len(modes) > 1):
            warnings.append(
                f"warning: stage {stage}: {len(online)} replicas that do not average together "
                f"(--averaging {'/'.join(modes)}): they train separate copies; restart them with the default "
                "--averaging sync"
            )
    return warnings


FAILED_ROUNDS_WARNED = 0.1  # a replica whose averaging rounds failed more often than this is named


def failed_round_warnings(stages: dict[int, list[PeerRecord]], *, min_failed: int = 3) -> list[str]:
    """One warning per online replica whose averaging rounds fail often (at least `min_failed`, and
    more than FAILED_ROUNDS_WARNED of them): a failed sync round steps no replica and carries the
    gradients to the next commit, so the step is late, not lost; still, the replica's link or load
    needs a look."""
    warnings = []
    for stage, records in stages.items():
        for r in records:
            tried = r.averaging_rounds + r.averaging_rounds_failed
            if r.state == PeerState.ONLINE and r.averaging_rounds_failed >= min_failed:
                if r.averaging_rounds_failed > FAILED_ROUNDS_WARNED * tried:
                    warnings.append(
                        f"warning: stage {stage}: replica …{r.peer_id[-12:]}: {r.averaging_rounds_failed} of {tried} "
                        f"averaging rounds failed ({r.averaging}; a failed sync round carries its gradients to the "
                        "next commit): check that peer's load and its link to the other replicas"
                    )
    return warnings


def run_status(config: StatusConfig) -> int:
    contributions = None
    if config.report:
        try:
            contributions = read_reported_contributions(config.report)
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    dht = start_dht(config, client_mode=True, models=[config.model])
    try:
        stages = asyncio.run(collect_status(dht, config.model, config.num_stages))
    finally:
        dht.shutdown()
    if config.json:
        shown = {"model": config.model, "stages": {str(s): [r.to_wire() for r in rs] for s, rs in stages.items()}}
        if contributions is not None:
            shown["contributions"] = {peer: c.model_dump() for peer, c in contributions.items()}
        print(json.dumps(shown, indent=2))
    else:
        print(format_table(config.model, stages))
        if contributions is not None:
            print(format_contributions(contributions))
    for warning in [*independent_replica_warnings(stages), *failed_round_warnings(stages)] if config.json else ():
        print(warning, file=sys.stderr)
    return 0
