"""A run with an authority (issue #30): only holders of the owner's credentials change the weights
(an open run) or take part at all (a private run); outsiders are refused every gradient- or
state-affecting call and cannot join the replicas' averaging."""

from __future__ import annotations

import asyncio

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from dht.authority import create_run, issue, load_owner_key, write_credential
from dht.node import NetworkConfig, start_dht
from dht.signing import load_identity, new_identity_file
from models.config import get_model_config
from peers.placement.link_probe import echo
from peers.replicas.averaging import averager_prefix
from peers.replicas.averaging_members import MemberAverager
from swarm.trainer.client import PeerCallError, StageClient
from tests.integration.test_replicas import averaging_sample, run_trainer, scrape
from wire.failures import Failure
from wire.messages import read_state, read_unary, unary_request
from wire.protocol import RPC_COMMIT, RPC_STATE, CommitRequest, CommitResponse, ProtocolError, StateRequest
from wire.tensors import encode_tensor

pytestmark = pytest.mark.slow

CONFIG = get_model_config("tiny")


class Run:
    """A run's owner in a folder: identities for named processes, and their credentials."""

    def __init__(self, root, *, private: bool):
        self.root = root
        self.info = create_run(str(root / "run"), private=private)
        self.owner = load_owner_key(str(root / "run"), self.info)
        self.ids: dict[str, str] = {}

    def identity(self, name: str) -> str:
        path = str(self.root / f"{name}.key")
        new_identity_file(path)
        self.ids[name] = load_identity(path).peer_id
        return path

    def credential(self, name: str, role: str, stage: int | None = None) -> str:
        path = str(self.root / f"{name}.cred")
        signed = issue(self.owner, self.info, role=role, peer_id=self.ids[name], stage=stage, valid_for_s=3600)
        write_credential(path, signed)
        return path

    @property
    def public(self) -> str:
        """The run's public file alone (no owner key beside it: a process given it issues itself nothing)."""
        folder = self.root / "public-run"
        folder.mkdir(exist_ok=True)
        (folder / "run.json").write_text((self.root / "run" / "run.json").read_text())
        return str(folder / "run.json")

    def args(self, name: str, role: str, stage: int | None = None) -> list[str]:
        identity = self.identity(name)
        credential = self.credential(name, role, stage)
        return ["--identity-path", identity, "--run", str(self.root / "run"), "--credential", credential]


def _tensors(stage: int):
    batch = 2
    inputs = (
        torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.seq_len))
        if stage == 0
        else torch.randn(batch, CONFIG.seq_len, CONFIG.d_model)
    )
    tensors = [("inputs", encode_tensor(inputs))]
    if stage == 1:
        tensors.append(("targets", encode_tensor(torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.seq_len)))))
    else:
        tensors.append(("grad_outputs", encode_tensor(torch.randn(batch, CONFIG.seq_len, CONFIG.d_model))))
    return tensors


async def _call(client: StageClient, peer_id: str, rpc: str, stage: int, *, evaluate: bool = False):
    """The peer's answer to one forward or backward. An answer lost in transit is asked for again
    (twice at most): under load p2pd can lose a stream's last message as the peer closes it (seen
    here as "empty stream: closed before any message" instead of the refusal); what these tests
    check is what the peer answers, not the transport."""
    tensors = _tensors(stage)
    if rpc == "forward":
        tensors = tensors[:1] if stage == 0 else tensors
    for attempt in range(3):
        try:
            result = await client.exchange(
                peer_id,
                rpc=rpc,
                stage=stage,
                microbatch_id="attack",
                batch_size=2,
                tensors=tensors,
                timeout_s=60,
                evaluate=evaluate,
            )
            return result.response
        except PeerCallError as e:
            if e.kind is not Failure.TRANSPORT or "empty stream" not in str(e) or attempt == 2:
                raise


async def _commit(p2p, peer_id: str, credential: str | None = None) -> CommitResponse:
    message = unary_request(
        CommitRequest(
            model="tiny",
            stage=0,
            num_stages=2,
            step_id="attack:0",
            group_size=2,
            samples={p2p.peer_id.to_base58(): 10**9},
            credential=credential,
        )
    )
    reply = await p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), RPC_COMMIT, message, runtime_pb2.ExpertResponse
    )
    return read_unary(reply, CommitResponse)


async def _state_error(p2p, peer_id: str) -> str:
    """Why the replica refused to send us its state (the test fails if it sent it)."""
    request = unary_request(StateRequest(model="tiny", stage=0, num_stages=2))
    stream = await p2p.iterate_protobuf_handler(
        PeerID.from_base58(peer_id), RPC_STATE, request, runtime_pb2.ExpertResponse
    )
    with pytest.raises(ProtocolError) as refused:
        await read_state(stream, sender=peer_id)
    return str(refused.value)


async def _join_averaging(p2p, peer_id: str):
    """Ask a stage-0 replica's averager to let us into its group, and to send us its state."""
    stub = MemberAverager.get_stub(p2p, PeerID.from_base58(peer_id), namespace=averager_prefix("tiny", 0, 2, "grad"))
    join = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=0.0, gather=b"")
    codes = [message.code async for message in await stub.rpc_join_group(join)]
    state = [part async for part in await stub.rpc_download_state(averaging_pb2.DownloadRequest())]
    return codes, state


def test_a_private_run_refuses_an_outsider_every_call_that_touches_the_weights(make_swarm, tmp_path, swarm_cli):
    run = Run(tmp_path, private=True)
    # direct routing's hops in pieces (--hop-piece-kb 4: the targets on a stream of their own); a
    # piece's stream carries no credential, and the call that takes it is authorized. Pieces exist on
    # p2pd only (a data plane hop is one call), so the peers keep to p2pd here.
    swarm = make_swarm(num_stages=2, peer_args=["--hop-piece-kb", "4", "--no-data-plane"])
    swarm.start_bootstrap()
    first = swarm.start_peer(0, *run.args("first", "peer", stage=0))
    last = swarm.start_peer(1, *run.args("last", "peer", stage=1))
    swarm.wait_online([first, last])
    trainer_args = run.args("trainer", "trainer")
    report = run_trainer(swarm, tmp_path, "--steps", "1", "--batch-size", "4", "--microbatch-size", "2", *trainer_args)
    assert report["losses"][0] > 0  # the run's own trainer trains
    assert report["microbatches_retried"] == 0, report  # no piece was refused
    assert averaging_sample(scrape(last), "swarm_peer_requests_total", rpc="chain_piece", stage="1") >= 2

    outsider = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    stolen = (tmp_path / "trainer.cred").read_text().strip()

    async def attacks():
        p2p = await outsider.replicate_p2p()
        client = StageClient(p2p, model="tiny", num_stages=2)
        refused = {}
        for rpc, stage, evaluate in (("forward", 0, False), ("backward", 1, False), ("forward", 1, True)):
            with pytest.raises(PeerCallError) as error:
                await _call(client, run.ids["first" if stage == 0 else "last"], rpc, stage, evaluate=evaluate)
            refused[f"{rpc}{' eval' if evaluate else ''}"] = str(error.value)
        thief = StageClient(p2p, model="tiny", num_stages=2, credential=stolen)  # a copied credential
        with pytest.raises(PeerCallError) as error:
            await _call(thief, run.ids["last"], "backward", 1)
        refused["stolen"] = str(error.value)
        refused["commit"] = (await _commit(p2p, run.ids["first"], credential=stolen)).error
        refused["state"] = await _state_error(p2p, run.ids["first"])
        refused["averaging"] = await _join_averaging(p2p, run.ids["first"])
        with pytest.raises(ProtocolError) as error:  # an RPC without a credential field: a link probe
            await echo(p2p, run.ids["last"], 1024)
        refused["probe"] = str(error.value)
        return refused

    try:
        refused = asyncio.run(attacks())
    finally:
        outsider.shutdown()
    for what in ("forward", "backward", "forward eval", "state"):
        assert "not authorized" in refused[what] and "needs a credential" in refused[what], (what, refused[what])
    assert "issued to peer" in refused["stolen"] and "issued to peer" in refused["commit"]
    assert "presented no credential" in refused["probe"]
    codes, state = refused["averaging"]
    assert codes == [averaging_pb2.PROTOCOL_VIOLATION] and state == []
    # The run's trainer identity (its process has exited) exports the model from the live peers.
    export = swarm_cli(
        "export", "--initial-peers", *swarm.initial_peers, "--model", "tiny", "--out", str(tmp_path / "exported"),
        *trainer_args[:2], "--run", str(tmp_path / "run"), "--credential", str(tmp_path / "trainer.cred"),
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "exported" / "config.json").is_file()
    assert first.alive and last.alive


def test_an_open_run_lets_anyone_serve_but_only_its_trainers_change_weights(make_swarm, tmp_path):
    """Two credentialed replicas of stage 0 average (sync) with each other; stage 1 is served by a
    peer without a credential (an open run allows it). An outsider may evaluate, never train."""
    run = Run(tmp_path, private=False)
    swarm = make_swarm(num_stages=2, peer_args=["--optimizer", "sgd", "--lr", "0.5"])
    swarm.start_bootstrap()
    replicas = [swarm.start_peer(0, *run.args(name, "peer", stage=0)) for name in ("a", "b")]
    anyone = swarm.start_peer(1, "--run", run.public)  # the run's public file: no credential
    swarm.wait_online([*replicas, anyone])
    report = run_trainer(
        swarm, tmp_path, "--steps", "2", "--batch-size", "4", "--microbatch-size", "2", *run.args("trainer", "trainer")
    )
    assert report["losses"][0] > 0
    for replica in replicas:  # the credentialed replicas let each other into their rounds
        rounds = averaging_sample(scrape(replica), "swarm_peer_averaging_rounds_total", mode="sync", result="ok") or 0
        # one round per step; a replica that lost part of one (under load) loads its partner's state instead
        assert 2 - report["replica_catch_ups"] <= rounds <= 2 and rounds >= 1, replica.log()[-3000:]

    outsider = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)

    async def attacks():
        p2p = await outsider.replicate_p2p()
        client = StageClient(p2p, model="tiny", num_stages=2)
        evaluated = await _call(client, run.ids["a"], "forward", 0, evaluate=True)
        refused = {}
        for rpc, stage, peer_id in (("forward", 0, run.ids["a"]), ("backward", 0, run.ids["b"])):
            with pytest.raises(PeerCallError) as error:
                await _call(client, peer_id, rpc, stage)
            refused[rpc] = str(error.value)
        refused["commit"] = (await _commit(p2p, run.ids["a"])).error
        refused["state"] = await _state_error(p2p, run.ids["a"])
        refused["averaging"] = await _join_averaging(p2p, run.ids["b"])
        return evaluated, refused

    try:
        evaluated, refused = asyncio.run(attacks())
    finally:
        outsider.shutdown()
    assert evaluated.error is None  # evaluation changes nothing: open to anyone
    for what in ("forward", "backward", "commit", "state"):
        assert "not authorized" in refused[what], (what, refused[what])
    assert refused["averaging"] == ([averaging_pb2.PROTOCOL_VIOLATION], [])


def test_a_replica_that_claims_a_huge_weight_counts_no_more_than_it_served():
    """Two real averagers on loopback; one declares a weight of 1e9 for a step in which the
    trainer saw each replica serve 4 samples: the average is the plain mean, not its value."""
    first = hivemind.DHT(start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True)
    averagers = [
        MemberAverager(
            [torch.full((8,), value)],
            dht,
            prefix="weight_caps",
            start=True,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            target_group_size=2,
            min_group_size=2,
        )
        for value, dht in ((0.0, first), (10.0, second))
    ]
    try:
        caps = {dht.peer_id.to_base58(): 4 for dht in (first, second)}
        for averager in averagers:
            averager.set_weight_caps(caps)
        controls = [
            averager.step(weight=weight, wait=False, timeout=30) for averager, weight in zip(averagers, (4.0, 1e9))
        ]
        assert all(control.result(timeout=60) is not None for control in controls)
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                torch.testing.assert_close(tensor, torch.full((8,), 5.0))  # uncapped: 10 (measured)
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()


def test_members_average_together_when_an_outsider_leads_the_stage_key():
    """A peer without a credential (an open run lets it serve) declares itself the first leader under
    the stage's group key: the two members never join its group, and average with each other."""
    from hivemind.utils import get_dht_time

    first = hivemind.DHT(start=True)
    dhts = [first, *(hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True) for _ in range(2))]
    ids = [dht.peer_id.to_base58() for dht in dhts]
    averagers = [
        MemberAverager(
            [torch.full((8,), value)],
            dht,
            members=members,
            prefix="outsider_leads",
            start=True,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            target_group_size=3,  # the trainer counted the outsider as a replica of the stage
            min_group_size=2,
        )
        for value, dht, members in ((0.0, dhts[0], {ids[1]}), (10.0, dhts[1], {ids[0]}), (99.0, dhts[2], None))
    ]
    try:
        now = get_dht_time()
        # the outsider's round is due first: it is every follower's first choice of leader. No retries:
        # a member that joined the outsider's group abandons it, and its step fails.
        controls = [
            averager.step(scheduled_time=now + due, wait=False, timeout=30, allow_retries=False)
            for averager, due in zip(averagers, (4.0, 4.0, 2.0))
        ]
        results = [control.result(timeout=60) if i < 2 else None for i, control in enumerate(controls)]
        assert all(result is not None for result in results[:2]), results
        for averager in averagers[:2]:
            with averager.get_tensors() as (tensor,):
                torch.testing.assert_close(tensor, torch.full((8,), 5.0))
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()
