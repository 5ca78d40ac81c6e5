"""The planner's transfer sizes from a measured profile instead of constants.

DT-FM's cost model takes ``c_pp`` (activation bytes one stage sends the next per macro-batch) and
``c_dp`` (gradient bytes a stage's replicas average). Both follow from the model's layer graph and
its split: ``c_pp`` at each cut is the activation the last block before it hands on, times the
samples of a macro-batch; ``c_dp`` of a stage is the gradient bytes of the layers it holds. Sizes
are in GB (1e9 bytes), as the topology files state them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from models.config import GPTConfig
from models.layer_costs import ModelProfile
from swarm.planner.topology import Topology, TopologyError

__all__ = ["CommunicationSizes", "communication_sizes", "estimated_communication_sizes", "with_communication_sizes"]

BYTES_PER_GB = 1e9


@dataclass(frozen=True)
class CommunicationSizes:
    """Per-cut and per-stage transfer sizes of one split.

    Attributes:
        c_pp_gb: for each cut between consecutive stages, the activation bytes of one macro-batch
            (one way; its gradient coming back is as large), in GB.
        c_dp_gb: for each stage, the gradient bytes its replicas average, in GB.
    """

    c_pp_gb: tuple[float, ...]
    c_dp_gb: tuple[float, ...]


def communication_sizes(
    profile: ModelProfile,
    boundaries: Sequence[int],
    *,
    samples_per_macro_batch: int,
    activation_wire_ratio: float = 1.0,
    gradient_wire_ratio: float = 1.0,
) -> CommunicationSizes:
    """Sizes of a split of the profiled model.

    Args:
        profile: the measured layer graph.
        boundaries: the split, (0, b_1, ..., n_layers).
        samples_per_macro_batch: samples each pipeline replica sends through per macro-batch.
        activation_wire_ratio: bytes on the wire per byte measured (0.5: fp16 on the wire for fp32
            activations; 0.25: 8-bit).
        gradient_wire_ratio: the same for the averaged gradients.
    """
    if samples_per_macro_batch < 1:
        raise ValueError(f"samples_per_macro_batch must be at least 1, got {samples_per_macro_batch}")
    if not (activation_wire_ratio > 0 and gradient_wire_ratio > 0):
        raise ValueError("wire ratios must be positive")
    per_sample = profile.boundary_activation_bytes_per_sample(boundaries)
    c_pp = tuple(b * samples_per_macro_batch * activation_wire_ratio / BYTES_PER_GB for b in per_sample)
    c_dp = tuple(g * gradient_wire_ratio / BYTES_PER_GB for g in profile.stage_gradient_bytes(boundaries))
    return CommunicationSizes(c_pp_gb=c_pp, c_dp_gb=c_dp)


def estimated_communication_sizes(
    config: GPTConfig, boundaries: Sequence[int], *, samples_per_macro_batch: int, activation_wire_ratio: float = 1.0
) -> CommunicationSizes:
    """Sizes of a split from the model's shapes alone, for when nothing was profiled: fp32
    activations of (seq_len, d_model) per sample at every cut, fp32 gradients of every parameter.

    Args:
        config: the model.
        boundaries: the split, (0, b_1, ..., n_layers).
        samples_per_macro_batch: samples each pipeline replica sends through per macro-batch.
        activation_wire_ratio: bytes on the wire per fp32 byte (0.25 for 8-bit activations).
    """
    if samples_per_macro_batch < 1:
        raise ValueError(f"samples_per_macro_batch must be at least 1, got {samples_per_macro_batch}")
    if not activation_wire_ratio > 0:
        raise ValueError("activation_wire_ratio must be positive")
    bounds = tuple(boundaries)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != config.n_layers:
        raise ValueError(f"boundaries {list(bounds)} do not split {config.n_layers} blocks")
    fp32 = 4
    d, t = config.d_model, config.seq_len
    embedding = config.embedding_parameters()  # token (and position) embeddings
    head = config.head_parameters()  # final norm and output layer
    block = (config.num_parameters() - embedding - head) // config.n_layers
    parameters = [(b - a) * block for a, b in zip(bounds, bounds[1:])]
    parameters[0] += embedding
    parameters[-1] += head
    activation = t * d * fp32 * samples_per_macro_batch * activation_wire_ratio
    c_pp = tuple(activation / BYTES_PER_GB for _ in bounds[1:-1])
    c_dp = tuple(count * fp32 / BYTES_PER_GB for count in parameters)
    return CommunicationSizes(c_pp_gb=c_pp, c_dp_gb=c_dp)


def with_communication_sizes(topology: Topology, sizes: CommunicationSizes) -> Topology:
    """The topology with its ``c_pp_gb`` and ``c_dp_gb`` taken from `sizes`.

    The DT-FM cost model has one size of each kind, so the largest is used: every pipeline hop
    is charged the largest activation and every group the largest stage gradient. With a
    balanced split of a GPT the activations are all the same size; the gradients differ by the
    embedding and head, so DATAP is an upper bound for the groups of the smaller stages.
    """
    if len(sizes.c_dp_gb) != topology.stages:
        raise TopologyError(f"the split has {len(sizes.c_dp_gb)} stages but the topology {topology.stages}")
    if topology.stages > 1 and not sizes.c_pp_gb:
        raise TopologyError("the split has no cut between stages")
    c_pp = max(sizes.c_pp_gb) if sizes.c_pp_gb else topology.c_pp_gb
    return dataclasses.replace(topology, c_pp_gb=c_pp, c_dp_gb=max(sizes.c_dp_gb))
