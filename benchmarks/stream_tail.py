"""Streamed answers that lose their tail: a handler that closes its end of the stream right after its
last answer (hivemind's stream handlers do, and `wire.bounded_streams.serve_bounded` did) against
`serve_bounded` now (an end marker, then the caller closes first). Both run side by side, in one
invocation, between the same two real p2pd daemons on loopback, interleaved round by round.

    PYTHONPATH=. .venv/bin/python benchmarks/stream_tail.py --calls 1600 --out benchmarks/out/stream_tail.json

Each call sends one small request and gets `--parts` answer messages of `--part-bytes` each;
`--concurrency` calls run at once. A call is *short* when it ended without error but with fewer
messages than were sent, *failed* when it raised. What the figures do not show: the rate depends on
the machine's load and on how fast the caller reads (the bytes waiting in the caller's p2pd when the
handler's daemon resets the stream are the ones lost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from contextlib import closing

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from benchmarks.report_file import write_report
from wire.bounded_streams import StreamLimits, iterate_bounded, receive_message, serve_bounded


async def _closes_first(p2p: P2P, name: str, parts: int, part_bytes: int) -> None:
    """The old way: answer, then close at once."""

    async def handle(stream_info, reader, writer) -> None:
        with closing(writer):
            while await receive_message(reader, runtime_pb2.ExpertRequest, StreamLimits()) is not None:
                pass
            for _ in range(parts):
                await P2P.send_protobuf(runtime_pb2.ExpertResponse(metadata=b"x" * part_bytes), writer)

    await p2p.add_binary_stream_handler(name, handle)


async def _bounded(p2p: P2P, name: str, parts: int, part_bytes: int) -> None:
    async def handler(requests, context):
        async for _ in requests:
            pass
        for _ in range(parts):
            yield runtime_pb2.ExpertResponse(metadata=b"x" * part_bytes)

    await serve_bounded(p2p, name, handler, runtime_pb2.ExpertRequest, StreamLimits(), stream_input=True)


async def _call(client: P2P, server_id, name: str, parts: int, counts: dict) -> None:
    async def request():
        yield runtime_pb2.ExpertRequest(metadata=b"y" * 500)

    try:
        stream = await iterate_bounded(client, server_id, name, request(), runtime_pb2.ExpertResponse, StreamLimits())
        received = [message async for message in stream]
        counts["short" if len(received) < parts else "whole"] += 1
    except Exception:  # what a caller sees as a broken call
        counts["failed"] += 1


async def measure(args) -> dict:
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    ways = {"handler closes first": _closes_first, "end marker, caller closes first": _bounded}
    counts, seconds = {}, {}
    try:
        for i, (way, register) in enumerate(ways.items()):
            await register(server, f"rpc{i}", args.parts, args.part_bytes)
            counts[way], seconds[way] = {"whole": 0, "short": 0, "failed": 0}, 0.0
        for _ in range(args.calls // args.concurrency):  # interleaved: both see the same load
            for i, way in enumerate(ways):
                started = time.perf_counter()
                await asyncio.gather(
                    *(
                        _call(client, server.peer_id, f"rpc{i}", args.parts, counts[way])
                        for _ in range(args.concurrency)
                    )
                )
                seconds[way] += time.perf_counter() - started
    finally:
        await client.shutdown()
        await server.shutdown()
    return {
        "calls_each": args.calls // args.concurrency * args.concurrency,
        "parts": args.parts,
        "part_bytes": args.part_bytes,
        "concurrency": args.concurrency,
        "load_1min": os.getloadavg()[0],
        "ways": {way: {**counts[way], "seconds": round(seconds[way], 1)} for way in ways},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1600, help="calls made each way")
    parser.add_argument("--parts", type=int, default=4, help="answer messages per call")
    parser.add_argument("--part-bytes", type=int, default=1_000_000, help="bytes of each answer message")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight at once")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=2))
    if args.out:
        write_report(args.out, result)


if __name__ == "__main__":
    main()
