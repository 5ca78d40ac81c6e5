"""Measure an emulated link before trusting it: RTT (median of small ping-pongs on one TCP
connection) and the rate each way (a bulk transfer timed to its acknowledgement, less one RTT).

The server and the client run as small processes inside the two hosts' namespaces, so the
measurement crosses exactly what the applications cross: the delay proxy, the htb classes and the
bridge. Rates are TCP payload rates (goodput); a shaped link of R Mbit/s carries about 0.95 R of
payload after Ethernet, IP and TCP headers.

    python -m benchmarks.netem.probe serve --host 10.213.0.3 --port 7001
    python -m benchmarks.netem.probe client --target 10.213.0.3:7001 --bytes 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.netem.network import REPO_ROOT, EmulatedNetwork, NetemError, normal_priority

PROBE_PORT = 7001
PINGS = 12
WARMUP_PINGS = 2
IO_TIMEOUT_S = 60.0
RTT_FLOOR_MS = 5.0  # Python hops (probe, proxy) on a loaded 2-core machine add 1-8 ms (measured)


@dataclass(frozen=True)
class LinkMeasurement:
    src: str
    dst: str
    rtt_ms: float
    forward_mbit: float  # src -> dst payload rate
    reverse_mbit: float  # dst -> src payload rate
    expected_rtt_ms: float = 0.0
    expected_mbit: float = 0.0

    def errors(self, tolerance: float, rtt_floor_ms: float = RTT_FLOOR_MS) -> list[str]:
        """What is off by more than `tolerance` (relative) from the link asked for; an RTT may
        also be off by `rtt_floor_ms` (what the probe and proxy add on a busy machine)."""
        problems = []
        if abs(self.rtt_ms - self.expected_rtt_ms) > max(tolerance * self.expected_rtt_ms, rtt_floor_ms):
            problems.append(f"RTT {self.rtt_ms:.1f} ms, asked {self.expected_rtt_ms:.1f} ms")
        for name, value in (("forward", self.forward_mbit), ("reverse", self.reverse_mbit)):
            if abs(value - self.expected_mbit) > tolerance * self.expected_mbit:
                problems.append(f"{name} rate {value:.2f} Mbit/s, asked {self.expected_mbit:.2f} Mbit/s")
        return problems


# --- the two ends (run inside the namespaces) --------------------------------------------------------
def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the probe peer closed the connection early")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def serve(host: str, port: int) -> None:
    """Answer probes until killed: b'P' -> echo; b'U'+n -> read n bytes, ack; b'D'+n -> send n bytes."""
    listener = socket.create_server((host, port), backlog=16)
    print(f"probe server ready on {host}:{port}", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(IO_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while True:
                    op = conn.recv(1)
                    if not op:
                        break
                    if op == b"P":
                        conn.sendall(b"p")
                    elif op == b"U":
                        (n,) = struct.unpack("!Q", _recv_exactly(conn, 8))
                        _recv_exactly(conn, n)
                        conn.sendall(b"a")
                    elif op == b"D":
                        (n,) = struct.unpack("!Q", _recv_exactly(conn, 8))
                        conn.sendall(bytes(n))
            except OSError:
                pass


def measure(target: str, nbytes: int) -> dict:
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        rtts = []
        for _ in range(WARMUP_PINGS + PINGS):
            started = time.perf_counter()
            sock.sendall(b"P")
            _recv_exactly(sock, 1)
            rtts.append(time.perf_counter() - started)
        rtt_s = statistics.median(rtts[WARMUP_PINGS:])
        started = time.perf_counter()
        sock.sendall(b"U" + struct.pack("!Q", nbytes) + bytes(nbytes))
        _recv_exactly(sock, 1)
        upload_s = time.perf_counter() - started - rtt_s
        started = time.perf_counter()
        sock.sendall(b"D" + struct.pack("!Q", nbytes))
        _recv_exactly(sock, nbytes)
        download_s = time.perf_counter() - started - rtt_s
    return {
        "rtt_ms": rtt_s * 1e3,
        "forward_mbit": nbytes * 8 / upload_s / 1e6,
        "reverse_mbit": nbytes * 8 / download_s / 1e6,
    }


# --- driving them from outside -----------------------------------------------------------------------
def probe_link(
    net: EmulatedNetwork, src: str, dst: str, seconds: float = 1.0, timeout_s: float = 60.0
) -> LinkMeasurement:
    """Measure the link src -> dst of an `EmulatedNetwork`, each bulk transfer ~`seconds` long."""
    link = net.topology.host_link(src, dst)
    nbytes = max(int(link.bytes_per_s * seconds), 64 * 1024)
    # Like the proxies, the probes run at the default priority: they measure the links, and a
    # `nice`d caller on a busy machine would otherwise measure its own scheduling delays.
    server = subprocess.Popen(
        [
            *net.exec_prefix(dst),
            net.python,
            "-m",
            "benchmarks.netem.probe",
            "serve",
            "--host",
            net.ip(dst),
            "--port",
            str(PROBE_PORT),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=normal_priority,
    )
    try:
        ready = server.stdout.readline()
        if "ready" not in ready:
            raise NetemError(f"the probe server in {dst} did not start: {ready.strip()}")
        try:
            done = subprocess.run(
                [
                    *net.exec_prefix(src),
                    net.python,
                    "-m",
                    "benchmarks.netem.probe",
                    "client",
                    "--target",
                    f"{net.ip(dst)}:{PROBE_PORT}",
                    "--bytes",
                    str(nbytes),
                ],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                preexec_fn=normal_priority,
            )
        except subprocess.TimeoutExpired:
            raise NetemError(f"probing {src} -> {dst} took over {timeout_s:.0f} s") from None
        if done.returncode != 0:
            raise NetemError(f"probing {src} -> {dst} failed: {done.stderr.strip()[-500:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        try:
            os.killpg(server.pid, 9)
        except ProcessLookupError:
            pass
        server.wait(timeout=5)
        server.stdout.close()
    return LinkMeasurement(
        src=src,
        dst=dst,
        rtt_ms=result["rtt_ms"],
        forward_mbit=result["forward_mbit"],
        reverse_mbit=result["reverse_mbit"],
        expected_rtt_ms=link.rtt_ms,
        expected_mbit=link.bandwidth_mbit,
    )


def verify_links(
    net: EmulatedNetwork, pairs: list[tuple[str, str]], tolerance: float = 0.2, seconds: float = 1.0, say=print
) -> list[LinkMeasurement]:
    """Probe every pair; raise NetemError if any RTT or rate is off by more than `tolerance`
    (RTTs: or by more than RTT_FLOOR_MS)."""
    measurements, problems = [], []
    for src, dst in pairs:
        for attempt in range(2):  # a busy machine can stall one probe: measure once more
            m = probe_link(net, src, dst, seconds)
            say(
                f"  link {src:>9} -> {dst:<9} RTT {m.rtt_ms:7.1f} ms (asked {m.expected_rtt_ms:5.1f})   "
                f"rate {m.forward_mbit:7.2f} / {m.reverse_mbit:7.2f} Mbit/s (asked {m.expected_mbit:.2f})"
                + ("   (second probe)" if attempt else "")
            )
            if not m.errors(tolerance):
                break
        measurements.append(m)
        problems += [f"{src} -> {dst}: {p}" for p in m.errors(tolerance)]
    if problems:
        raise NetemError(f"emulated links are off by more than {tolerance:.0%}: " + "; ".join(problems))
    return measurements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, default=PROBE_PORT)
    c = sub.add_parser("client")
    c.add_argument("--target", required=True, help="HOST:PORT of a probe server")
    c.add_argument("--bytes", type=int, required=True, help="bytes of each bulk transfer")
    args = parser.parse_args(argv)
    if args.role == "serve":
        serve(args.host, args.port)
    else:
        print(json.dumps(measure(args.target, args.bytes)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
