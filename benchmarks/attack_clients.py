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


async def attack(args) -> None:
    dht = start_dht(NetworkConfig(initial_peers=args.initial_peers), client_mode=True)
    state: dict = {}
    if args.kind == "junk_subkeys":
        import hivemind

        state["raw"] = hivemind.DHT(initial_peers=args.initial_peers, start=True)  # no validators of its own
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
    parser.add_argument("kind", choices=["outsider_averaging", "size_bomb", "junk_subkeys", "junk_rpcs"])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--stage0", required=True)
    parser.add_argument("--stage1", nargs="+", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--pause-s", type=float, default=0.2)
    asyncio.run(attack(parser.parse_args()))


if __name__ == "__main__":
    main()
