"""Direct routing (`swarm train --routing direct`) with real processes on loopback: a peer refuses a
chained call for a stage it does not serve, a stage-0 replica killed mid-run loses nothing, a
replica killed while it holds a microbatch mid-hop (forward or backward) loses nothing and no
gradient is added twice, and each hop's sender applies the run's codec.
(One step's exact update against one process: tests/integration/test_correctness.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import signal

import pytest
import torch

from dht.node import NetworkConfig, start_dht
from models.config import get_model_config
from swarm.local_swarm import fault_args
from swarm.trainer.client import ChainCallError, StageClient
from tests.integration.polling import wait_for
from tests.integration.processes import stop_together
from tests.integration.test_correctness import BATCH, MICROBATCH, served_over
from tests.integration.test_replicas import (
    assert_stage0_replicas_took_one_process_step,
    averaging_sample,
    run_trainer,
    scrape,
)
from tests.integration.test_run_authority import CONFIG, Run
from wire.failures import Failure
from wire.tensors import encode_tensor

pytestmark = pytest.mark.slow


def test_a_peer_refuses_a_chained_call_for_a_stage_it_does_not_serve(make_swarm):
    config = get_model_config("tiny")
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    peer = swarm.start_peer(1)
    swarm.wait_online([peer])
    peer_id = re.search(r"peer (\S+) online", peer.log()).group(1)
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)

    async def scenario():
        p2p = await dht.replicate_p2p()
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
        tensors = [("inputs", encode_tensor(tokens)), ("targets", encode_tensor(tokens))]

        async def chain(client: StageClient):
            return await client.train_chain(
                peer_id,
                microbatch_id="m",
                batch_size=2,
                tensors=tensors,
                route=[[peer_id]],
                timeout_s=30.0,
                trainer_id=p2p.peer_id.to_base58(),
            )

        # a chain starts at stage 0; this peer serves stage 1 (asked by the run's own trainer)
        credential = swarm.issue_credential(p2p.peer_id.to_base58())
        with pytest.raises(ChainCallError) as wrong_stage:
            await chain(StageClient(p2p, model="tiny", num_stages=2, credential=credential))
        assert wrong_stage.value.kind == Failure.WRONG_STAGE
        assert "serves stage 1, not stage 0" in str(wrong_stage.value)
        assert (wrong_stage.value.stage, wrong_stage.value.failed_peers) == (0, [peer_id])
        with pytest.raises(ChainCallError) as other_split:  # another split of the model: the caller's bug
            await chain(StageClient(p2p, model="tiny", num_stages=3, credential=credential))
        assert other_split.value.kind == Failure.REFUSED
        assert "split into 2 stages, not tiny in 3" in str(other_split.value)

    try:
        asyncio.run(scenario())
    finally:
        dht.shutdown()
    assert peer.alive


def test_answers_state_the_steps_their_replicas_parameters_had_taken(make_swarm, tmp_path):
    """What a spot check of several trainers compares answers by (swarm/trainer/spot_checks.py,
    `recompute_is_stale`): after a 3-step run, a peer's forward states 3 steps, and a chain's answer
    states each stage's."""
    config = get_model_config("tiny")
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    peers = [swarm.start_peer(0), swarm.start_peer(1)]
    swarm.wait_online(peers)
    run_trainer(swarm, tmp_path, "--steps", "3", "--batch-size", "4", "--microbatch-size", "2")
    first, second = (re.search(r"peer (\S+) online", p.log()).group(1) for p in peers)
    dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)

    async def scenario():
        p2p = await dht.replicate_p2p()
        client = StageClient(
            p2p, model="tiny", num_stages=2, credential=swarm.issue_credential(p2p.peer_id.to_base58())
        )
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
        recompute = await client.exchange(
            first,
            rpc="forward",
            stage=0,
            microbatch_id="m-steps",
            batch_size=2,
            tensors=[("inputs", encode_tensor(tokens))],
            timeout_s=30.0,
            check_precision="fp32",
        )
        chain = await client.train_chain(
            first,
            microbatch_id="m-chain",
            batch_size=2,
            tensors=[("inputs", encode_tensor(tokens)), ("targets", encode_tensor(tokens))],
            route=[[second]],
            timeout_s=30.0,
            trainer_id=p2p.peer_id.to_base58(),
        )
        client.close()
        return recompute.response.steps_done, chain.served_by, chain.steps_done

    try:
        steps, served_by, chain_steps = asyncio.run(scenario())
    finally:
        dht.shutdown()
        stop_together(peers)
    assert steps == 3 and served_by == [first, second] and chain_steps == [3, 3], (steps, chain_steps)


# A stage-0 replica dies mid-run: the trainer drives its microbatches again, from the start, on a new route.
# The kill lands while the replica holds a forward (--faults hold), so a call is in flight when it dies:
# a kill between calls, with the trainer routing to the other replica, forced no failover on main's CI.
# As below, the victim is online first and its partner computes 8x slower, so routes prefer the victim.
def test_sigkill_of_a_stage_0_replica_during_a_direct_run_loses_nothing(make_swarm, tmp_path):
    # As tests/integration/test_failover.py's hub version: routing failover, not averaging.
    swarm = make_swarm(num_stages=2, peer_args=["--target-batch-size", "8", "--lr", "3e-3", "--averaging", "none"])
    swarm.start_bootstrap()
    victim = swarm.start_peer(0, *fault_args(hold="forward", hold_after=6))
    swarm.wait_online([victim])
    others = [swarm.start_peer(0, *fault_args(slowdown=8)), swarm.start_peer(1), swarm.start_peer(1)]
    swarm.wait_online(others)
    report_path = tmp_path / "report.json"
    steps = 12
    trainer = swarm.start_trainer(
        *("--steps", str(steps), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2"),
        *("--refresh-period-s", "1", "--routing", "direct", "--report", str(report_path)),
    )
    wait_for(
        lambda: "injected by --faults hold" in victim.log(),
        180,
        "the stage-0 victim to hold a microbatch",
        while_running=[trainer, victim],
    )
    victim.signal(signal.SIGKILL)
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())
    assert report["completed"] and report["steps"] == steps
    assert report["microbatches_sent"] == steps * 4
    assert report["microbatches_lost"] == 0
    assert report["microbatches_retried"] > 0, "the held microbatch should have failed over"
    assert report["backward_inputs_skipped"] == 0  # no call went through the trainer: every one was chained


# A stage-1 replica of three stages is SIGKILLed at the moment it holds a microbatch (--faults hold):
# forward, with the stage-0 peer's activations received and not yet answered; backward, with the
# stage-2 peer's gradient received, after stage 2 already added that microbatch's gradients. Stage 0
# fails over to the other stage-1 replica, which sends the microbatch to stage 2 again: stage 2
# answers it and, in the backward case, must not add it twice. "hang": the replica holds a forward
# and is never killed; the stage-0 peer's hop times out within the chain's adaptive budget instead.
# Over p2pd (--no-data-plane), every hop crosses in pieces (--hop-piece-kb 4: the activations on the
# call's stream, the targets on a piece stream of their own), so a kill also breaks a call's other
# streams. Over the data plane (wire/data_plane.py), a hop is one call on one TLS connection, and the
# kill breaks that connection mid-call.
@pytest.mark.parametrize(
    ("hold", "transport"),
    [("forward", "p2pd"), ("backward", "p2pd"), ("hang", "p2pd"), ("forward", "direct"), ("backward", "direct")],
)
def test_a_replica_holding_a_microbatch_mid_hop_killed_or_hung_loses_nothing_and_adds_nothing_twice(
    make_swarm, tmp_path, hold, transport
):
    transport_args = ["--no-data-plane"] if transport == "p2pd" else []
    swarm = make_swarm(
        num_stages=3,
        peer_args=[
            *("--target-batch-size", "8", "--lr", "3e-3", "--averaging", "none", "--hop-piece-kb", "4"),
            *transport_args,
        ],
    )
    swarm.start_bootstrap()
    # hang: held after 6 forwards, when the trainer's chain timeout is learned from 5 answered chains
    # (not its 60 s initial value, which the run would otherwise wait out)
    held_after = "6" if hold == "hang" else "3"
    victim = swarm.start_peer(1, *fault_args(hold="forward" if hold == "hang" else hold, hold_after=int(held_after)))
    # The trainer must prefer the victim, or it is sent too few microbatches to hold one. Routes
    # follow the announced speeds, measured at start-up, and a measurement taken under load can come
    # out at a fifth of its partner's (main's CI: 357 against 1,842 samples/s, beside another test
    # worker). So the victim is online before the others start, and its partner computes 8x slower,
    # asleep for the extra time, and announces that.
    swarm.wait_online([victim])
    first, last = swarm.start_peer(0), swarm.start_peer(2)
    other = swarm.start_peer(1, *fault_args(slowdown=8))
    swarm.wait_online([first, other, last])
    report_path = tmp_path / "report.json"
    steps = 8
    trainer = swarm.start_trainer(
        *("--steps", str(steps), "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "3"),
        *("--refresh-period-s", "1", "--routing", "direct", "--report", str(report_path), *transport_args),
    )
    wait_for(
        lambda: "injected by --faults hold" in victim.log(),
        180,
        f"the victim to hold a microbatch ({hold})",
        while_running=[trainer, victim],
    )
    if hold != "hang":
        victim.signal(signal.SIGKILL)
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    report = json.loads(report_path.read_text())
    assert report["completed"] and report["steps"] == steps
    assert report["microbatches_sent"] == steps * 4 and report["microbatches_lost"] == 0
    assert report["microbatches_retried"] > 0, "the held microbatch should have failed over"
    # The only replica of stages 0 and 2 added every sample of the run exactly once.
    for peer in (first, last):
        metrics = scrape(peer)
        assert averaging_sample(metrics, "swarm_peer_samples_accumulated_total") == steps * 8, peer.name
    if hold == "backward":  # stage 2 saw the held microbatch again, and answered without adding it
        assert averaging_sample(scrape(last), "swarm_peer_backward_repeats_total") >= 1
    pieces = averaging_sample(scrape(last), "swarm_peer_requests_total", rpc="chain_piece", stage="2") or 0
    served = {t: served_over(last, t, "train_chain") for t in ("direct", "p2pd")}
    if transport == "p2pd":
        assert pieces >= steps * 4 and served["direct"] == 0, (pieces, served)
    else:  # every hop to stage 2 went direct, but maybe the first of each stage-1 replica (made while it connects)
        assert pieces == 0 and served["p2pd"] <= 2 and sum(served.values()) >= steps * 4, (pieces, served)
        assert report["transports"].get("p2pd", {}).get("calls", 0) <= 4, report["transports"]
    victim.signal(signal.SIGKILL)  # a hung one would wait out the polite stop
    stop_together([first, other, last])


def test_a_run_with_an_authority_trains_through_chains_and_refuses_a_chain_from_an_outsider(make_swarm, tmp_path):
    """The trainer's credential rides along the chain; a peer passing it on shows its own. A stolen
    trainer credential gets an outsider nowhere: as the first caller it is not the trainer it names,
    and as a forwarder it holds no peer credential."""
    run = Run(tmp_path, private=False)
    swarm = make_swarm(num_stages=2)
    swarm.start_bootstrap()
    first = swarm.start_peer(0, *run.args("first", "peer", stage=0))
    last = swarm.start_peer(1, *run.args("last", "peer", stage=1))
    swarm.wait_online([first, last])
    report = run_trainer(
        swarm, tmp_path, "--steps", "1", "--batch-size", "4", "--microbatch-size", "2", "--routing", "direct",
        *run.args("trainer", "trainer"),
    )  # fmt: skip
    assert report["losses"][0] > 0 and report["microbatches_lost"] == 0

    outsider = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
    stolen = (tmp_path / "trainer.cred").read_text().strip()

    async def attacks():
        p2p = await outsider.replicate_p2p()
        thief = StageClient(p2p, model="tiny", num_stages=2, credential=stolen)
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
        refused = {}
        for name, peer, stage, tensors, route in (
            ("first", run.ids["first"], 0, [("inputs", encode_tensor(tokens))], [[run.ids["last"]]]),
            ("forwarded", run.ids["last"], 1, [("inputs", encode_tensor(torch.randn(2, CONFIG.seq_len, CONFIG.d_model)))], []),
        ):  # fmt: skip
            with pytest.raises(ChainCallError) as error:
                await thief.train_chain(
                    peer,
                    microbatch_id="stolen",
                    batch_size=2,
                    tensors=[*tensors, ("targets", encode_tensor(tokens))],
                    route=route,
                    timeout_s=30.0,
                    trainer_id=run.ids["trainer"],
                    stage=stage,
                )
            refused[name] = (error.value.kind, str(error.value))
        return refused

    try:
        refused = asyncio.run(attacks())
    finally:
        outsider.shutdown()
    assert refused["first"][0] == Failure.REFUSED and "called by its trainer" in refused["first"][1]
    assert refused["forwarded"][0] == Failure.REFUSED and "needs a credential" in refused["forwarded"][1]
    assert first.alive and last.alive


@pytest.mark.parametrize("variant", ["", "answers-lost", "hub-timed"])
def test_sync_replicas_fed_by_chains_average_to_the_one_process_step(make_swarm, tmp_path, variant):
    """Two stage-0 replicas each serve part of the batch through chains; the trainer counts what each
    served from the chains' `served_by`, which caps each one's weight in the sync round: counted
    wrong, the averaged step would not be the one-process step. answers-lost: each stage-0 replica
    adds its first chain's gradients and then its stream breaks (--faults lose_answer); the trainer
    drives that chain again along the same route, whose replicas answer without adding it twice.
    hub-timed: half the microbatches go through the trainer (--hub-timing-fraction 0.5), the rest
    through chains, in one step."""
    swarm = make_swarm(num_stages=2, peer_args=["--optimizer", "sgd", "--lr", "0.5", "--averaging", "sync"])
    swarm.start_bootstrap()
    lose_answer = variant == "answers-lost"
    fault = fault_args(lose_answer=1) if lose_answer else []
    timing = ["--hub-timing-fraction", "0.5"] if variant == "hub-timed" else []
    peers = [
        swarm.start_peer(0, "--checkpoint-dir", str(tmp_path / "a"), *fault),
        swarm.start_peer(0, "--checkpoint-dir", str(tmp_path / "b"), *fault),
        swarm.start_peer(1, "--checkpoint-dir", str(tmp_path / "c")),
    ]
    swarm.wait_online(peers)
    report = run_trainer(
        swarm, tmp_path, "--steps", "1", "--batch-size", str(BATCH), "--microbatch-size", str(MICROBATCH),
        "--routing", "direct", *timing,
    )  # fmt: skip
    metrics = [scrape(peer) for peer in peers]
    stop_together(peers)
    assert report["microbatches_lost"] == 0
    hub_timed = report["microbatches_hub_timed"]
    assert (0 < hub_timed < BATCH // MICROBATCH) if timing else (hub_timed == 0), report
    lost = [peer for peer in peers[:2] if "lost the answer to backward call 1" in peer.log()]
    assert report["backward_asked_again"] == len(lost) and (lost or not lose_answer), report
    for stage_metrics in (metrics[:2], metrics[2:]):  # every microbatch added once on each stage
        assert sum(averaging_sample(m, "swarm_peer_samples_accumulated_total") for m in stage_metrics) == BATCH
    assert_stage0_replicas_took_one_process_step(tmp_path)


def _payload(metrics: dict, direction: str) -> dict[str, tuple[float, float]]:
    """A peer's tensor payload by codec: (bytes on the wire, bytes uncompressed)."""
    out = {}
    for (name, labels), value in metrics.items():
        for kind, index in (
            (f"swarm_peer_{direction}_bytes_total", 0),
            (f"swarm_peer_{direction}_uncompressed_bytes_total", 1),
        ):
            if name == kind:
                codec = dict(labels)["codec"]
                pair = list(out.get(codec, (0.0, 0.0)))
                pair[index] = value
                out[codec] = tuple(pair)
    return out


def test_each_hop_is_sent_in_the_runs_codec_by_its_sender(make_swarm, tmp_path):
    """int8, then top-k (gradients with error feedback kept by the replica that answers): the peers
    send their activations and gradients to each other in the run's codec, int8 at about a quarter of
    the float32 bytes, and the runs train without losing a microbatch."""
    swarm = make_swarm(num_stages=2, peer_args=["--target-batch-size", "8"])
    swarm.start_bootstrap()
    peers = [swarm.start_peer(0), swarm.start_peer(1)]
    swarm.wait_online(peers)
    before = [scrape(peer) for peer in peers]
    for codec, fraction in (("int8", None), ("topk", "0.2")):
        extra = ["--topk-fraction", fraction] if fraction else []
        report = run_trainer(
            swarm, tmp_path, "--steps", "2", "--batch-size", "8", "--microbatch-size", "2", "--routing", "direct",
            "--codec", codec, *extra,
        )  # fmt: skip
        assert report["completed"] and report["microbatches_lost"] == 0
        assert all(0 < loss < 20 for loss in report["losses"]), report["losses"]
        after = [scrape(peer) for peer in peers]
        first_sent, last_sent = _payload(after[0], "sent"), _payload(after[1], "sent")
        first_received = _payload(after[0], "received")
        old = _payload(before[0], "sent"), _payload(before[1], "sent")
        # stage 0 sent its activations (and passed the int targets on, uncompressed: 'none');
        # stage 1 answered every gradient: both only in the run's codec
        for sent, earlier in ((first_sent, old[0]), (last_sent, old[1])):
            wire, raw = (sent[codec][i] - earlier.get(codec, (0, 0))[i] for i in (0, 1))
            assert raw > 0, (codec, sent)
            if codec == "int8":
                # 1 byte a value of 4, and a codebook per part, which the tiny model's small tensors make count
                assert 0.25 <= wire / raw < 0.45, (wire, raw)
            else:
                assert wire / raw < 0.2 * 6 / 4 + 0.05, (wire, raw)  # 20% of the values at 6 bytes each
        assert set(last_sent) <= {"int8", "topk"}, last_sent  # the last stage sends nothing else
        assert first_received[codec][0] > 0
        before = after
    stop_together(peers)
