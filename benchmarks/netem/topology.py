"""An emulated wide-area network as data: hosts placed in regions, and per region pair a round-trip
time and a bandwidth. Pure: no I/O except `load_topology`, no processes.

A topology file is JSON:

    {
      "name": "world4",
      "description": "...",
      "regions": ["oregon", "virginia", ...],
      "intra_region": {"rtt_ms": 5, "bandwidth_mbit": 200},
      "links": [{"regions": ["oregon", "virginia"], "rtt_ms": 67, "bandwidth_mbit": 39.5}, ...],
      "hosts": {"trainer": "oregon", "stage0": "tokyo", ...}
    }

Links are symmetric: the pair (a, b) has the same RTT and the same bandwidth in each direction,
and each direction of each host pair gets its own shaped rate (like DT-FM's pairwise model, a host
has no shared uplink). Every pair of distinct regions must be listed exactly once.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LinkSpec", "Topology", "TopologyError", "load_topology", "topology_from_dict", "from_dtfm_case"]

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class TopologyError(ValueError):
    """A topology that cannot be emulated; the message says what to fix."""


@dataclass(frozen=True)
class LinkSpec:
    """One region pair: round-trip time in milliseconds, bandwidth in Mbit/s (each direction)."""

    rtt_ms: float
    bandwidth_mbit: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.rtt_ms <= 10_000.0:
            raise TopologyError(f"rtt_ms must lie in [0, 10000], got {self.rtt_ms}")
        if not 0.01 <= self.bandwidth_mbit <= 100_000.0:
            raise TopologyError(f"bandwidth_mbit must lie in [0.01, 100000], got {self.bandwidth_mbit}")

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_ms / 2000.0

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbit * 1e6 / 8.0


@dataclass(frozen=True)
class Topology:
    """Validated: every host's region exists, every pair of distinct regions has a link."""

    name: str
    regions: tuple[str, ...]
    intra_region: LinkSpec
    links: dict[frozenset, LinkSpec]
    hosts: dict[str, str]  # host name -> region, in file order
    description: str = ""
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.regions:
            raise TopologyError("a topology needs at least one region")
        for name in [*self.regions, *self.hosts]:
            if not _NAME.match(name):
                raise TopologyError(f"name {name!r}: use lower-case letters, digits and _ (at most 32, a letter first)")
        if len(set(self.regions)) != len(self.regions):
            raise TopologyError(f"regions are listed twice: {list(self.regions)}")
        for host, region in self.hosts.items():
            if region not in self.regions:
                raise TopologyError(f"host {host!r} is in region {region!r}, which is not one of {list(self.regions)}")
        for a, b in itertools.combinations(self.regions, 2):
            if frozenset((a, b)) not in self.links:
                raise TopologyError(f"no link between regions {a!r} and {b!r}")
        for pair in self.links:
            unknown = set(pair) - set(self.regions)
            if len(pair) != 2 or unknown:
                raise TopologyError(f"link {sorted(pair)}: needs two distinct known regions")

    def link(self, region_a: str, region_b: str) -> LinkSpec:
        if region_a == region_b:
            return self.intra_region
        return self.links[frozenset((region_a, region_b))]

    def host_link(self, host_a: str, host_b: str) -> LinkSpec:
        return self.link(self.region_of(host_a), self.region_of(host_b))

    def region_of(self, host: str) -> str:
        try:
            return self.hosts[host]
        except KeyError:
            raise TopologyError(f"unknown host {host!r}; hosts are {list(self.hosts)}") from None

    def with_hosts(self, hosts: dict[str, str]) -> Topology:
        """The same regions and links with another set of hosts."""
        return Topology(
            self.name,
            self.regions,
            self.intra_region,
            dict(self.links),
            dict(hosts),
            self.description,
            dict(self.source),
        )

    def to_dict(self) -> dict[str, Any]:
        links = []
        for a, b in itertools.combinations(self.regions, 2):
            spec = self.links[frozenset((a, b))]
            links.append({"regions": [a, b], "rtt_ms": spec.rtt_ms, "bandwidth_mbit": spec.bandwidth_mbit})
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "regions": list(self.regions),
            "intra_region": {"rtt_ms": self.intra_region.rtt_ms, "bandwidth_mbit": self.intra_region.bandwidth_mbit},
            "links": links,
            "hosts": dict(self.hosts),
        }
        if self.source:
            out["source"] = self.source
        return out


def _link_from(raw: Any, where: str) -> LinkSpec:
    if not isinstance(raw, dict):
        raise TopologyError(f"{where}: expected an object with rtt_ms and bandwidth_mbit")
    try:
        return LinkSpec(rtt_ms=float(raw["rtt_ms"]), bandwidth_mbit=float(raw["bandwidth_mbit"]))
    except KeyError as e:
        raise TopologyError(f"{where}: missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, TopologyError):
            raise TopologyError(f"{where}: {e}") from None
        raise TopologyError(f"{where}: rtt_ms and bandwidth_mbit must be numbers") from None


def topology_from_dict(raw: Any) -> Topology:
    if not isinstance(raw, dict):
        raise TopologyError("a topology is a JSON object")
    regions = raw.get("regions")
    if not isinstance(regions, list) or not all(isinstance(r, str) for r in regions):
        raise TopologyError("'regions' must be a list of names")
    links: dict[frozenset, LinkSpec] = {}
    for index, item in enumerate(raw.get("links", [])):
        where = f"links[{index}]"
        pair = item.get("regions") if isinstance(item, dict) else None
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise TopologyError(f"{where}: 'regions' must name two distinct regions")
        key = frozenset(pair)
        if key in links:
            raise TopologyError(f"{where}: the link {sorted(pair)} is listed twice")
        links[key] = _link_from(item, where)
    hosts = raw.get("hosts", {})
    if not isinstance(hosts, dict) or not all(isinstance(v, str) for v in hosts.values()):
        raise TopologyError("'hosts' must map host names to region names")
    return Topology(
        name=str(raw.get("name", "")),
        regions=tuple(regions),
        intra_region=_link_from(raw.get("intra_region"), "intra_region"),
        links=links,
        hosts=dict(hosts),
        description=str(raw.get("description", "")),
        source=raw.get("source") or {},
    )


def load_topology(path: str | Path) -> Topology:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise TopologyError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TopologyError(f"{path} is not valid JSON: {e}") from None
    return topology_from_dict(raw)


def from_dtfm_case(
    case: dict[str, Any],
    regions: dict[str, int],
    *,
    intra_region_pair: tuple[int, int],
    bandwidth_divisor: float,
    name: str,
    hosts: dict[str, str] | None = None,
    description: str = "",
) -> Topology:
    """Regions cut out of a DT-FM scenario (`latency_ms`, `bandwidth_gbps` per device pair).

    regions: region name -> one device id of that region in the scenario. The scenario's
        `latency_ms` values are used as round-trip times (in case5 they match measured
        inter-region pings: Oregon-Virginia 67 ms, Tokyo-London 210 ms).
    intra_region_pair: two devices of one region; their link becomes every in-region link.
    bandwidth_divisor: every bandwidth (in-region ones too) is divided by it, so that a
        microbatch's transfer takes about as long, next to this machine's compute, as it would
        next to the scenario's GPUs with a large model.
    """
    if bandwidth_divisor <= 0:
        raise TopologyError("bandwidth_divisor must be positive")
    latency, bandwidth = case["latency_ms"], case["bandwidth_gbps"]

    def spec(i: int, j: int) -> LinkSpec:
        rtt = (latency[i][j] + latency[j][i]) / 2.0
        gbps = (bandwidth[i][j] + bandwidth[j][i]) / 2.0
        return LinkSpec(rtt_ms=rtt, bandwidth_mbit=round(gbps * 1000.0 / bandwidth_divisor, 3))

    names = list(regions)
    links = {frozenset((a, b)): spec(regions[a], regions[b]) for a, b in itertools.combinations(names, 2)}
    source = {
        "scenario": case.get("name", ""),
        "devices": dict(regions),
        "intra_region_pair": list(intra_region_pair),
        "bandwidth_divisor": bandwidth_divisor,
        "latency_ms_used_as": "rtt_ms",
    }
    return Topology(
        name=name,
        regions=tuple(names),
        intra_region=spec(*intra_region_pair),
        links=links,
        hosts=dict(hosts or {}),
        description=description,
        source=source,
    )


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise TopologyError(f"{what} {item!r}: expected NAME=VALUE")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """Cut a topology file out of a DT-FM scenario (the command is recorded in the file)."""
    import argparse
    import shlex
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.netem.topology", description=main.__doc__)
    parser.add_argument("scenario", help="DT-FM scenario JSON (latency_ms, bandwidth_gbps)")
    parser.add_argument("--region", action="append", required=True, help="NAME=DEVICE_ID, one per region")
    parser.add_argument("--intra-region-pair", required=True, help="I,J: two devices of one region")
    parser.add_argument("--bandwidth-divisor", type=float, required=True)
    parser.add_argument("--host", action="append", default=[], help="HOST=REGION")
    parser.add_argument("--name", required=True)
    parser.add_argument("--description", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        case = json.loads(Path(args.scenario).read_text())
        regions = {name: int(device) for name, device in _pairs(args.region, "--region").items()}
        i, j = (int(x) for x in args.intra_region_pair.split(","))
        topology = from_dtfm_case(
            case,
            regions,
            intra_region_pair=(i, j),
            bandwidth_divisor=args.bandwidth_divisor,
            name=args.name,
            hosts=_pairs(args.host, "--host"),
            description=args.description,
        )
    except (OSError, ValueError) as e:
        print(f"topology: error: {e}", file=sys.stderr)
        return 2
    data = topology.to_dict()
    data["source"]["command"] = "python -m benchmarks.netem.topology " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
