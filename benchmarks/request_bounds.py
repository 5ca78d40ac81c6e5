"""What oversized and never-finishing requests cost a peer (issue #30): this code against another
checkout (`--before`), each measured on its own loopback swarm in the same invocation.

    git worktree add --detach /tmp/before main      # or any checkout of the code of before
    PYTHONPATH=. .venv/bin/python benchmarks/request_bounds.py --before /tmp/before \
        --out benchmarks/out/request_bounds.json

For each checkout: a bootstrap node and one `tiny` peer of stage 1 (defaults of that code), then a
client (a DHT node of that code) that
1. sends one stream message whose prefix declares 256 MiB, then streams the 256 MiB 1 MiB at a time;
2. opens twenty backward streams, sends sixty 1 MiB messages on each and never finishes them.
The peer process's VmHWM (peak RSS) is read from /proc after each (its DHT daemon and p2pd are
other processes, not counted), and its VmRSS 40 s later, with the twenty streams still open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE_BYTES = 256 << 20


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


async def _huge_message(p2p, peer, name: str) -> None:
    from hivemind.p2p import P2P

    _, _, writer = await p2p.call_binary_stream_handler(peer, name)
    try:
        writer.write(P2P.MESSAGE_MARKER + HUGE_BYTES.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        chunk = bytes(1 << 20)
        for _ in range(HUGE_BYTES >> 20):
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 10)
    except Exception:  # refused: the peer closed the stream
        pass
    finally:
        writer.close()


async def _never_finish(p2p, peer, name: str, messages: int = 60):
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    _, _, writer = await p2p.call_binary_stream_handler(peer, name)
    data = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(1 << 20))]).SerializeToString()
    try:
        for _ in range(messages):
            writer.write(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
            await asyncio.wait_for(writer.drain(), 10)
    except Exception:  # refused or closed by the peer
        pass
    return writer


def measure_here() -> dict:
    """Run in a process whose PYTHONPATH is the checkout under test."""
    from hivemind.p2p import PeerID

    from dht.node import NetworkConfig, start_dht
    from swarm.local_swarm import LocalSwarm
    from wire.protocol import RPC_BACKWARD, RPC_FORWARD

    swarm = LocalSwarm(workdir=tempfile.mkdtemp(prefix="request-bounds-"), model="tiny", num_stages=2)
    try:
        swarm.start_bootstrap()
        peer = swarm.start_peer(1)
        swarm.wait_online([peer])
        peer_id = PeerID.from_base58(peer.log().split("peer ", 1)[1].split(" ", 1)[0])
        pid = peer.popen.pid

        async def attacks() -> dict:
            dht = start_dht(NetworkConfig(initial_peers=swarm.initial_peers), client_mode=True)
            try:
                p2p = await dht.replicate_p2p()
                out = {"baseline_peak_rss_mib": _status_mib(pid, "VmHWM")}
                await _huge_message(p2p, peer_id, RPC_FORWARD)
                await asyncio.sleep(1)
                out["peak_rss_after_256mib_message_mib"] = _status_mib(pid, "VmHWM")
                writers = await asyncio.gather(*(_never_finish(p2p, peer_id, RPC_BACKWARD) for _ in range(20)))
                await asyncio.sleep(2)
                out["peak_rss_after_20_open_streams_mib"] = _status_mib(pid, "VmHWM")
                await asyncio.sleep(40)
                out["rss_40s_later_mib"] = _status_mib(pid, "VmRSS")
                for writer in writers:
                    writer.close()
                return out
            finally:
                dht.shutdown()

        report = asyncio.run(attacks())
        report["peer_alive"] = peer.alive
        return report
    finally:
        swarm.stop()


def measure(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": code}
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--measure-here"],
        cwd=code,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring {code} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a checkout of the code to compare with")
    parser.add_argument("--out", default="benchmarks/out/request_bounds.json")
    parser.add_argument("--measure-here", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_here:
        print(json.dumps(measure_here()), flush=True)
        return
    sys.path.insert(0, REPO)
    from benchmarks.report_file import write_report

    report = {"this_code": measure(REPO)}
    if args.before:
        report["before"] = measure(os.path.abspath(args.before))
    print(json.dumps(report, indent=2), flush=True)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
