"""The wire contract between a trainer and a peer, and between peers: the RPCs, their typed headers
and the limits a receiver enforces. `wire.messages` turns these headers (and tensors) into
hivemind protobuf messages and back.

The RPCs (hivemind P2P protobuf handlers; a message's `metadata` carries a msgpack header):
`RPC_FORWARD`, `RPC_BACKWARD` (hub routing), `RPC_COMMIT`, `RPC_STATE`, `RPC_PROBE`,
`RPC_TRAIN_CHAIN`, `RPC_HOP_RECORD` and `RPC_CHAIN_PIECE` (direct routing), `RPC_DATA_PLANE`
(wire/data_plane.py) and `RPC_OUTER_ROUND` (peers/replicas/outer_exchange.py).

A stream's first message carries the header; tensor parts (each at most 1 MiB) follow in the order
the header's `tensors` list them, each described by its codec's `TensorHeader`.

Everything a receiver reads comes from an untrusted peer: decoding a header validates it against
`MAX_NUMEL`, `MAX_TENSOR_BYTES`, `MAX_NDIM`, `MAX_PARTS` and the codec's limits, checks what its
tensors decode to before the parts are read (`wire.tensors.check_decoded_bytes`), and raises
`ProtocolError` and nothing else. Unknown header fields are ignored. A peer answers a request it
refuses or fails with `ResponseHeader.error` and `error_kind` (`wire.failures.ANSWERS`), never by
dropping the stream.

Each RPC's messages, in a table: docs/design/wire.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

import msgpack
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    model_validator,
)

from wire.compression import TensorHeader, known_codecs
from wire.failures import ANSWERS, Failure

RPC_FORWARD = "swarm.forward"
RPC_BACKWARD = "swarm.backward"
RPC_COMMIT = "swarm.commit"  # sync averaging: the trainer finished a step; replicas average and step
RPC_STATE = "swarm.state"  # a joining replica downloads this stage's parameters and optimizer state
RPC_PROBE = "swarm.probe"  # echo a payload to measure a link (peers/placement/link_probe.py)
RPC_TRAIN_CHAIN = "swarm.train_chain"  # direct routing: forward on, backward back, stage to stage
RPC_HOP_RECORD = "swarm.hop_record"  # direct routing's spot checks: what a peer received or sent in a chain
RPC_CHAIN_PIECE = "swarm.chain_piece"  # direct routing: a piece of a chained call's tensors on a stream of its own
RPC_DATA_PLANE = "swarm.data_plane"  # the port, certificate and caller token of the peer's data plane
RPC_OUTER_ROUND = "swarm.outer_round"  # outer rounds: a replica's pseudo-gradient to its stage's other replicas
RPC_SYNC_ROUND = "swarm.sync_round"  # exact sync: a replica fetches another's gradient of a commit (pull)

MAX_HEADER_BYTES = 64 << 10  # one encoded header
MAX_TENSORS = 4  # tensors in one request or response
MAX_TENSOR_NAME_CHARS = 32
MAX_STREAM_PARTS = 1 << 16  # tensor parts in one stream (a peer also caps a request's bytes: --max-request-mb)
STATE_CHUNK_BYTES = 1 << 20
MAX_STATE_BYTES = 1 << 34
STATE_REQUEST_INTERVAL_S = 10.0
"""A replica sends one caller its state at most once per this many seconds, after a burst of 4
(peers/replicas/state_transfer.py `StateExports`): a caller that asks more often is refused."""
PROBE_CHUNK_BYTES = 1 << 20
MAX_PROBE_BYTES = 8 << 20
MAX_CREDENTIAL_CHARS = 4096  # a run credential (dht/authority.py), carried as the JSON text it is
MAX_CHAIN_STAGES = 256  # stages one chained call may still route through
MAX_CHAIN_CANDIDATES = 8  # replicas named for one stage of a chained call's route (the first preferred)
MAX_PEER_ID_CHARS = 128
MAX_HOP_PIECES = 16  # streams one chained call's tensors may cross on (ChainRequest.pieces)
GRAD_SAMPLE_SIZE = 128  # entries of a backward's parameter gradient sampled for spot checks (grad_sample)
# what a hop record's side (HopRecordRequest.side) is handed out as: the tensor's name in the answer
HOP_RECORD_NAMES = {
    "received": "inputs",
    "sent": "outputs",
    "grad_received": "grad_outputs",
    "grad_sent": "grad_inputs",
}
MAX_STEPS = 1 << 48  # an optimizer step count an answer may state
MAX_SAMPLED_STAGES = 32  # a chain's answer carries the gradient samples of at most this many stages
MAX_FOLLOWING_PEERS = 64  # replicas one FollowsCommit may name (a trainer with more waits for its commits)


class ProtocolError(ValueError):
    """A message that does not follow the wire contract."""


class StreamClosedError(ProtocolError):
    """The stream ended before any message: the other side closed it or the connection broke."""


# --- field types -----------------------------------------------------------------------------------


def _tensor_headers(value: object) -> dict[str, TensorHeader]:
    """A `tensors` field: name -> TensorHeader, in the order the parts follow. Accepts the wire form
    (a list of `{"name": ..., **TensorHeader.to_dict()}`) or, in code, such a dict. Raises ValueError
    (which the model reports as a validation error) on anything malformed."""
    if isinstance(value, Mapping):
        named = list(value.items())
    elif isinstance(value, (list, tuple)):
        if len(value) > MAX_TENSORS:
            raise ValueError(f"more than {MAX_TENSORS} tensors")
        named = []
        for entry in value:
            if not isinstance(entry, dict):
                raise ValueError(f"a tensor header must be a map, got {type(entry).__name__}")
            named.append((entry.get("name"), TensorHeader.from_dict(entry)))
    else:
        raise ValueError(f"tensors must be a list of tensor headers, got {type(value).__name__}")
    if len(named) > MAX_TENSORS:
        raise ValueError(f"more than {MAX_TENSORS} tensors")
    headers: dict[str, TensorHeader] = {}
    for name, header in named:
        if not isinstance(name, str) or len(name) > MAX_TENSOR_NAME_CHARS:
            raise ValueError(f"a tensor name must be a string of at most {MAX_TENSOR_NAME_CHARS} characters")
        if not isinstance(header, TensorHeader):
            raise ValueError(f"tensor {name!r}: expected a TensorHeader, got {type(header).__name__}")
        if name in headers:
            raise ValueError(f"tensor {name!r} is sent twice")
        headers[name] = header
    return headers


def _tensor_headers_on_the_wire(headers: dict[str, TensorHeader]) -> list[dict]:
    return [{"name": name, **header.to_dict()} for name, header in headers.items()]


TensorHeaders = Annotated[
    dict[str, TensorHeader],
    PlainValidator(_tensor_headers),
    PlainSerializer(_tensor_headers_on_the_wire),
]


def _failure_kind(value: object) -> Failure:
    """A kind arrives as its string value. (A named function, not the Enum itself: pydantic reads a
    validator's signature, and on Python 3.12 an Enum's is `(*values)`, which it refuses.)"""
    return Failure(value)  # ValueError for an unknown kind


def _answer_kind(value: object) -> object:
    """`error_kind` arrives as its string value; only the kinds a peer may answer are accepted."""
    if value is None:
        return None
    kind = Failure(value)  # ValueError for an unknown kind
    if kind not in ANSWERS:
        raise ValueError(f"{kind.value!r} is not a kind a peer answers")
    return kind


# --- headers ---------------------------------------------------------------------------------------


class FollowsCommit(BaseModel):
    """A call a trainer sent while its commit `step_id` was still travelling (`swarm train
    --outer-commits background`): a replica named in `peers` computes the call only once it has
    handled that commit (peers/serving/commit_order.py), as if the trainer had waited for it."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    step_id: str = Field(min_length=1, max_length=128)
    peers: list[Annotated[str, Field(min_length=1, max_length=MAX_PEER_ID_CHARS)]] = Field(
        min_length=1, max_length=MAX_FOLLOWING_PEERS
    )

    def names(self, peer_id: str) -> bool:
        return peer_id in self.peers


class RequestHeader(BaseModel):
    """A forward or backward request to the peer serving `stage`."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    rpc: Literal["forward", "backward"]
    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    microbatch_id: str = Field(min_length=1, max_length=128)
    batch_size: int = Field(ge=1)
    tensors: TensorHeaders = Field(default_factory=dict)  # filled in by wire.messages.write_request
    response_codec: str = Field(default="none", max_length=32)  # how the peer should encode what it returns
    response_codec_params: dict[str, int | float | str] = Field(default_factory=dict, max_length=8)
    # backward only: no 'inputs' tensor is sent; use those this peer cached when it served the forward
    inputs_cached: bool = False
    # forward only: a validation pass (no gradient, no activation cache, no sample counted); the
    # last stage returns the loss given 'targets'
    evaluate: bool = False
    # the caller's credential for the run (dht/authority.py), when the peer's run has an authority
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    # backward only: answer `grad_sample` too (a run that spot-checks asks it of every backward)
    grad_sample: bool = False
    # a spot check's recompute (swarm/trainer/spot_checks.py): the same answer as the call checked,
    # computed in `check_precision` on the parameters training computes on, nothing kept, cached or
    # counted (a backward adds nothing to the gradients)
    check: bool = False
    check_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # the trainer's commit still travelling when it sent this call: the peer, if named, handles it first
    follows_commit: FollowsCommit | None = None


class ComputeBusy(BaseModel):
    """A peer's reading of its compute clock when it answered (peers/compute/utilization.py): the
    seconds its stage has computed, and the seconds its clock has run. Two readings give the busy
    fraction between them. The peer's own word: shown (report, status), never used to route."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    busy_s: float = Field(ge=0.0, le=1e9)
    clock_s: float = Field(ge=0.0, le=1e9)


class ResponseHeader(BaseModel):
    """A peer's answer to a RequestHeader: the outputs and loss, or `error` with its `error_kind`."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    tensors: TensorHeaders = Field(default_factory=dict)  # filled in by wire.messages.write_response
    loss: float | None = None
    compute_s: float = 0.0  # seconds the request ran on the peer's compute thread
    queue_s: float = 0.0  # seconds from its full arrival to the start of that compute (decode, wait)
    busy: ComputeBusy | None = None  # the peer's compute clock when it answered
    error: str | None = Field(default=None, max_length=4096)
    error_kind: Annotated[Failure | None, BeforeValidator(_answer_kind)] = None
    # a backward asked for it: GRAD_SAMPLE_SIZE fixed entries of the parameter gradient this call
    # computed (peers/compute/grad_sample.py), what a spot check of a backward compares beside its tensors
    grad_sample: list[float] | None = Field(default=None, max_length=GRAD_SAMPLE_SIZE)
    # the optimizer steps the parameters it computed on had taken: a spot check compares answers of
    # the same step only, where several trainers' commits may step the replicas between two calls
    steps_done: int | None = Field(default=None, ge=0, le=MAX_STEPS)


def _codec_name(value: object) -> object:
    if value not in known_codecs():
        raise ValueError(f"unknown codec {value!r}; one of {', '.join(known_codecs())}")
    return value


def _codec_mode(value: object) -> object:
    return value if value == ADAPTIVE else _codec_name(value)


ADAPTIVE = "adaptive"  # a codec mode: each sender chooses per link
CodecName = Annotated[str, AfterValidator(_codec_name)]
CodecMode = Annotated[str, AfterValidator(_codec_mode)]
PeerIdText = Annotated[str, Field(min_length=1, max_length=MAX_PEER_ID_CHARS)]
Candidates = Annotated[list[PeerIdText], Field(min_length=1, max_length=MAX_CHAIN_CANDIDATES)]


class ChainRequest(BaseModel):
    """Direct routing (`swarm train --routing direct`): one microbatch's training pass from `stage`
    to the last stage. The peer computes its forward, sends its outputs to the first candidate of
    `route[0]` (a replica of `stage + 1`, with `route[1:]` as that call's route), fails over to the
    next candidates, then runs its backward with the gradient it got back. Tensors: 'inputs' (tokens
    on stage 0, activations after), 'targets' (passed along to the last stage)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    microbatch_id: str = Field(min_length=1, max_length=128)
    batch_size: int = Field(ge=1)
    tensors: TensorHeaders = Field(default_factory=dict)  # filled in by wire.messages.write_request
    # for each stage after this one, in order: the replicas to try (the trainer's choice, first preferred)
    route: list[Candidates] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    timeout_s: float = Field(gt=0.0, le=3600.0)  # what this call (the rest of the chain included) may take
    # the trainer that started the chain, and its credential for the run (dht/authority.py) when the
    # peer's run has an authority; a peer forwarding the chain adds its own credential
    trainer_id: PeerIdText
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    forwarder_credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    # the run's codec, which every hop's sender applies (passed along the chain): a fixed codec, or
    # "adaptive" (each sender chooses for its link, wire/compression/policy.py); top-k's fraction
    codec: CodecMode = "none"
    topk_fraction: float = Field(default=0.1, gt=0.0, le=1.0)
    # with "adaptive": the validation-loss cost its choices may add (wire/compression/policy.py); None: no budget
    loss_budget: float | None = Field(default=None, ge=0.0, le=1.0)
    # how this peer encodes the 'grad_inputs' it answers: its caller's choice for their link
    response_codec: CodecName = "none"
    response_codec_params: dict[str, int | float | str] = Field(default_factory=dict, max_length=8)
    # the trainer spot-checks some of its chains: keep what crosses each hop (peers/serving/hop_records.py)
    # and answer each stage's gradient sample (ChainResponse.grad_samples)
    keep_records: bool = False
    # the call's tensor parts cross on `pieces` streams: this one, then `pieces - 1` RPC_CHAIN_PIECE
    # streams from the same caller that name `hop_id` (ChainPiece); the answer's parts come back the
    # same way (peers/serving/hop_pieces.py)
    pieces: int = Field(default=1, ge=1, le=MAX_HOP_PIECES)
    hop_id: str | None = Field(default=None, min_length=8, max_length=64)
    # the trainer's commit still travelling when it started the chain (passed along): each named peer
    # handles it before it computes
    follows_commit: FollowsCommit | None = None

    @model_validator(mode="after")
    def _pieces_are_named(self) -> ChainRequest:
        if self.pieces > 1 and self.hop_id is None:
            raise ValueError("a call in pieces names its hop_id")
        return self


class HopFailover(BaseModel):
    """A replica a chain's hop failed on before another candidate of its stage answered: which, at
    which stage, and how (as a caller records it: timeout, transport, garbage, wrong_stage, ...)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    peer: PeerIdText
    stage: int = Field(ge=0, lt=MAX_CHAIN_STAGES)
    kind: Annotated[Failure, BeforeValidator(_failure_kind)]


class ChainPiece(BaseModel):
    """The header of one of a chained call's other streams: piece `index` (1 to `pieces - 1`) of the
    call `hop_id`'s tensor parts, which that call (RPC_TRAIN_CHAIN, from the same caller) takes in
    order after its own. The stream is answered with the same piece of the answer's parts, without
    a header; a refused piece's stream ends with an error instead. `timeout_s`: how long the piece
    waits for its answer (the call's own timeout)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    hop_id: str = Field(min_length=8, max_length=64)
    index: int = Field(ge=1, lt=MAX_HOP_PIECES)
    timeout_s: float = Field(gt=0.0, le=3600.0)


class ChainResponse(BaseModel):
    """A peer's answer to a ChainRequest: the loss and 'grad_inputs' (none on stage 0), with the peer
    that served each stage from the request's on and the replicas its hops failed over from; or `error`, the stage whose call failed
    (`failed_stage`) and the replicas of it that were tried (`failed_peers`)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    tensors: TensorHeaders = Field(default_factory=dict)  # filled in by wire.messages.write_response
    loss: float | None = None
    served_by: list[PeerIdText] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    # replicas a hop failed on before another candidate of their stage answered (the chain's failovers)
    failed_over: list[HopFailover] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    error: str | None = Field(default=None, max_length=4096)
    error_kind: Annotated[Failure | None, BeforeValidator(_answer_kind)] = None
    failed_stage: int | None = Field(default=None, ge=0)
    failed_peers: list[PeerIdText] = Field(default_factory=list, max_length=MAX_CHAIN_CANDIDATES)
    # seconds this peer computed (its forward and backward), and from the request's arrival to this
    # answer (the stages after it included): what the caller subtracts to time its link
    compute_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    handler_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    # each `served_by` peer's compute clock when it answered (the same order; empty from older peers)
    busy: list[ComputeBusy] = Field(default_factory=list, max_length=MAX_CHAIN_STAGES)
    # with keep_records: the gradient sample of each stage served (as `served_by`), of the first
    # MAX_SAMPLED_STAGES of them
    grad_samples: list[Annotated[list[float], Field(max_length=GRAD_SAMPLE_SIZE)]] = Field(
        default_factory=list, max_length=MAX_SAMPLED_STAGES
    )
    # the optimizer steps each `served_by` peer's parameters had taken at its forward (the same order)
    steps_done: list[Annotated[int, Field(ge=0, le=MAX_STEPS)]] = Field(
        default_factory=list, max_length=MAX_CHAIN_STAGES
    )

    def samples_problem(self) -> str | None:
        """Why an answer of a chain that keeps records lacks a gradient sample it owes (one per
        stage served, up to MAX_SAMPLED_STAGES, each non-empty and finite), or None."""
        owed = min(len(self.served_by), MAX_SAMPLED_STAGES)
        if len(self.grad_samples) != owed:
            return f"it carries {len(self.grad_samples)} gradient samples for {owed} stages"
        if not all(sample and all(math.isfinite(v) for v in sample) for sample in self.grad_samples):
            return "a gradient sample is empty or holds NaN or inf"
        return None


class HopRecordRequest(BaseModel):
    """A trainer asks a peer what crossed one of its chain's hops for microbatch `microbatch_id`:
    the activations it `received` from the stage before, or `sent` to the stage after, the gradient
    it `grad_received` from the stage after, or `grad_sent` back to the stage before, as they
    crossed the wire (peers/serving/hop_records.py). Answered with a `ResponseHeader` and that
    tensor, named after the side, or an error; only to the trainer that drove the chain."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    microbatch_id: str = Field(min_length=1, max_length=128)
    side: Literal["received", "sent", "grad_received", "grad_sent"]
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)


class CommitRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    step_id: str = Field(min_length=1, max_length=128)
    group_size: int = Field(ge=1, le=4096, description="replicas of this stage the trainer commits to")
    # sync averaging: samples the trainer saw each replica (peer id) of the stage serve in this step;
    # a replica's weight in the round is capped at its count (empty: no caps)
    samples: dict[str, int] = Field(default_factory=dict, max_length=4096)
    # the caller's credential for the run (dht/authority.py), when the peer's run has an authority
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    # sync averaging, a repair: this replica missed a round that the replica with this peer id
    # completed (so that replica's update holds this one's gradients); drop the accumulated gradients
    # and load that replica's state instead of averaging
    catch_up_from: str | None = Field(default=None, min_length=1, max_length=128)
    # ... the steps that replica had done when the trainer saw it: a replica that has done as many
    # does nothing (a round since, or another trainer's repair, got it there already)
    catch_up_to: int | None = Field(default=None, ge=0)
    # ... whether its accumulated gradients are in that replica's update (a round that failed on this
    # side only) and are dropped; otherwise (it fell behind without taking part) they are kept
    catch_up_drops_gradients: bool = True
    # ... outer rounds: the rounds that replica had applied; a replica that has applied as many does nothing
    catch_up_rounds: int | None = Field(default=None, ge=0)
    # exact sync over gloo: the rendezvous ("ip:port") of the round's leader, the first of the named
    # replicas by peer id (peers/replicas/gloo_allreduce.py); None: hivemind's averager
    gloo_rendezvous: str | None = Field(default=None, max_length=64, pattern=r"^[0-9.]+:[0-9]+$")
    # exact sync by fetching each other's gradients over the replicas' own RPC (the data plane, else
    # p2pd; peers/replicas/sync_exchange.py), when every named replica announces it; without it (and
    # without a gloo rendezvous): hivemind's averager
    sync_exchange: bool = False
    # sync averaging with a one-step delay (`--sync-delay 1`): the run's steps are over; apply the
    # update still in flight and start no new round (replicas without a delay answer at once)
    flush: bool = False
    # gradient clipping by the global norm (the trainer's --clip-grad-norm), in two phases: "prepare"
    # averages like a plain commit but does not step, answering the averaged gradient's squared norm;
    # "apply" steps on the prepared gradient times `clip_scale` (the same for every stage)
    clip_phase: Literal["prepare", "apply"] | None = None
    clip_scale: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    # the version of the run's spec this step follows (peers/run_spec.py): every replica steps on that
    # version's learning-rate schedule (0: not stated; a replica then follows the latest it knows)
    spec_version: int = Field(default=0, ge=0)


class CommitResponse(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    stepped: bool = False
    averaged: bool = False
    group_size: int = 1
    samples: int = 0
    steps_done: int = 0
    # sync averaging with a one-step delay: this commit's round runs in the background and is applied
    # at the next commit; `stepped`/`averaged` above then tell the outcome of the previous step's round
    pending: bool = False
    # a "prepare" commit that this replica averaged and holds: the averaged gradient's squared norm
    grad_norm_sq: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    # outer rounds: the rounds this replica has applied (all fragments), and a digest of its anchors;
    # replicas of a group that agree answer the same (the trainer repairs one that does not)
    outer_rounds: int = Field(default=0, ge=0)
    anchor: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, max_length=4096)


class StateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    # the caller's credential for the run (dht/authority.py), when the peer's run has an authority
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    # only what the state would be (its steps and digest), none of its bytes: a joiner compares
    # several donors' offers before it downloads one (peers/replicas/donor_choice.py)
    digest_only: bool = False


class StateHeader(BaseModel):
    """Precedes a stage's state: `total_bytes` of checkpoint bytes follow in chunks (none for a
    `digest_only` request)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    total_bytes: int = Field(default=0, ge=0, le=MAX_STATE_BYTES)
    steps_done: int = Field(default=0, ge=0)
    # peers/replicas/donor_choice.py `state_digest` of the state (its content, whatever its bytes)
    digest: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, max_length=4096)


class DataPlaneRequest(BaseModel):
    """A caller asks, over p2pd, how to reach the peer's data plane (wire/data_plane.py)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    # the caller's credential for the run (dht/authority.py): a private run's peer offers its data
    # plane only to callers holding one
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)


class DataPlaneOffer(BaseModel):
    """The peer's data plane, as it tells one caller over p2pd (so bound to the peer's libp2p
    identity): the TCP `port` it listens on (at the host the caller's p2pd reaches it at), the
    SHA-256 `fingerprint` of its TLS certificate, and the `token` that identifies this caller there
    for `expires_in_s` seconds; or `error` (no data plane: the caller stays on p2pd)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    port: int = Field(default=0, ge=0, le=65535)
    fingerprint: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    token: str = Field(default="", max_length=128)
    expires_in_s: float = Field(default=0.0, ge=0.0, le=86400.0)
    error: str | None = Field(default=None, max_length=1024)


class OuterRoundRequest(BaseModel):
    """One replica's pseudo-gradient for one round of its stage's outer rounds (the tensor
    "pseudo_gradient": a fragment's values, 1-D float32, in any codec of the wire)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    fragment: int = Field(ge=0, le=4096)
    begun_after: int = Field(ge=0, description="the local step count the round began after: its key")
    group: str = Field(min_length=1, max_length=64, description="digest of the round's members, as the sender has them")
    anchor: str = Field(min_length=1, max_length=64, description="digest of the sender's anchor of the fragment")
    weight: float = Field(gt=0.0, allow_inf_nan=False, description="samples the sender served in the period")
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    tensors: TensorHeaders = Field(default_factory=dict)  # filled in by wire.messages.write_request


class OuterRoundResponse(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    accepted: bool = False
    error: str | None = Field(default=None, max_length=1024)


class SyncRoundRequest(BaseModel):
    """A replica asks another replica of its stage for its gradient of one commit (exact sync's
    exchange): answered once that replica has the commit, to the replicas the commit names only."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    model: str = Field(max_length=128)
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    step_id: str = Field(min_length=1, max_length=128)
    group: str = Field(min_length=1, max_length=64, description="digest of the commit's replicas and samples")
    credential: str | None = Field(default=None, max_length=MAX_CREDENTIAL_CHARS)
    tensors: TensorHeaders = Field(default_factory=dict)  # none; filled in by wire.messages.write_request


class SyncRoundResponse(BaseModel):
    """The answer: the tensor "gradient" (the replica's mean gradient of the step, 1-D float32), or why not."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    error: str | None = Field(default=None, max_length=1024)
    tensors: TensorHeaders = Field(default_factory=dict)  # filled in by wire.messages.write_response


class ProbeRequest(BaseModel):
    """Precedes `payload_bytes` of payload the peer echoes back."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    payload_bytes: int = Field(ge=0, le=MAX_PROBE_BYTES)


class ProbeResponse(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    payload_bytes: int = Field(default=0, ge=0, le=MAX_PROBE_BYTES)
    error: str | None = Field(default=None, max_length=1024)


# --- header bytes ----------------------------------------------------------------------------------

Header = TypeVar("Header", bound=BaseModel)


def encode_header(header: BaseModel) -> bytes:
    return msgpack.packb(header.model_dump(mode="json"), use_bin_type=True)


def decode_header(cls: type[Header], data: bytes) -> Header:
    """Parse and validate a header received from a peer; ProtocolError on anything malformed."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return cls.model_validate(msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES))
    except (ValidationError, ValueError, TypeError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed {cls.__name__}: {e}") from None
