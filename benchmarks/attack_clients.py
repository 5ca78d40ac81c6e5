"""The strangers of `benchmarks/attacks.py` (issue #30): small clients that attack a live swarm's
honest peers until stopped, one kind per process, each with a DHT identity that holds no credential.

    PYTHONPATH=. .venv/bin/python benchmarks/attack_clients.py KIND --initial-peers ... \
        --stage0 PEER_ID --stage1 PEER_ID [PEER_ID ...] --stats FILE

Kinds (each reuses the attack of the integration test that covers it):
- outsider_averaging: asks every stage-1 replica's averager to join its group and to send its state
  (tests/integration/test_run_authority.py), in a loop.
- size_bomb: a backward whose top-k header declares a gigabyte (tests/unit/test_size_bombs.py), then
  one stream message declaring 256 MiB (tests/integration/test_request_bounds.py), to every stage-1
  peer, in a loop.
- junk_subkeys: a raw hivemind node stores 6,000 unsigned 1 kB subkeys under stage 1's key
  (tests/integration/test_dht_floods.py), again every 30 s with fresh expiries.
- junk_rpcs: a stranger's forward with cache to stage 0, backward to every stage-1 peer and commit
  to every peer (tests/integration/test_run_authority.py), in a loop.
Issue #60's:
- forged_state: announces itself a stage-1 replica (no load, 10^6 steps) and serves a forged state
  (every parameter 0.5, tests/integration/test_state_donors.py) to whoever asks.
- foreign_record: announces a stage-0 record of another model fingerprint, renewed.
- periodic_outsider / weight_1e6: an averager of stage 1's parameters (periodic rounds) sending 0.5
  everywhere with weight 1e6; the outsider holds no credential, weight_1e6 is a member (its JOINING
  record carries the peer credential `--credential` holds, for `--identity-path`).
- commit_bomb: a trainer (its credential in `--credential`) commits made-up steps to the stage-1
  replicas naming 4,095 made-up peers.
- commit_flood: a stranger's commits of made-up step ids, as fast as they are answered.
- dht_junk_keys: a raw hivemind node storing 1 kB values under random keys, 500 a request.
- probe_streams: re-opens probe streams to every stage-1 peer that never finish; its second
  identity probes them as an honest peer does and counts echoes answered within 10 s.

Each loop pauses `--pause-s` between rounds (the machine's cores are shared with the swarm: the point
is what a request does to a peer, not how many requests two cores can make). The first round done,
the client writes `--stats` (rounds, calls, and how each call ended by exception type or answer),
and again after every round.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hivemind.p2p import PeerID  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402

from dht.keys import stage_key  # noqa: E402
from dht.node import NetworkConfig, start_dht  # noqa: E402
from models.config import get_model_config  # noqa: E402
from peers.replicas.averaging import averager_prefix  # noqa: E402
from peers.replicas.averaging_members import MemberAverager  # noqa: E402
from swarm.trainer.client import StageClient  # noqa: E402
from tests.integration.test_dht_floods import JUNK_SUBKEYS, _store_junk  # noqa: E402
from tests.integration.test_request_bounds import _aiter, send_one_huge_message, topk_bomb_request  # noqa: E402
from tests.integration.test_run_authority import _call, _commit  # noqa: E402
from wire.bounded_streams import StreamLimits, iterate_bounded  # noqa: E402
from wire.messages import read_response  # noqa: E402
from wire.protocol import RPC_BACKWARD, ResponseHeader  # noqa: E402


async def _outcome(counts: Counter, what: str, call) -> None:
    """Await `call`, counting how it ended: 'ok', an error text's start, or the exception's type."""
    try:
        result = await asyncio.wait_for(call, timeout=60)
        error = getattr(result, "error", None)
        counts[f"{what}: {'refused: ' + error[:60] if error else 'answered'}"] += 1
    except Exception as e:  # every refusal is an exception of the client's own
        counts[f"{what}: {type(e).__name__}: {str(e)[:60]}"] += 1


async def _join_and_download(p2p, peer_id: str, stage: int) -> str:
    """Ask a replica's averager to let us join its group (with a huge weight) and to send its state."""
    stub = MemberAverager.get_stub(
        p2p, PeerID.from_base58(peer_id), namespace=averager_prefix("tiny", stage, 2, "grad")
    )
    join = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=time.time() + 30, gather=b"")
    codes = [averaging_pb2.MessageCode.Name(m.code) async for m in await stub.rpc_join_group(join)]
    state = [part async for part in await stub.rpc_download_state(averaging_pb2.DownloadRequest())]
    return f"join {'/'.join(codes) or 'no answer'}, state parts {len(state)}"


async def one_round(kind: str, p2p, client, args, counts: Counter, state: dict) -> None:
    config = get_model_config("tiny")
    if kind == "outsider_averaging":
        for peer_id in args.stage1:
            text = await _join_and_download(p2p, peer_id, 1)
            counts[f"averaging: {text}"] += 1
    elif kind == "size_bomb":
        for peer_id in args.stage1:
            stream = await iterate_bounded(
                p2p,
                PeerID.from_base58(peer_id),
                RPC_BACKWARD,
                _aiter(topk_bomb_request(config)),
                _response_type(),
                StreamLimits(),
            )
            error = (await read_response(stream, ResponseHeader)).header.error
            counts[f"topk bomb: {'refused: ' + error[:70] if error else 'NOT refused'}"] += 1
            await send_one_huge_message(p2p, PeerID.from_base58(peer_id))  # returns when the peer closes
            counts["256 MiB message streamed until the peer closed the stream"] += 1
    elif kind == "junk_subkeys":
        if time.monotonic() - state.get("flooded_at", -1e9) >= 30:
            from hivemind.utils import get_dht_time

            junk = functools.partial(
                _store_junk, key=stage_key("tiny", 1), count=JUNK_SUBKEYS, expires=get_dht_time() + 300
            )
            held = await asyncio.get_running_loop().run_in_executor(None, state["raw"].run_coroutine, junk)
            counts[f"flood of {JUNK_SUBKEYS} junk subkeys (attacker holds {held})"] += 1
            state["flooded_at"] = time.monotonic()
    elif kind in ISSUE_60_KINDS:
        await ISSUE_60_KINDS[kind](p2p, args, counts, state)
    elif kind == "junk_rpcs":
        await _outcome(counts, "forward with cache, stage 0", _call(client, args.stage0, "forward", 0))
        for peer_id in args.stage1:
            await _outcome(counts, "backward, stage 1", _call(client, peer_id, "backward", 1))
        for peer_id in [args.stage0, *args.stage1]:
            await _outcome(counts, "commit", _commit(p2p, peer_id))
    else:
        raise ValueError(f"unknown attack {kind!r}")


def _response_type():
    from hivemind.proto import runtime_pb2

    return runtime_pb2.ExpertResponse


# --- issue #60's attacks --------------------------------------------------------------------------


def _stage1_record(p2p, **fields):
    from hivemind.utils import get_dht_time

    from dht.records import PeerRecord, PeerState

    return PeerRecord(
        peer_id=p2p.peer_id.to_base58(),
        model="tiny",
        stage=fields.pop("stage", 1),
        num_stages=2,
        state=fields.pop("state", PeerState.ONLINE),
        throughput=fields.pop("throughput", 1.0),
        expires_at=get_dht_time() + 120,
        **fields,
    )


async def _announce_every(state: dict, dht, record, period_s: float = 30.0) -> None:
    from dht.announce import announce

    if time.monotonic() - state.get("announced_at", -1e9) >= period_s:
        await announce(dht, record)
        state["announced_at"] = time.monotonic()


async def forged_state(p2p, args, counts, state) -> None:
    from hivemind.proto import runtime_pb2

    from tests.integration.test_state_donors import FORGED_STEPS
    from wire.bounded_streams import serve_bounded
    from wire.messages import write_state
    from wire.protocol import RPC_STATE, StateHeader

    if "forged" not in state:
        data = _forged_stage_state(1)
        state["forged"] = data

        async def serve(request, context):
            counts["forged state sent"] += 1
            for message in write_state(StateHeader(total_bytes=len(data), steps_done=FORGED_STEPS), data):
                yield message

        await serve_bounded(p2p, RPC_STATE, serve, runtime_pb2.ExpertRequest, StreamLimits(), stream_input=False)
    record = _stage1_record(p2p, load=0.0, averaging="sync", steps_done=FORGED_STEPS, throughput=100.0)
    await _announce_every(state, state["dht"], record)


def _forged_stage_state(stage: int) -> bytes:
    import dataclasses

    import torch

    from peers.compute.checkpoint import serialize_state
    from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
    from peers.replicas.state_transfer import snapshot_state
    from tests.integration.test_state_donors import FORGED_STEPS

    runtime = StageRuntime(get_model_config("tiny"), stage, 2, optimizer=OptimizerSettings())
    with torch.no_grad():
        for param in runtime.module.parameters():
            param.fill_(0.5)
    meta, module_state, optimizer_state = snapshot_state(runtime, "tiny")
    return serialize_state(dataclasses.replace(meta, steps_done=FORGED_STEPS), module_state, optimizer_state)


async def foreign_record(p2p, args, counts, state) -> None:
    record = _stage1_record(p2p, stage=0, model_hash="f" * 16, throughput=1e6)
    await _announce_every(state, state["dht"], record)
    counts["foreign record announced"] = 1


async def periodic_liar(p2p, args, counts, state) -> None:
    """An averager of stage 1's parameters that sends 0.5 with weight 1e6, round after round."""
    if "averager" not in state:
        import torch

        from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
        from peers.replicas.averaging_members import MemberAverager

        runtime = StageRuntime(get_model_config("tiny"), 1, 2, optimizer=OptimizerSettings())
        size = sum(p.numel() for p in runtime.params)
        state["averager"] = MemberAverager(
            [torch.full((size,), 0.5)],
            state["dht"],
            prefix=averager_prefix("tiny", 1, 2, "params"),
            start=True,
            min_matchmaking_time=0.5,
            request_timeout=0.25,
            target_group_size=2,
            min_group_size=2,
            allreduce_timeout=10.0,
        )
    if args.credential:  # a member: its record carries the credential (JOINING: no trainer routes to it)
        from dht.records import PeerState

        credential = open(args.credential).read().strip()
        record = _stage1_record(p2p, state=PeerState.JOINING, averaging="periodic", credential=credential)
        await _announce_every(state, state["dht"], record, period_s=20.0)
    averager = state["averager"]
    with averager.get_tensors() as (tensor,):
        tensor.fill_(0.5)  # a round's average was written into it: lie again
    control = averager.step(weight=1e6, gather=1e6, wait=False, timeout=10.0, allow_retries=False)
    try:
        gathered = await asyncio.get_running_loop().run_in_executor(None, control.result, 15.0)
        counts[f"round with {len(gathered) - 1} honest replica(s)" if gathered else "no round"] += 1
    except Exception as e:  # the members refuse it: what we expect of a stranger
        counts[f"round failed: {type(e).__name__}"] += 1


async def _commit_to(
    p2p, peer_id: str, *, stage: int, step_id: str, samples: dict, credential: str | None, group_size: int | None = None
):
    from hivemind.proto import runtime_pb2

    from wire.messages import read_unary, unary_request
    from wire.protocol import RPC_COMMIT, CommitRequest, CommitResponse

    request = CommitRequest(
        model="tiny",
        stage=stage,
        num_stages=2,
        step_id=step_id,
        group_size=group_size or max(len(samples), 1),
        samples=samples,
        credential=credential,
    )
    reply = await p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), RPC_COMMIT, unary_request(request), runtime_pb2.ExpertResponse
    )
    return read_unary(reply, CommitResponse)


async def commit_bomb(p2p, args, counts, state) -> None:
    """Commits declaring a group of 4,096 replicas (before: the round waited for them on stage 1's compute
    thread until its timeout, 30 s); `--credential`: a trainer's, else a stranger's (refused)."""
    credential = open(args.credential).read().strip() if args.credential else None
    for peer_id in args.stage1:
        state["n"] = state.get("n", 0) + 1
        step_id, me = f"bomb:{state['n']}", p2p.peer_id.to_base58()
        call = _commit_to(
            p2p, peer_id, stage=1, step_id=step_id, samples={me: 1}, credential=credential, group_size=4096
        )
        await _outcome(counts, "commit declaring 4,096 replicas", call)


def _made_up_peer_ids(count: int) -> list[str]:
    import hashlib

    import base58

    # the multihash of sha256 digests: valid peer ids nobody holds
    return [base58.b58encode(b"\x12\x20" + hashlib.sha256(str(n).encode()).digest()).decode() for n in range(count)]


async def commit_flood(p2p, args, counts, state) -> None:
    me = p2p.peer_id.to_base58()
    for stage, peer_id in [(0, args.stage0), *((1, p) for p in args.stage1)]:
        for _ in range(5):
            step_id = f"flood:{time.monotonic_ns()}"
            call = _commit_to(p2p, peer_id, stage=stage, step_id=step_id, samples={me: 10**9}, credential=None)
            await _outcome(counts, "commit", call)


async def _store_random_keys(dht, node, *, count: int = 500) -> int:
    """Store `count` 1 kB values under random keys (at the nearest nodes); how many were stored."""
    from hivemind.utils import get_dht_time

    keys = [os.urandom(16).hex() for _ in range(count)]
    results = await node.store_many(keys, [b"x" * 1000] * len(keys), [get_dht_time() + 600] * len(keys))
    return sum(bool(ok) for ok in results.values())


async def dht_junk_keys(p2p, args, counts, state) -> None:
    raw = state["raw"]
    stored = await asyncio.get_running_loop().run_in_executor(None, raw.run_coroutine, _store_random_keys)
    counts["junk values stored somewhere"] += stored
    counts["junk values sent"] += 500


async def probe_streams(p2p, args, counts, state) -> None:
    from hivemind.proto import runtime_pb2

    from peers.placement.link_probe import echo
    from wire.messages import request_messages
    from wire.protocol import ProbeRequest

    async def trickle():  # a probe that never finishes: its header, then nothing
        for message in request_messages(ProbeRequest(payload_bytes=1 << 20), []):
            yield message
        await asyncio.sleep(3600)

    for peer_id in args.stage1:  # the stuck streams, re-opened every round
        stuck = state.setdefault("stuck", [])
        stuck.append(
            asyncio.ensure_future(
                p2p.iterate_protobuf_handler(
                    PeerID.from_base58(peer_id), "probe", trickle(), runtime_pb2.ExpertResponse
                )
            )
        )
        if len(stuck) > 4 * len(args.stage1):  # a few stuck at a time, re-opened as older ones are dropped
            stuck.pop(0).cancel()
    honest = await state["honest"].replicate_p2p()
    for peer_id in args.stage1:
        try:
            await asyncio.wait_for(echo(honest, peer_id, 64), timeout=10.0)
            counts["honest echo answered within 10 s"] += 1
        except Exception as e:
            counts[f"honest echo not answered: {type(e).__name__}"] += 1


ISSUE_60_KINDS = {
    "forged_state": forged_state,
    "foreign_record": foreign_record,
    "periodic_outsider": periodic_liar,
    "weight_1e6": periodic_liar,
    "commit_bomb": commit_bomb,
    "commit_flood": commit_flood,
    "dht_junk_keys": dht_junk_keys,
    "probe_streams": probe_streams,
}


async def attack(args) -> None:
    if args.kind in ("forged_state", "foreign_record", "weight_1e6") or args.identity_path:
        network = NetworkConfig(initial_peers=args.initial_peers, identity_path=args.identity_path)
        dht = start_dht(network, client_mode=args.kind not in ("forged_state", "weight_1e6", "periodic_outsider"))
    else:
        dht = start_dht(NetworkConfig(initial_peers=args.initial_peers), client_mode=args.kind != "periodic_outsider")
    state: dict = {"dht": dht}
    if args.kind in ("junk_subkeys", "dht_junk_keys"):
        import hivemind

        state["raw"] = hivemind.DHT(initial_peers=args.initial_peers, start=True)  # no validators of its own
    if args.kind == "probe_streams":
        state["honest"] = start_dht(NetworkConfig(initial_peers=args.initial_peers), client_mode=True)
    p2p = await dht.replicate_p2p()
    client = StageClient(p2p, model="tiny", num_stages=2)
    counts: Counter = Counter()
    rounds = 0
    while True:
        try:
            await one_round(args.kind, p2p, client, args, counts, state)
        except Exception as e:
            counts[f"round failed: {type(e).__name__}: {str(e)[:80]}"] += 1
        rounds += 1
        with open(args.stats + ".tmp", "w") as f:
            json.dump({"kind": args.kind, "rounds": rounds, "outcomes": dict(counts)}, f)
        os.replace(args.stats + ".tmp", args.stats)
        await asyncio.sleep(args.pause_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "kind", choices=["outsider_averaging", "size_bomb", "junk_subkeys", "junk_rpcs", *ISSUE_60_KINDS]
    )
    parser.add_argument("--identity-path", default=None, help="the client's identity (a member's, with --credential)")
    parser.add_argument("--credential", default=None, help="a credential file of the run, for --identity-path")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--stage0", required=True)
    parser.add_argument("--stage1", nargs="+", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--pause-s", type=float, default=0.2)
    asyncio.run(attack(parser.parse_args()))


if __name__ == "__main__":
    main()
