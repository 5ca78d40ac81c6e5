"""How fast one emulated WAN link carries a step's activations through p2pd, sent the ways a peer
could send them, against the raw-TCP rate of the same link (issue #23: direct routing's links ran at
about 80% of their shaped rate while the probe's TCP got 96%).

Two hosts of a topology (`--src` and `--dst`, by default world4's stage0 -> stage1, Tokyo -> Oregon:
96 ms, 17.4 Mbit/s), each in its own network namespace (`benchmarks.netem`); a real p2pd daemon in
each (hivemind's P2P). The receiver reads every message of a stream and answers it with one small
message, or, with `--answer-bytes`, with as many bytes as the stream brought (up to that many), its
answers sent in turn: then the link's other direction carries the gradients, as a pipeline's does.
Each round sends `--messages` messages of `--bytes` (a `small` microbatch of 4 is 524,288 bytes of
fp32 activations) in these ways (`--way` picks some), in an order that turns each round:

  in turn                one stream per message, the streams written one at a time (`LinkTurns`:
                         what direct routing's peers do), all started at once
  at once                one stream per message, all written at once
  one stream             every message on one stream
  in turn, parts         as "in turn", each message sent as 4 messages of a quarter
  in turn, parts, early  as "in turn, parts", but a stream's turn ends before its last part is
                         written (so the next stream's first parts follow it closely)
  warm stream            every message on one stream kept open for the whole run (and warmed by
                         two rounds' worth before the first), answered one by one as they arrive:
                         what a kept stream (`wire.bounded_streams.StreamPool`) gives a peer
  in turn, split 2       each message cut in 2 pieces, each piece on a fresh stream of its own,
                         the pieces written at once; the messages take turns (the next message's
                         pieces wait until every piece of this one was written)
  in turn, split 4       the same with 4 pieces: a piece of 128 KiB stays under a fresh stream's
                         flow-control window (256 KiB), so no piece waits for a window update
  kept streams, in turn  a stream per message, kept open from round to round (never warmed on
                         purpose), the messages written in turn: what a peer's kept streams carry
                         for one step's microbatches to one next replica (`--way` runs it alone, for
                         many rounds, to see whether its pace changes as the streams age)

and reports, per way, the seconds from the first write to the last answer (one one-way delay
after the last byte arrives), the payload rate, that rate against the shaped rate and against the
raw-TCP probe's, and when the first message's answer came (what lets a pipeline's next hop start).

    sudo PYTHONPATH=. .venv/bin/python benchmarks/link_streams.py --rounds 3 --out benchmarks/out/link_streams.json
    sudo PYTHONPATH=. .venv/bin/python benchmarks/link_streams.py --rounds 5 --answer-bytes 524288

Needs root (namespaces, tc, iptables); says so and exits otherwise. What it does not show: answers
that come later than at once (a pipeline's gradients come after the stages below computed), and
the other links of the topology.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hivemind.p2p import P2P, PeerID  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

from benchmarks.netem.network import REPO_ROOT, EmulatedNetwork, NetemError, missing_requirements  # noqa: E402
from benchmarks.netem.probe import probe_link  # noqa: E402
from benchmarks.netem.topology import load_topology  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from peers.serving.link_turns import LinkTurns  # noqa: E402
from wire.bounded_streams import StreamLimits, iterate_bounded, serve_bounded  # noqa: E402

RPC = "link_streams.sink"
SERVER_PORT = 41000
LIMITS = StreamLimits(read_timeout_s=120.0)
WAYS = (
    "in turn",
    "at once",
    "one stream",
    "in turn, parts",
    "in turn, parts, early",
    "warm stream",
    "in turn, split 2",
    "in turn, split 4",
    "kept streams, in turn",
)
ECHO = "link_streams.echo"
PARTS = 4


# --- the two ends, each in its host's namespace -----------------------------------------------------
async def serve(listen: str, maddrs_file: str, answer_bytes: int) -> None:
    server = await P2P.create(host_maddrs=[listen])
    turn = asyncio.Lock()  # the server's answers take turns on the link back

    async def sink(requests, context):
        received = 0
        async for request in requests:
            received += len(request.metadata)
        async with turn:
            yield runtime_pb2.ExpertResponse(metadata=bytes(min(answer_bytes, received)) or b"1")

    async def echo(requests, context):
        async for request in requests:
            async with turn:
                yield runtime_pb2.ExpertResponse(metadata=bytes(min(answer_bytes, len(request.metadata))) or b"1")

    await serve_bounded(server, RPC, sink, runtime_pb2.ExpertRequest, LIMITS, stream_input=True)
    await serve_bounded(server, ECHO, echo, runtime_pb2.ExpertRequest, LIMITS, stream_input=True)
    maddrs = [str(m) for m in await server.get_visible_maddrs()]
    Path(maddrs_file + ".tmp").write_text(json.dumps(maddrs))
    os.replace(maddrs_file + ".tmp", maddrs_file)
    await asyncio.Event().wait()  # until killed


async def _call(client: P2P, server_id: PeerID, requests) -> float:
    stream = await iterate_bounded(client, server_id, RPC, requests, runtime_pb2.ExpertResponse, LIMITS)
    answers = [answer async for answer in stream]
    if len(answers) != 1:
        raise RuntimeError(f"expected one answer, got {len(answers)}")
    return time.perf_counter()


class WarmStream:
    """One stream kept open for the whole run: every message goes on it, in order, and the receiver
    answers each one on the same stream as it arrives (what a long-lived stream per link would do)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.answers: asyncio.Queue = asyncio.Queue()
        self.written: asyncio.Queue = asyncio.Queue()  # a message was handed to p2pd
        self.task: asyncio.Task | None = None

    async def open(self, client: P2P, server_id: PeerID) -> None:
        async def requests():
            while (message := await self.queue.get()) is not None:
                yield message
                self.written.put_nowait(time.perf_counter())

        stream = await iterate_bounded(client, server_id, ECHO, requests(), runtime_pb2.ExpertResponse, LIMITS)

        async def read() -> None:
            async for _ in stream:
                self.answers.put_nowait(time.perf_counter())

        self.task = asyncio.create_task(read())

    async def send(self, messages: int, payload: bytes) -> list[float]:
        for _ in range(messages):
            self.queue.put_nowait(runtime_pb2.ExpertRequest(metadata=payload))
        return [await self.answers.get() for _ in range(messages)]

    async def send_in_turn(self, turn: asyncio.Lock, payload: bytes) -> float:
        """One message, written in this link's turn (the turn ends once p2pd took it); when it was answered."""
        async with turn:
            self.queue.put_nowait(runtime_pb2.ExpertRequest(metadata=payload))
            await self.written.get()
        return await self.answers.get()

    async def close(self) -> None:
        self.queue.put_nowait(None)
        if self.task is not None:
            await asyncio.wait_for(self.task, 60.0)


class KeptStreams:
    """A stream per message of a round, kept open from round to round and never warmed on purpose:
    what a peer's `StreamPool` holds for the hops of a step's microbatches to one next replica."""

    def __init__(self) -> None:
        self.streams: list[WarmStream] = []

    async def send_in_turn(self, client: P2P, server_id: PeerID, messages: int, payload: bytes) -> list[float]:
        while len(self.streams) < messages:
            stream = WarmStream()
            await stream.open(client, server_id)
            self.streams.append(stream)
        turn = asyncio.Lock()
        return await asyncio.gather(*(s.send_in_turn(turn, payload) for s in self.streams[:messages]))

    async def close(self) -> None:
        for stream in self.streams:
            await stream.close()


async def _send_one_way(
    way: str,
    client: P2P,
    server_id: PeerID,
    messages: int,
    nbytes: int,
    warm: WarmStream | None = None,
    kept: KeptStreams | None = None,
) -> dict:
    payload = bytes(nbytes)
    part = bytes(nbytes // PARTS)

    async def some(count: int):
        for _ in range(count):
            yield runtime_pb2.ExpertRequest(metadata=payload)

    async def in_parts():
        for _ in range(PARTS):
            yield runtime_pb2.ExpertRequest(metadata=part)

    started = time.perf_counter()
    turns, turn, peer = LinkTurns(), asyncio.Lock(), server_id.to_base58()  # `turn`: one link's, held by hand
    if way == "warm stream":
        ends = await warm.send(messages, payload)
    elif way == "kept streams, in turn":
        ends = await kept.send_in_turn(client, server_id, messages, payload)
    elif way.startswith("in turn, split"):
        pieces = int(way.rsplit(" ", 1)[1])
        ends = await asyncio.gather(
            *(_split_call(client, server_id, turn, nbytes // pieces, pieces) for _ in range(messages))
        )
    elif way == "one stream":
        ends = [await _call(client, server_id, some(messages))]
    elif way == "in turn, parts":
        ends = await asyncio.gather(
            *(_call(client, server_id, turns.in_turn(peer, in_parts())) for _ in range(messages))
        )
    elif way == "in turn, parts, early":
        ends = await asyncio.gather(*(_call(client, server_id, _early_turn(turn, in_parts())) for _ in range(messages)))
    else:
        calls = [
            _call(client, server_id, turns.in_turn(peer, some(1)) if way == "in turn" else some(1))
            for _ in range(messages)
        ]
        ends = await asyncio.gather(*calls)
    return {"seconds": max(ends) - started, "first_answer_s": min(ends) - started}


async def _split_call(client: P2P, server_id: PeerID, turn: asyncio.Lock, piece_bytes: int, pieces: int) -> float:
    """One message as `pieces` pieces, each on a stream of its own, all written at once in one turn on
    the link (`turn`, first come, first served, as `LinkTurns`); when its last piece was answered."""
    await turn.acquire()
    unwritten, held = pieces, True

    def release() -> None:
        nonlocal held
        if held:
            held = False
            turn.release()

    async def piece():
        nonlocal unwritten
        try:
            yield runtime_pb2.ExpertRequest(metadata=bytes(piece_bytes))
        finally:
            unwritten -= 1
            if unwritten == 0:
                release()

    try:
        return max(await asyncio.gather(*(_call(client, server_id, piece()) for _ in range(pieces))))
    finally:
        release()  # a call that failed before its piece was written does not hold the turn forever


async def _early_turn(lock: asyncio.Lock, messages):
    """`LinkTurns.in_turn`, except that the turn ends before the last message is written."""
    await lock.acquire()
    held = True
    try:
        previous = None
        async for message in messages:
            if previous is not None:
                yield previous
            previous = message
        lock.release()
        held = False
        if previous is not None:
            yield previous
    finally:
        if held:
            lock.release()


async def send(server_maddr: str, messages: int, nbytes: int, rounds: int, ways: tuple[str, ...]) -> dict:
    client = await P2P.create(initial_peers=[server_maddr])
    server_id = PeerID.from_base58(server_maddr.rsplit("/p2p/", 1)[1])
    try:
        await _send_one_way("at once", client, server_id, 1, 1024)  # connect, and warm the connection up
        warm, kept = WarmStream(), KeptStreams()
        if "warm stream" in ways:
            await warm.open(client, server_id)
            await warm.send(2 * messages, bytes(nbytes))  # the stream's window grows as it carries data
        results = {way: [] for way in ways}
        for r in range(rounds):
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
                results[way].append(await _send_one_way(way, client, server_id, messages, nbytes, warm, kept))
        if "warm stream" in ways:
            await warm.close()
        await kept.close()
        return results
    finally:
        await client.shutdown()


# --- the driver: builds the network, runs the two ends -----------------------------------------------
def _host_command(net: EmulatedNetwork, host: str, *args: str) -> list[str]:
    return [*net.exec_prefix(host), net.python, str(Path(__file__).resolve()), *args]


def measure(args) -> dict:
    topology = load_topology(args.topology)
    topology = topology.with_hosts({"src": topology.region_of(args.src), "dst": topology.region_of(args.dst)})
    link = topology.host_link("src", "dst")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    with EmulatedNetwork(topology) as net, tempfile.TemporaryDirectory() as tmp:  # `with` starts it
        probe = probe_link(net, "src", "dst")
        maddrs_file = os.path.join(tmp, "maddrs.json")
        server = subprocess.Popen(
            _host_command(
                net,
                "dst",
                *("--role", "server", "--listen", net.maddr("dst", SERVER_PORT), "--maddrs-file", maddrs_file),
                *("--answer-bytes", str(args.answer_bytes)),
            ),
            env=env,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60.0
            while not os.path.exists(maddrs_file):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise NetemError("the receiving p2pd did not start")
                time.sleep(0.2)
            maddr = next(m for m in json.loads(Path(maddrs_file).read_text()) if net.ip("dst") in m)
            out_file = os.path.join(tmp, "client.json")
            command = ["--role", "client", "--server", maddr, "--messages", str(args.messages)]
            command += ["--bytes", str(args.bytes), "--rounds", str(args.rounds), "--client-out", out_file]
            command += [arg for way in args.way for arg in ("--way", way)]
            subprocess.run(_host_command(net, "src", *command), env=env, check=True, timeout=args.timeout_s)
            rounds = json.loads(Path(out_file).read_text())
        finally:
            server.kill()
            server.wait(timeout=10)
    total = args.messages * args.bytes
    shaped = link.bytes_per_s
    probed = probe.forward_mbit * 1e6 / 8.0
    ways = {}
    for way, runs in rounds.items():
        seconds = statistics.median(run["seconds"] for run in runs)
        ways[way] = {
            "seconds": [round(run["seconds"], 3) for run in runs],
            "median_s": round(seconds, 3),
            "rate_mbit": round(total * 8 / seconds / 1e6, 2),
            "of_shaped": round(total / seconds / shaped, 3),
            "of_probe": round(total / seconds / probed, 3),
            "first_answer_s": round(statistics.median(run["first_answer_s"] for run in runs), 3),
            "first_answers_s": [round(run["first_answer_s"], 3) for run in runs],
        }
    return {
        "benchmark": "link_streams",
        "command": " ".join(sys.argv),
        "topology": topology.name,
        "link": {"src": args.src, "dst": args.dst, "rtt_ms": link.rtt_ms, "bandwidth_mbit": link.bandwidth_mbit},
        "probe": {"rtt_ms": round(probe.rtt_ms, 1), "forward_mbit": round(probe.forward_mbit, 2)},
        "messages": args.messages,
        "bytes": args.bytes,
        "answer_bytes": args.answer_bytes,
        "rounds": args.rounds,
        "load_1min": os.getloadavg()[0],
        "ways": ways,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default=str(Path(REPO_ROOT) / "benchmarks/topologies/world4.json"))
    parser.add_argument("--src", default="stage0", help="the sending host's place in the topology")
    parser.add_argument("--dst", default="stage1", help="the receiving host's place in the topology")
    parser.add_argument(
        "--messages", type=int, default=8, help="messages a round sends each way (a step's microbatches)"
    )
    parser.add_argument("--bytes", type=int, default=524_288, help="bytes of each message")
    parser.add_argument(
        "--answer-bytes",
        type=int,
        default=0,
        help="bytes of each answer, at most what its stream carried (answers go in turn): 524288 with the "
        "default --bytes puts a step's worth on both directions of the link, as a step's activations and "
        "their gradients do (default: one small answer)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--way", action="append", choices=WAYS, help="send only this way (repeat for more; default: every way)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--role", choices=("driver", "server", "client"), default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--maddrs-file", help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--client-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.way = tuple(args.way or WAYS)
    if args.role == "server":
        asyncio.run(serve(args.listen, args.maddrs_file, args.answer_bytes))
        return 0
    if args.role == "client":
        result = asyncio.run(send(args.server, args.messages, args.bytes, args.rounds, args.way))
        Path(args.client_out).write_text(json.dumps(result))
        return 0
    reason = missing_requirements()
    if reason:
        print(f"link_streams: {reason}", file=sys.stderr)
        return 2
    result = measure(args)
    print(f"{args.messages} x {args.bytes:,} bytes, {result['link']}; raw TCP probe {result['probe']}")
    print(f"{'way':22s} {'median s':>9s} {'Mbit/s':>7s} {'of shaped':>9s} {'of probe':>9s} {'first answer s':>15s}")
    for way, row in result["ways"].items():
        print(
            f"{way:22s} {row['median_s']:9.3f} {row['rate_mbit']:7.2f} {row['of_shaped']:9.2f} "
            f"{row['of_probe']:9.2f} {row['first_answer_s']:15.3f}"
        )
    if args.out:
        write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
