"""Discrete-event simulation of stage rebalancing under churn, at internet scale.

Run from the repository root:  python -m benchmarks.simulate --seed 0 --out benchmarks/out/simulate.json

Model (every number below is a flag or a ``SimulationConfig`` field):

- **Peers.** ``--peers`` peers at t=0, placed one by one with ``choose_initial_stage`` (as if the
  swarm had grown slowly before the measurement starts). Every peer belongs to one of
  ``pools`` hardware/cloud pools. Throughput (samples/s) is lognormal: a pool median
  ``exp(N(0, pool_sigma))`` times a per-peer factor ``exp(N(0, peer_sigma))``.
- **Independent churn.** Lifetimes ~ Exponential(mean ``mean_lifetime_s``); arrivals are
  Poisson with rate ``join_scale * peers / mean_lifetime_s``, so with ``join_scale=1`` the
  population hovers around ``--peers``; ``join_scale=0`` is a shrinking swarm that only the
  restored preempted pools replenish.
- **Correlated preemption** (what spot/preemptible pools do): Poisson events at
  ``preemptions_per_hour``; each picks a pool and kills each of its live peers with probability
  ``preempt_fraction``. The pool comes back after Exponential(mean ``restore_mean_s``): as many
  peers as were killed arrive within ``burst_spread_s`` (the same pool, new lifetimes).
- **What peers see.** Decisions read a view of the announcements rebuilt every
  ``view_period_s`` (how often a peer re-reads the DHT), so peers arriving in a burst see the
  same stale view. A peer that leaves on its own announces ``offline`` (gone from the next
  view); a preempted peer cannot, so its last record stays in views for ``record_ttl_s`` (it
  still looks online and may even be "planned" to move). A peer's own record is always current
  in its own view.
- **Joining and moving cost.** A peer that joins or moves is ``joining`` for ``transfer_s``
  (downloading the stage's parameters and optimizer state) and contributes nothing meanwhile;
  its old stage loses it at once.
- **Standby peers (backup pool; off by default).** A fraction ``standby_fraction`` of the peers
  (at t=0 and of every arrival; drawn with its own seeded RNG, so the churn trace is unchanged)
  start like the peer's ``--standby`` mode (peers/placement/stage_moves.py ``StageMoves.stand_by``): every
  ``standby_check_s`` they call ``choose_standby_target`` and ``should_standby_take_over``
  (``standby_take_over_fraction``) on the view, without standby records (peers/placement/stage_choice.py
  leaves them out). A standby serves nothing; it downloads the held stage's state (``transfer_s``)
  when it first holds a stage, when the thinnest stage changes, and again ``standby_refresh_s``
  after its last download, while that stage has an online replica. Taking over: **as the peer
  does now**, when the stage still has an online replica, it first downloads that replica's latest
  state (``transfer_s``, still a standby meanwhile, so other standbys see nothing change), then
  serves; with no online replica left it serves at once from its copy. With
  ``standby_instant_take_over`` (a *hypothetical* peer, not what peers/placement/stage_moves.py does) it
  serves at once from any copy it holds. A standby that took over is an ordinary online peer from
  then on (it rebalances under ``rebalance``). Standbys are live hardware, so the optimum counts
  them.
- **Policies.** (1) ``static``: peers stay where ``choose_initial_stage`` put them.
  (2) ``rebalance``: each online peer calls ``decide_move`` (the function the peer server uses)
  after ``next_check_delay_s(check_period_s)`` and moves if told to; with ``check_on_loss`` (the
  default, as in the peer) every online peer also checks ``loss_check_delay_s`` after a view in
  which ``stages_that_lost_replicas`` finds a stage that lost a replica. Peers deciding on the
  same view share one ``plan_rebalance`` (``decision_in_plan``: the same answer as ``decide_move``). (3) ``optimum``: at each
  sample time, ``optimal_bottleneck`` over the throughputs of every live peer past its first
  join download (the assignment an oracle could use, with no move cost). For ~1,000 peers that
  is the upper bound ``min_k (sum - k largest)/(S - k)``, so shares are lower bounds; the LPT
  lower bound is reported too, to show the bound is tight.
- **Measure.** Every ``sample_period_s`` the pipeline's real throughput is the min over stages
  of the sum of *online* throughputs. Share of optimal = sum(throughput) / sum(optimum) over
  samples (the fraction of the optimum's samples actually processed).

The churn trace depends only on ``--seed`` and is shared by all policies (paired comparison);
check timing uses its own seeded RNG. Same flags, same JSON.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

from benchmarks.report_file import write_report  # noqa: E402
from peers.placement.rebalance import (  # noqa: E402
    RETURN_PERIODS,
    SETTLE_PERIODS,
    RebalancePlan,
    ReplicaView,
    choose_initial_stage,
    choose_standby_target,
    decide_move,
    decision_in_plan,
    loss_check_delay_s,
    next_check_delay_s,
    optimal_bottleneck,
    peers_settling,
    plan_rebalance,
    settle_share,
    should_standby_take_over,
    stages_that_lost_replicas,
)
from peers.placement.stage_assignment import greedy_bottleneck  # noqa: E402

POLICIES = ("static", "rebalance")


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    seed: int = 0
    peers: int = 1000
    """Population at t=0 and the steady-state target."""
    stages: int = 8
    duration_s: float = 4 * 3600.0
    pools: int = 6
    pool_sigma: float = 0.5
    """Spread of pool median throughputs, log-space standard deviation."""
    peer_sigma: float = 0.3
    """Spread of peers' throughputs within a pool, log-space standard deviation."""
    mean_lifetime_s: float = 2 * 3600.0
    join_scale: float = 1.0
    """Independent arrival rate as a fraction of the steady-state rate (0: shrinking swarm)."""
    preemptions_per_hour: float = 1.0
    preempt_fraction: float = 0.5
    restore_mean_s: float = 900.0
    burst_spread_s: float = 60.0
    view_period_s: float = 5.0
    record_ttl_s: float = 60.0
    """How long a preempted (silently dead) peer's record stays visible."""
    transfer_s: float = 120.0
    check_period_s: float = 300.0
    """Mean interval between a peer's rebalancing checks (SWARM's paper: 300 s)."""
    check_on_loss: bool = True
    """Also check within ``loss_check_max_delay_s`` of a view in which a stage lost a replica
    (``stages_that_lost_replicas``), as the peer does by default (``--rebalance-loss-watch-s``;
    False: periodic checks only, the policy of the rows before commit f460ac0)."""
    loss_check_max_delay_s: float = 10.0
    """The peer's ``--rebalance-loss-delay-s``."""
    settle_periods: float = SETTLE_PERIODS
    """The peer's settle rule (``SettleWatch``): no periodic check plans a move for ``settle_periods``
    x ``check_period_s`` after a view showed a material move (``peers_settling`` at ``settle_share``) by another peer, or
    after the peer's own move; checks after a lost replica do not wait. 0: no settling (the policy
    of the rows before session 13)."""
    return_periods: float = RETURN_PERIODS
    """The peer's no-quick-return rule (``SettleWatch.return_barred_s``): a periodic check makes no
    move from stage b to a within ``return_periods`` x ``check_period_s`` of a material move from a
    to b that a view showed, or of the peer's own move from a to b (a check after a lost replica
    may). 0: no bar (the policy of the rows before session 18)."""
    min_gain: float = 0.01
    sample_period_s: float = 60.0
    standby_fraction: float = 0.0
    """Fraction of peers started with ``--standby`` (0: no backup pool, as in the first runs)."""
    standby_check_s: float = 2.0
    """The peer's ``--standby-check-s`` default."""
    standby_refresh_s: float = 30.0
    """The peer's ``--standby-refresh-s`` default."""
    standby_take_over_fraction: float = 0.5
    """The peer's ``--standby-take-over-fraction`` default."""
    standby_instant_take_over: bool = False
    """Hypothetical: take over from the held copy without first downloading the latest state."""

    def __post_init__(self) -> None:
        if self.peers < self.stages or self.stages < 1:
            raise ValueError(f"need peers >= stages >= 1, got {self.peers} peers, {self.stages} stages")
        for name in (
            "duration_s",
            "mean_lifetime_s",
            "view_period_s",
            "check_period_s",
            "record_ttl_s",
            "sample_period_s",
            "restore_mean_s",
            "burst_spread_s",
            "standby_check_s",
            "standby_refresh_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not self.loss_check_max_delay_s >= 0:
            raise ValueError("loss_check_max_delay_s must be >= 0")
        if not self.settle_periods >= 0:
            raise ValueError("settle_periods must be >= 0")
        if not self.return_periods >= 0:
            raise ValueError("return_periods must be >= 0")
        if self.join_scale < 0:
            raise ValueError("join_scale must be >= 0")
        if not 0 <= self.preempt_fraction <= 1:
            raise ValueError("preempt_fraction must be in [0, 1]")
        if not 0 <= self.standby_fraction < 1:
            raise ValueError("standby_fraction must be in [0, 1)")
        if not 0 <= self.standby_take_over_fraction <= 1:
            raise ValueError("standby_take_over_fraction must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class PeerLife:
    """One peer in the churn trace: who, how fast, from when to when (seconds)."""

    peer_id: str
    pool: int
    throughput: float
    arrive_s: float
    depart_s: float
    preempted: bool
    """Died without announcing ``offline`` (its record lingers for ``record_ttl_s``)."""


def generate_trace(config: SimulationConfig) -> list[PeerLife]:
    """Arrivals and departures for the whole run; independent of the policy."""
    rng = random.Random(config.seed)
    pool_medians = [math.exp(rng.gauss(0.0, config.pool_sigma)) for _ in range(config.pools)]
    lives: list[dict] = []

    def add(pool: int, arrive_s: float) -> None:
        lives.append(
            {
                "pool": pool,
                "throughput": pool_medians[pool] * math.exp(rng.gauss(0.0, config.peer_sigma)),
                "arrive_s": arrive_s,
                "depart_s": arrive_s + rng.expovariate(1.0 / config.mean_lifetime_s),
                "preempted": False,
            }
        )

    for _ in range(config.peers):
        add(rng.randrange(config.pools), 0.0)
    t = 0.0
    arrivals_per_s = config.join_scale * config.peers / config.mean_lifetime_s
    while arrivals_per_s > 0 and (t := t + rng.expovariate(arrivals_per_s)) < config.duration_s:
        add(rng.randrange(config.pools), t)

    t = 0.0
    while (t := t + rng.expovariate(config.preemptions_per_hour / 3600.0)) < config.duration_s:
        pool = rng.randrange(config.pools)
        killed = 0
        for life in lives:  # in arrival order, so the draw is deterministic
            if life["pool"] == pool and life["arrive_s"] <= t < life["depart_s"]:
                if rng.random() < config.preempt_fraction:
                    life["depart_s"] = t
                    life["preempted"] = True
                    killed += 1
        restore_s = t + rng.expovariate(1.0 / config.restore_mean_s)
        for _ in range(killed):
            if (arrive_s := restore_s + rng.uniform(0.0, config.burst_spread_s)) < config.duration_s:
                add(pool, arrive_s)

    lives.sort(key=lambda life: (life["arrive_s"], life["throughput"]))
    return [PeerLife(f"peer-{i:06d}", **life) for i, life in enumerate(lives)]


@dataclass
class _Peer:
    life: PeerLife
    stage: int
    record: ReplicaView
    online_at_s: float
    version: int = 0


@dataclass
class _Standby:
    """A peer in the backup pool, as peers/placement/stage_moves.py ``StageMoves.stand_by`` runs it."""

    held_stage: int | None = None
    refreshed_at_s: float | None = None
    """When its copy of ``held_stage`` was last downloaded (None: never, or the stage changed)."""


def draw_standbys(trace: list[PeerLife], config: SimulationConfig) -> list[bool]:
    """Which peers of the trace start with ``--standby``: each with ``standby_fraction``, own RNG."""
    rng = random.Random(config.seed + 2)
    return [config.standby_fraction > 0 and rng.random() < config.standby_fraction for _ in trace]


def replay(
    trace: list[PeerLife], config: SimulationConfig, policy: str, is_standby: list[bool] | None = None, observe=None
) -> dict:
    """Run one policy over the trace; per-sample throughput and move counts.

    ``is_standby`` (one flag per trace entry; default ``draw_standbys``) picks the backup pool.
    ``observe(now_s, live, view)``, if given, is called at every sample with the live peers
    (trace index -> ``_Peer``) and the view peers decide on (benchmarks/simulate_breakdown.py)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    check_rng = random.Random(config.seed + 1)
    loss_rng = random.Random(config.seed + 3)  # own RNG: the periodic checks' timing is unchanged
    events: list[tuple[float, int, str, int]] = []  # (time_s, seq, kind, trace index)
    seq = 0

    def schedule(time_s: float, kind: str, index: int = -1) -> None:
        nonlocal seq
        if time_s < config.duration_s:
            heapq.heappush(events, (time_s, seq, kind, index))
            seq += 1

    live: dict[int, _Peer] = {}
    ghosts: dict[int, ReplicaView] = {}  # preempted peers whose records have not expired yet
    standbys: dict[int, _Standby] = {}  # backup pool: not in views, serves nothing
    if is_standby is None:
        is_standby = draw_standbys(trace, config)
    if len(is_standby) != len(trace):
        raise ValueError(f"is_standby has {len(is_standby)} flags for {len(trace)} peers")
    for i, life in enumerate(trace):
        if is_standby[i]:
            schedule(life.arrive_s, "arrive", i)
        elif life.arrive_s == 0.0:  # bootstrap: placed one by one, fully informed, already online
            view = [p.record for p in live.values()]
            stage = choose_initial_stage(view, config.stages, life.throughput)
            record = ReplicaView(life.peer_id, stage, life.throughput, "online")
            live[i] = _Peer(life, stage, record, online_at_s=0.0)
            if policy == "rebalance":
                schedule(next_check_delay_s(config.check_period_s, check_rng), "check", i)
        else:
            schedule(life.arrive_s, "arrive", i)
        schedule(life.depart_s, "depart", i)
    view: list[ReplicaView] = [p.record for p in live.values()]
    view_records: dict[str, ReplicaView] = {r.peer_id: r for r in view}
    view_plan: RebalancePlan | None = None  # plan_rebalance(view), computed at most once per view
    pending_loss_checks: set[int] = set()
    loss_checks = settling_checks = 0
    settle_s = config.settle_periods * config.check_period_s
    moves_seen: list[tuple[float, tuple[str, ...]]] = []  # (view time, peers_settling of that view)
    own_move_at: dict[int, float] = {}
    return_s = config.return_periods * config.check_period_s
    moves_made: dict[tuple[int, int], float] = {}  # (from, to) -> when a view last showed a material move
    own_moves: dict[int, tuple[int, int]] = {}  # peer -> (from, to) of its last move, settled from own_move_at
    returns_barred = 0

    def undoes_a_move(i: int, from_stage: int, to_stage: int, now_s: float) -> bool:
        """Whether peer ``i``'s no-quick-return rule bars a move (as ``SettleWatch.return_barred_s``)."""
        if moves_made.get((to_stage, from_stage), -math.inf) > now_s - return_s:
            return True
        return own_moves.get(i) == (to_stage, from_stage) and own_move_at[i] > now_s - return_s

    def settling(i: int, now_s: float) -> bool:
        """Whether peer ``i``'s settle rule holds a periodic check back (as ``SettleWatch`` does)."""
        if own_move_at.get(i, -math.inf) > now_s - settle_s:
            return True
        me = trace[i].peer_id
        return any(t > now_s - settle_s and movers != (me,) for t, movers in moves_seen)

    schedule(config.view_period_s, "view")
    schedule(0.0, "sample")

    samples_per_s: list[float] = []
    moves = checks = take_overs = standby_downloads = 0
    view_version = 0
    standby_decision: tuple[int, int, bool, bool] | None = None  # (view_version, target, take_over, live)

    def decide_standby() -> tuple[int, bool, bool]:
        """What every standby concludes from the current view (all read the same one)."""
        nonlocal standby_decision
        if standby_decision is None or standby_decision[0] != view_version:
            target = choose_standby_target(view, config.stages)
            take_over = should_standby_take_over(
                view, config.stages, target, min_fraction=config.standby_take_over_fraction
            )
            has_live = any(r.stage == target and r.state == "online" for r in view)
            standby_decision = (view_version, target, take_over, has_live)
        return standby_decision[1:]

    def go_online(i: int, stage: int, now_s: float) -> None:
        live[i] = _Peer(
            trace[i], stage, ReplicaView(trace[i].peer_id, stage, trace[i].throughput, "online"), online_at_s=now_s
        )
        if policy == "rebalance":
            schedule(now_s + next_check_delay_s(config.check_period_s, check_rng), "check", i)

    while events:
        now_s, _, kind, i = heapq.heappop(events)
        if kind == "view":
            previous_view = view
            view = [p.record for p in live.values()] + list(ghosts.values())
            view_records, view_plan = {r.peer_id: r for r in view}, None
            view_version += 1
            schedule(now_s + config.view_period_s, "view")
            if policy == "rebalance" and (settle_s > 0 or return_s > 0):
                moved = peers_settling(previous_view, view, config.stages, share=settle_share(config.min_gain))
                if moved:
                    moves_seen.append((now_s, moved))
                    before = {r.peer_id: r.stage for r in previous_view}
                    for peer_id in moved:
                        moves_made[before[peer_id], view_records[peer_id].stage] = now_s
                while moves_seen and moves_seen[0][0] <= now_s - settle_s:
                    moves_seen.pop(0)
            if (
                policy == "rebalance"
                and config.check_on_loss
                and stages_that_lost_replicas(previous_view, view, config.stages)
            ):
                for j, peer in live.items():
                    if peer.record.state == "online" and j not in pending_loss_checks:
                        pending_loss_checks.add(j)
                        schedule(now_s + loss_check_delay_s(config.loss_check_max_delay_s, loss_rng), "loss_check", j)
        elif kind == "sample":
            per_stage = [0.0] * config.stages
            for p in live.values():
                if p.record.state == "online":
                    per_stage[p.stage] += p.life.throughput
            samples_per_s.append(min(per_stage))
            if observe is not None:
                observe(now_s, live, view)
            schedule(now_s + config.sample_period_s, "sample")
        elif kind == "arrive" and is_standby[i]:
            if trace[i].depart_s > now_s:
                standbys[i] = _Standby()
                schedule(now_s, "standby_check", i)
        elif kind == "standby_check":
            standby = standbys.get(i)
            if standby is None:
                continue
            target, take_over, has_live = decide_standby()
            if target != standby.held_stage:
                standby.held_stage, standby.refreshed_at_s = target, None
            stale = standby.refreshed_at_s is None or now_s - standby.refreshed_at_s > config.standby_refresh_s
            if config.standby_instant_take_over and take_over and standby.refreshed_at_s is not None:
                download = False
            else:
                download = has_live and (stale or take_over)
            done_s = now_s + (config.transfer_s if download else 0.0)
            standby_downloads += download
            if take_over:
                schedule(done_s, "take_over", i)
            else:
                if download:
                    standby.refreshed_at_s = done_s
                schedule(done_s + config.standby_check_s, "standby_check", i)
        elif kind == "take_over":
            standby = standbys.pop(i, None)
            if standby is not None:
                take_overs += 1
                go_online(i, standby.held_stage, now_s)
        elif kind == "arrive":
            life = trace[i]
            if life.depart_s <= now_s:
                continue
            stage = choose_initial_stage(view, config.stages, life.throughput)
            record = ReplicaView(life.peer_id, stage, life.throughput, "joining")
            live[i] = _Peer(life, stage, record, online_at_s=now_s + config.transfer_s)
            schedule(now_s + config.transfer_s, "online", i)
            if policy == "rebalance":
                schedule(now_s + config.transfer_s + next_check_delay_s(config.check_period_s, check_rng), "check", i)
        elif kind == "depart":
            standbys.pop(i, None)
            peer = live.pop(i, None)
            if peer is not None and trace[i].preempted:
                ghosts[i] = peer.record
                schedule(now_s + config.record_ttl_s, "expire", i)
        elif kind == "expire":
            ghosts.pop(i, None)
        elif kind == "online":
            peer = live.get(i)
            if peer is not None and peer.online_at_s <= now_s:
                peer.record = ReplicaView(peer.life.peer_id, peer.stage, peer.life.throughput, "online")
        elif kind in ("check", "loss_check"):
            peer = live.get(i)
            if kind == "loss_check":
                pending_loss_checks.discard(i)
            if peer is None:
                continue
            delay_s = next_check_delay_s(config.check_period_s, check_rng) if kind == "check" else 0.0
            if peer.record.state == "online" and kind == "check" and settle_s > 0 and settling(i, now_s):
                checks += 1
                settling_checks += 1
            elif peer.record.state == "online":
                checks += 1
                loss_checks += kind == "loss_check"
                if view_records.get(peer.life.peer_id) == peer.record:  # the view holds its current record
                    if view_plan is None:
                        view_plan = plan_rebalance(view, config.stages, min_gain=config.min_gain)
                    decision = decision_in_plan(peer.record, view_plan)
                else:
                    decision = decide_move(
                        peer.life.peer_id, _with_own_record(view, peer.record), config.stages, min_gain=config.min_gain
                    )
                if (
                    decision.move
                    and kind == "check"
                    and undoes_a_move(i, decision.from_stage, decision.to_stage, now_s)
                ):
                    returns_barred += 1
                elif decision.move:
                    moves += 1
                    peer.stage = decision.to_stage
                    peer.online_at_s = now_s + config.transfer_s
                    peer.record = ReplicaView(peer.life.peer_id, peer.stage, peer.life.throughput, "joining")
                    schedule(peer.online_at_s, "online", i)
                    delay_s += config.transfer_s
                    own_moves[i] = (decision.from_stage, decision.to_stage)
                    own_move_at[i] = now_s + config.transfer_s  # the peer settles from when its move ends
            if kind == "check":
                schedule(now_s + delay_s, "check", i)
    peer_hours = sum(min(life.depart_s, config.duration_s) - life.arrive_s for life in trace) / 3600
    return {
        "samples_per_s": samples_per_s,
        "moves": moves,
        "checks": checks,
        "loss_checks": loss_checks,
        "settling_checks": settling_checks,
        "returns_barred": returns_barred,
        "moves_per_peer_hour": moves / peer_hours,
        "standby_peers": sum(is_standby),
        "standby_take_overs": take_overs,
        "standby_downloads": standby_downloads,
        "standby_at_end": len(standbys),
    }


def _with_own_record(view: list[ReplicaView], own: ReplicaView) -> list[ReplicaView]:
    """The view with this peer's own, always-current record in place of its announced one."""
    for j, record in enumerate(view):
        if record.peer_id == own.peer_id:
            if record == own:
                return view
            return view[:j] + [own] + view[j + 1 :]
    return view + [own]


def optimum_series(trace: list[PeerLife], config: SimulationConfig) -> tuple[list[float], list[float]]:
    """Per sample: (optimal_bottleneck, LPT lower bound) over live peers past their first download."""
    upper, lower = [], []
    n_samples = math.ceil(config.duration_s / config.sample_period_s)
    for k in range(n_samples):
        t = k * config.sample_period_s
        ready = [
            life.throughput
            for life in trace
            if life.arrive_s + (config.transfer_s if life.arrive_s > 0 else 0.0) <= t < life.depart_s
        ]
        upper.append(optimal_bottleneck(ready, config.stages))
        lower.append(greedy_bottleneck(ready, config.stages))
    return upper, lower


def simulate(config: SimulationConfig) -> dict:
    started = time.perf_counter()
    trace = generate_trace(config)
    optimum, optimum_lower = optimum_series(trace, config)
    total_optimum = math.fsum(optimum)
    policies = {}
    for policy in POLICIES:
        result = replay(trace, config, policy)
        series = result.pop("samples_per_s")
        assert len(series) == len(optimum)
        policies[policy] = {
            "share_of_optimal": math.fsum(series) / total_optimum,
            "mean_sample_share": statistics.fmean(a / o for a, o in zip(series, optimum) if o > 0),
            "worst_sample_share": min(a / o for a, o in zip(series, optimum) if o > 0),
            **result,
        }
    return {
        "config": asdict(config),
        "trace": {"peers_total": len(trace), "live_at_end": sum(life.depart_s > config.duration_s for life in trace)},
        "optimum": {
            "kind": "upper bound (min_k (sum - k largest)/(S - k)) for > 12 peers",
            "lpt_over_bound": math.fsum(optimum_lower) / total_optimum,
        },
        "policies": policies,
        "wall_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> None:
    defaults = SimulationConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--peers", type=int, default=defaults.peers)
    parser.add_argument("--stages", type=int, default=defaults.stages)
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--min-gain", type=float, default=defaults.min_gain)
    parser.add_argument("--check-period-s", type=float, default=defaults.check_period_s)
    parser.add_argument("--transfer-s", type=float, default=defaults.transfer_s)
    parser.add_argument("--view-period-s", type=float, default=defaults.view_period_s)
    parser.add_argument("--join-scale", type=float, default=defaults.join_scale)
    parser.add_argument(
        "--check-on-loss",
        action=argparse.BooleanOptionalAction,
        default=defaults.check_on_loss,
        help="also check right after a stage loses a replica, as the peer does "
        "(--no-check-on-loss: periodic checks only)",
    )
    parser.add_argument("--loss-check-max-delay-s", type=float, default=defaults.loss_check_max_delay_s)
    parser.add_argument(
        "--settle-periods",
        type=float,
        default=defaults.settle_periods,
        help="the peer's settle rule: check periods without a planned move after a move was seen (0: off)",
    )
    parser.add_argument(
        "--return-periods",
        type=float,
        default=defaults.return_periods,
        help="the peer's no-quick-return rule: check periods without a move that undoes a material move (0: off)",
    )
    parser.add_argument(
        "--standby-fraction",
        type=float,
        default=defaults.standby_fraction,
        help="fraction of peers started with --standby (backup pool)",
    )
    parser.add_argument(
        "--standby-take-over-fraction",
        type=float,
        default=defaults.standby_take_over_fraction,
        help="the peer's --standby-take-over-fraction",
    )
    parser.add_argument(
        "--standby-instant-take-over",
        action="store_true",
        help="hypothetical peer: take over from the held copy, no download first",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/simulate.json"))
    args = parser.parse_args(argv)
    config = SimulationConfig(
        seed=args.seed,
        peers=args.peers,
        stages=args.stages,
        duration_s=args.duration_s,
        min_gain=args.min_gain,
        check_period_s=args.check_period_s,
        transfer_s=args.transfer_s,
        view_period_s=args.view_period_s,
        join_scale=args.join_scale,
        check_on_loss=args.check_on_loss,
        loss_check_max_delay_s=args.loss_check_max_delay_s,
        settle_periods=args.settle_periods,
        return_periods=args.return_periods,
        standby_fraction=args.standby_fraction,
        standby_take_over_fraction=args.standby_take_over_fraction,
        standby_instant_take_over=args.standby_instant_take_over,
    )
    report = simulate(config)
    write_report(args.out, report)
    for policy, figures in report["policies"].items():
        print(
            f"{policy:>9}: {figures['share_of_optimal']:.2%} of optimal "
            f"(worst sample {figures['worst_sample_share']:.2%}), "
            f"{figures['moves']} moves ({figures['moves_per_peer_hour']:.3f} per peer-hour)"
            + (
                f", {figures['standby_take_overs']} of {figures['standby_peers']} standbys took over"
                if figures["standby_peers"]
                else ""
            )
        )
    print(
        f"LPT/upper bound {report['optimum']['lpt_over_bound']:.4f}; "
        f"{report['trace']['peers_total']} peers in trace; {report['wall_s']:.1f} s wall; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
