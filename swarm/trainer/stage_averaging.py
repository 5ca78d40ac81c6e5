"""How each stage's replicas agree, as their records say: the mode, outer rounds' settings, and why
(`--averaging auto` states its reason). One line per stage, for `swarm status` and the trainer's report."""

from __future__ import annotations

from collections.abc import Mapping

from dht.records import PeerRecord, PeerState


def averaging_summary(records: list[PeerRecord]) -> str:
    """How a stage's replicas agree, and why (what `--averaging auto` settled on): one line."""
    parts = []
    for mode in sorted({r.averaging for r in records}):
        of_mode = [r for r in records if r.averaging == mode]
        text = mode
        settings = next((r.outer for r in of_mode if r.outer is not None), None)
        if settings is not None:
            codec = f"topk {settings.topk_fraction:g}" if settings.codec == "topk" else settings.codec
            text += (
                f" (every {settings.every_steps} steps, {codec}"
                + (", overlapped" if settings.overlap else "")
                + (f", {settings.fragments} fragments" if settings.fragments > 1 else "")
                + f", outer lr {settings.outer_lr:g} momentum {settings.outer_momentum:g})"
            )
        reason = next((r.averaging_reason for r in of_mode if r.averaging_reason), "")
        parts.append(f"{text}: {reason}" if reason else text)
    return "; ".join(parts)


def averaging_by_stage(stages: Mapping[int, list[PeerRecord]]) -> dict[str, str]:
    """`averaging_summary` of each stage's online replicas (stages without any are left out)."""
    summaries = {}
    for stage, records in stages.items():
        online = [r for r in records if r.state == PeerState.ONLINE]
        if online:
            summaries[str(stage)] = averaging_summary(online)
    return summaries
