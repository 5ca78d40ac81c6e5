"""What crossed a chain's hops, kept a short while for the trainer's spot checks (direct routing).

Under hub routing the trainer holds every stage's inputs and outputs, so a spot check resends a
stage's inputs to a second replica and compares the answers (swarm/trainer/spot_checks.py). Under
direct routing they go from peer to peer and the trainer sees neither. So each peer of a chain
keeps, per microbatch, the activations it **received** from the stage before and the ones it
**sent** to the replica of the next stage that answered, and the gradients it **grad_received**
back from that replica and **grad_sent** back to the stage before, each exactly as it crossed the
wire (the sender's codec, encoded). To check the replica P that served stage s, the trainer asks
*P's neighbours*, never P: the replica before it for what it sent P and got back from it (stage
0's inputs are the trainer's own tokens), the replica after it for what it received from P and
sent back to it. P cannot tell a checked microbatch from another when it answers (the trainer
asks after the chain has answered), and cannot make its neighbours report other tensors than the
ones that crossed. Neighbours that collude with it are not caught, as a checker that colludes is
not under hub routing; a neighbour that reports another tensor than the one that crossed gets P
banned (the check recomputes from what it says).

Peers keep records only of chains whose trainer spot-checks (the chain request's `keep_records`:
it says the run checks some chains, not which), in arrival order within `max_bytes` (`--hop-record-mb`;
the oldest dropped first), and hand them only to the trainer that drove the chain: other callers
learn nothing of a run's activations.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from wire.compression import EncodedTensor
from wire.protocol import HOP_RECORD_NAMES

SIDES = tuple(HOP_RECORD_NAMES)


@dataclass(frozen=True)
class HopRecord:
    trainer_id: str  # the trainer that drove the chain: the only caller it is handed to
    tensor: EncodedTensor


class HopRecords:
    """The last chains' boundary tensors on this peer, by (microbatch id, side), within `max_bytes`."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._records: OrderedDict[tuple[str, str], HopRecord] = OrderedDict()

    def keep(self, microbatch_id: str, side: str, trainer_id: str, tensor: EncodedTensor) -> None:
        """Keep what crossed for `microbatch_id` (a later attempt of the same microbatch replaces
        it); the oldest records go once over `max_bytes`; a tensor larger than that is not kept."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self._drop((microbatch_id, side))
        if tensor.nbytes > self.max_bytes:
            return
        self._records[microbatch_id, side] = HopRecord(trainer_id, tensor)
        self.nbytes += tensor.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._records)))

    def find(self, microbatch_id: str, side: str, caller: str) -> EncodedTensor | None:
        """What crossed for `microbatch_id` on `side`, if kept and `caller` drove its chain."""
        record = self._records.get((microbatch_id, side))
        return record.tensor if record is not None and record.trainer_id == caller else None

    def __len__(self) -> int:
        return len(self._records)

    def _drop(self, key: tuple[str, str]) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self.nbytes -= record.tensor.nbytes
