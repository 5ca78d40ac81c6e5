"""The network a plan is made for: pairwise latency and bandwidth between N devices.

A topology file is JSON with the fields of the DT-FM scenarios (Yuan et al., 2022):
``stages`` (D_PP), ``replicas`` (D_DP), ``c_dp_gb`` (gigabytes a replica exchanges per stage when
averaging gradients), ``c_pp_gb`` (gigabytes of activations one stage sends the next per
macro-batch), ``latency_ms`` and ``bandwidth_gbps`` (N x N lists, N = stages * replicas).
Links are symmetrised as in the paper: edge (d, d') gets the mean of both directions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Topology", "TopologyError", "load_topology", "topology_from_dict"]


class TopologyError(ValueError):
    """A topology file or record that cannot be planned for; the message says what to fix."""


@dataclass(frozen=True, eq=False)
class Topology:
    """A validated, symmetrised network of ``stages * replicas`` devices.

    Attributes:
        stages: number of pipeline stages D_PP (groups in a plan).
        replicas: number of data-parallel replicas D_DP (devices per group).
        c_dp_gb: gradient bytes per stage exchanged by data-parallel averaging, in GB.
        c_pp_gb: activation bytes sent between consecutive stages per macro-batch, in GB.
        latency_s: (N, N) symmetric one-way latency in seconds.
        bandwidth_gbps: (N, N) symmetric bandwidth in Gbit/s (diagonal unused).
        name: a label for reports.
    """

    stages: int
    replicas: int
    c_dp_gb: float
    c_pp_gb: float
    latency_s: np.ndarray
    bandwidth_gbps: np.ndarray
    name: str = ""

    @property
    def num_devices(self) -> int:
        """N = stages * replicas."""
        return self.stages * self.replicas

    def permuted(self, permutation: np.ndarray) -> Topology:
        """The same network with device ``i`` renamed ``j`` where ``permutation[j] == i``."""
        perm = np.asarray(permutation)
        return Topology(
            stages=self.stages,
            replicas=self.replicas,
            c_dp_gb=self.c_dp_gb,
            c_pp_gb=self.c_pp_gb,
            latency_s=self.latency_s[np.ix_(perm, perm)],
            bandwidth_gbps=self.bandwidth_gbps[np.ix_(perm, perm)],
            name=self.name,
        )


def _positive_int(data: dict[str, Any], key: str) -> int:
    if key not in data:
        raise TopologyError(f"missing field {key!r} (a positive integer)")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"field {key!r} must be a positive integer, got {value!r}")
    return value


def _positive_float(data: dict[str, Any], key: str) -> float:
    if key not in data:
        raise TopologyError(f"missing field {key!r} (a positive number of gigabytes)")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TopologyError(f"field {key!r} must be a finite number, got {value!r}")
    if value <= 0:
        raise TopologyError(f"field {key!r} must be positive, got {value!r}")
    return float(value)


def _square_matrix(data: dict[str, Any], key: str, size: int) -> np.ndarray:
    if key not in data:
        raise TopologyError(f"missing field {key!r} (an N x N list of numbers, N = {size})")
    try:
        matrix = np.array(data[key], dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TopologyError(f"field {key!r} must be an N x N list of numbers: {error}") from None
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise TopologyError(f"field {key!r} must be a square N x N list, got shape {matrix.shape}")
    if matrix.shape[0] != size:
        raise TopologyError(f"field {key!r} is {matrix.shape[0]} x {matrix.shape[0]}, but stages * replicas = {size}")
    bad = np.argwhere(~np.isfinite(matrix))
    if bad.size:
        row, col = bad[0]
        raise TopologyError(f"field {key!r} has a non-finite entry at [{row}][{col}]")
    return matrix


def topology_from_dict(data: Any) -> Topology:
    """Validate a decoded topology record and return it symmetrised (latency converted to s).

    Raises:
        TopologyError: a field is missing, of the wrong shape or has an impossible value.
    """
    if not isinstance(data, dict):
        raise TopologyError(f"a topology must be a JSON object, got {type(data).__name__}")
    stages = _positive_int(data, "stages")
    replicas = _positive_int(data, "replicas")
    c_dp_gb = _positive_float(data, "c_dp_gb")
    c_pp_gb = _positive_float(data, "c_pp_gb")
    size = stages * replicas
    latency_ms = _square_matrix(data, "latency_ms", size)
    bandwidth_gbps = _square_matrix(data, "bandwidth_gbps", size)

    negative = np.argwhere(latency_ms < 0)
    if negative.size:
        row, col = negative[0]
        raise TopologyError(f"latency_ms[{row}][{col}] = {latency_ms[row, col]} is negative")
    off_diagonal = ~np.eye(size, dtype=bool)
    not_positive = np.argwhere((bandwidth_gbps <= 0) & off_diagonal)
    if not_positive.size:
        row, col = not_positive[0]
        raise TopologyError(f"bandwidth_gbps[{row}][{col}] = {bandwidth_gbps[row, col]} must be positive")

    # The paper's symmetrisation: edge (d, d') gets the mean of both directions.
    latency_s = (latency_ms + latency_ms.T) / 2.0 / 1e3  # (N, N) seconds
    bandwidth = (bandwidth_gbps + bandwidth_gbps.T) / 2.0  # (N, N) Gbit/s
    np.fill_diagonal(latency_s, 0.0)
    np.fill_diagonal(bandwidth, np.inf)  # a device never talks to itself
    latency_s.setflags(write=False)
    bandwidth.setflags(write=False)
    name = data.get("name", "")
    return Topology(
        stages=stages,
        replicas=replicas,
        c_dp_gb=c_dp_gb,
        c_pp_gb=c_pp_gb,
        latency_s=latency_s,
        bandwidth_gbps=bandwidth,
        name=name if isinstance(name, str) else str(name),
    )


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology JSON file.

    Raises:
        TopologyError: the file cannot be read, is not JSON, or fails validation.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise TopologyError(f"cannot read topology file {str(path)!r}: {error.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TopologyError(
            f"topology file {str(path)!r} is not valid JSON (line {error.lineno}: {error.msg})"
        ) from None
    if isinstance(data, dict) and "stages" not in data and {"regions", "hosts", "links"} <= data.keys():
        raise TopologyError(
            f"{path} describes an emulated network for the benchmarks (benchmarks/netem), not devices to plan "
            f"for: a planner topology has stages, replicas, c_dp_gb, c_pp_gb, latency_ms and bandwidth_gbps "
            f"(e.g. benchmarks/dtfm_scenarios/case1.json), or plan for running peers with --from-dht"
        )
    try:
        return topology_from_dict(data)
    except TopologyError as error:
        raise TopologyError(f"{path}: {error}") from None
