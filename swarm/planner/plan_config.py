"""``swarm plan``'s configuration: one dataclass nested by section, from which process/config.py
derives the flags and the SWARM_* environment variables (``--time-limit-s`` is
``search.time_limit_s`` and SWARM_TIME_LIMIT_S).

- top level: the topology file to plan for and the plan file to write;
- ``search``: how the placement is searched (iterated local search, or opfence's clusters);
- ``workload``: the transfer sizes of the cost model from a ``swarm profile`` measurement;
- ``live``: planning for a running swarm from the links its peers measured (``--from-dht``),
  with the DHT options (dht/node.py's NetworkConfig) as a section of its own.

Each section refuses values that are wrong whatever the mode; `PlanConfig` checks the rules between
sections (``--topology`` or ``--from-dht``, and what each needs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dht.node import NetworkConfig
from dht.record_policy import MAX_PLAN_TTL_S
from process.config import ConfigError, option, section
from swarm.planner.opfence import PLACEMENTS
from swarm.planner.search import DEFAULT_PATIENCE_ROUNDS


@dataclasses.dataclass(kw_only=True)
class SearchOptions:
    seed: int = option(0, help="search seed")
    time_limit_s: float = option(60.0, help="wall-clock cap on the search in seconds")
    patience_rounds: int = option(DEFAULT_PATIENCE_ROUNDS, help="stop after this many rounds without improvement")
    method: str = option(
        "search",
        choices=["search", "opfence"],
        help="search: iterated local search; opfence: cluster devices by bandwidth, "
        "place whole stages or pipelines in the fastest clusters (no search)",
    )
    placement: str = option(
        "best",
        choices=PLACEMENTS,
        help="with --method opfence: keep whole stages or whole pipelines in clusters, or the cheaper of both",
    )

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ConfigError(f"--time-limit-s must be positive, got {self.time_limit_s}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be non-negative, got {self.seed}")
        if self.patience_rounds < 1:
            raise ConfigError(f"--patience-rounds must be at least 1, got {self.patience_rounds}")


@dataclasses.dataclass(kw_only=True)
class WorkloadOptions:
    profile: Path | None = option(
        None, help="take c_pp and c_dp from this `swarm profile` output (PROFILE.json) instead of the topology file"
    )
    split_boundaries: str | None = option(
        None, help="with --profile: the stage split, e.g. 0,4,6 (default: the equal split into the topology's stages)"
    )
    macro_batch_samples: int | None = option(
        None,
        help="with --profile or --from-dht: samples each pipeline replica processes per macro-batch "
        "(--from-dht default: 32)",
    )
    activation_wire_ratio: float = option(
        1.0, help="with --profile: wire bytes per measured activation byte (0.5 for fp16)"
    )

    def __post_init__(self) -> None:
        if self.macro_batch_samples is not None and self.macro_batch_samples < 1:
            raise ConfigError(f"--macro-batch-samples must be at least 1, got {self.macro_batch_samples}")
        if not self.activation_wire_ratio > 0:
            raise ConfigError("--activation-wire-ratio must be positive")


@dataclasses.dataclass(kw_only=True)
class LiveOptions:
    from_dht: bool = option(
        False, help="plan for the peers on the DHT from the links they measured (instead of --topology)"
    )
    model: str = option("small", help="model whose peers to plan for")
    stages: int | None = option(None, help="pipeline stages (default: the stage count most peers serve)")
    c_pp_gb: float | None = option(
        None,
        help="activation GB one stage sends the next per macro-batch "
        "(default: from --profile, else from the model's shapes and --macro-batch-samples)",
    )
    c_dp_gb: float | None = option(
        None,
        help="gradient GB a stage's replicas average "
        "(default: from --profile, else fp32 gradients of the largest stage of the model)",
    )
    max_link_age_s: float = option(600.0, help="ignore link measurements older than this")
    publish: bool = option(False, help="store the plan on the DHT for peers to follow")
    plan_ttl_s: float = option(3600.0, help="with --publish: the plan expires after this many seconds")
    save_topology: Path | None = option(
        None, help="also write the measured topology as a topology file (FILE.json; replay with --topology)"
    )
    network: NetworkConfig = section(NetworkConfig, help="joining the swarm's DHT (with --from-dht)")

    def __post_init__(self) -> None:
        if self.stages is not None and self.stages < 1:
            raise ConfigError(f"--stages must be at least 1, got {self.stages}")
        if not self.plan_ttl_s > 0 or not self.max_link_age_s > 0:
            raise ConfigError("--plan-ttl-s and --max-link-age-s must be positive")
        if self.plan_ttl_s > MAX_PLAN_TTL_S:  # DHT nodes refuse a plan that expires later
            raise ConfigError(f"--plan-ttl-s is at most {MAX_PLAN_TTL_S:.0f} s (a week), got {self.plan_ttl_s}")


@dataclasses.dataclass(kw_only=True)
class PlanConfig:
    topology: Path | None = option(
        None,
        help="topology JSON (FILE.json): stages, replicas, c_dp_gb, c_pp_gb, latency_ms, bandwidth_gbps "
        "(or --from-dht to plan for a running swarm)",
    )
    out: Path | None = option(
        None, help="where to write the plan (PLAN.json; required with --topology, optional with --from-dht)"
    )
    search: SearchOptions = section(SearchOptions, help="searching the placement")
    workload: WorkloadOptions = section(WorkloadOptions, help="transfer sizes from a `swarm profile` measurement")
    live: LiveOptions = section(LiveOptions, help="planning for a running swarm (--from-dht)")

    def __post_init__(self) -> None:
        if self.live.from_dht:
            if self.topology is not None:
                raise ConfigError("give either --topology or --from-dht, not both")
            if not self.live.network.initial_peers:
                raise ConfigError(
                    "--from-dht needs --initial-peers (or SWARM_INITIAL_PEERS): a multiaddr of a running DHT node"
                )
        elif self.topology is None or self.out is None:
            raise ConfigError(
                "--topology FILE.json and --out PLAN.json are required (or plan a running swarm with --from-dht)"
            )
