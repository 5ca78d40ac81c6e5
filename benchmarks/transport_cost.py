"""What carrying a call's bytes costs, per transport: CPU milliseconds per call and per MB, summed over
every process of the hop (the caller, the server and their daemons), side by side in one invocation.

    .venv/bin/python benchmarks/transport_cost.py --out benchmarks/out/transport_cost.json

Each transport runs in two fresh processes, a server and a client, started by this one; the client
warms up, then makes the calls of each row while this process reads the CPU time (user + system)
of both process trees (p2pd daemons included) before and after. A call sends a small header and
`request` bytes and is answered with a small header and `answer` bytes:
- `small`: 16 KB each way, one call at a time (a `tiny` microbatch's hop), and 8 at a time;
- `1 MB`, `6 MB` (a gpt2-124m bf16 microbatch of 4), `64 MB`: one way, a 16 KB answer.
The fixed cost of a call is the `small` row's CPU per call; the cost per MB is the extra CPU of a
large row over a small call, per MB of payload.

Transports:
- `p2pd`: today's path, hivemind's P2P streams through two p2pd daemons (yamux, noise), the request
  and answer as `ExpertRequest`/`ExpertResponse` messages of at most one 1 MiB part each, read with
  wire/bounded_streams.py on streams kept from call to call (`StreamPool`), as the trainer calls;
- `tcp`: raw asyncio TCP, a length prefix, the header and the payload (no encryption);
- `tls`: the same framing over asyncio TLS 1.3 (the stdlib `ssl` module, OpenSSL's AES-GCM);
- `zmq-curve`: pyzmq DEALER/ROUTER sockets with CURVE encryption and authentication (skipped when
  pyzmq is not installed, or its libzmq lacks CURVE);
- `data-plane`: swarm's data plane (wire/data_plane.py): TLS 1.3 with the peer's pinned certificate
  and a caller token obtained over p2pd, the same `ExpertRequest` messages framed without protobuf.
What it does not show: loopback only (no real network, no packet loss); each transport is one
client and one server with nothing else to do; a CPU figure includes the processes' idle upkeep
during the row (p2pd's background work, a few ms per second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.process_cpu import tree_cpu_s  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402

KB, MB = 1 << 10, 1 << 20
SMALL = 16 * KB
HEADER = b"h" * 300  # about what a RequestHeader takes in msgpack
TRANSPORTS = ("p2pd", "tcp", "tls", "zmq-curve", "data-plane")
ROWS = (  # name, request bytes, answer bytes, calls, concurrency
    ("small", SMALL, SMALL, 2000, 1),
    ("small x8", SMALL, SMALL, 4000, 8),
    ("1 MB", MB, SMALL, 200, 1),
    ("6 MB", 6 * MB, SMALL, 40, 1),
    ("64 MB", 64 * MB, SMALL, 6, 1),
)


# --- framing shared by tcp and tls ------------------------------------------------------------------


async def _send_frame(writer: asyncio.StreamWriter, header: bytes, payload: memoryview) -> None:
    writer.write(len(header).to_bytes(4, "big") + len(payload).to_bytes(8, "big") + header)
    if len(payload):
        writer.write(payload)
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    prefix = await reader.readexactly(12)
    header_len, payload_len = int.from_bytes(prefix[:4], "big"), int.from_bytes(prefix[4:], "big")
    if header_len > 64 * KB or payload_len > 256 * MB:
        raise ValueError("frame too large")
    return await reader.readexactly(header_len), await reader.readexactly(payload_len)


def _answer_header(answer_bytes: int) -> bytes:
    return json.dumps({"answer": answer_bytes}).encode()


def _tls_contexts(workdir: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from wire.tls_connection import make_certificate

    cert_pem, key_pem, _ = make_certificate()
    cert, key = os.path.join(workdir, "cert.pem"), os.path.join(workdir, "key.pem")
    with open(cert, "wb") as f:
        f.write(cert_pem)
    with open(key, "wb") as f:
        f.write(key_pem)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    return server, client


# --- servers ----------------------------------------------------------------------------------------

ANSWERS: dict[int, memoryview] = {}


def _answer(nbytes: int) -> memoryview:
    if nbytes not in ANSWERS:
        ANSWERS[nbytes] = memoryview(os.urandom(nbytes))
    return ANSWERS[nbytes]


async def serve_stream(use_tls: bool, workdir: str) -> dict:
    server_ctx = _tls_contexts(workdir)[0] if use_tls else None

    async def handle(reader, writer):
        try:
            while True:
                header, _ = await _read_frame(reader)
                await _send_frame(writer, HEADER, _answer(json.loads(header)["answer"]))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx, limit=4 * MB)
    return {"port": server.sockets[0].getsockname()[1], "_keep": server}


async def serve_p2pd(workdir: str) -> dict:
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    from wire.bounded_streams import StreamLimits, serve_bounded

    p2p = await P2P.create()

    async def handler(requests, context):
        answer_bytes = None
        async for message in requests:
            if message.metadata:
                answer_bytes = json.loads(message.metadata)["answer"]
        for i, message in enumerate(_pb_messages(runtime_pb2.ExpertResponse, HEADER, _answer(answer_bytes))):
            yield message

    await serve_bounded(p2p, "bench", handler, runtime_pb2.ExpertRequest, StreamLimits(), stream_input=True)
    return {
        "maddrs": [str(m) for m in await p2p.get_visible_maddrs()],
        "peer_id": p2p.peer_id.to_base58(),
        "_keep": p2p,
    }


def _pb_messages(message_type, header: bytes, payload: memoryview) -> list:
    """The header with the first 1 MiB part, then a part per message, built as wire/messages.py builds them."""
    from hivemind.proto import runtime_pb2

    from wire.messages import with_parts

    parts = [runtime_pb2.Tensor(buffer=bytes(payload[i : i + MB])) for i in range(0, len(payload), MB)]
    return [with_parts(message_type, parts[:1], metadata=header), *(with_parts(message_type, [p]) for p in parts[1:])]


async def serve_zmq(workdir: str) -> dict:
    import zmq
    import zmq.asyncio
    from zmq.auth.asyncio import AsyncioAuthenticator

    context = zmq.asyncio.Context()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    auth = AsyncioAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    socket = context.socket(zmq.ROUTER)
    socket.curve_server, socket.curve_secretkey, socket.curve_publickey = True, server_secret, server_public
    socket.setsockopt(zmq.MAXMSGSIZE, 256 * MB)
    port = socket.bind_to_random_port("tcp://127.0.0.1")

    async def loop():
        while True:
            identity, header, _ = await socket.recv_multipart(copy=False)
            answer = json.loads(header.bytes)["answer"]
            await socket.send_multipart([identity, HEADER, _answer(answer)], copy=False)

    task = asyncio.ensure_future(loop())
    return {
        "port": port,
        "server_public": server_public.decode(),
        "client_public": client_public.decode(),
        "client_secret": client_secret.decode(),
        "_keep": (context, auth, socket, task),
    }


async def serve_data_plane(workdir: str) -> dict:
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    from wire.bounded_streams import StreamLimits
    from wire.data_plane import DataPlaneServer, serve_offers

    p2p = await P2P.create()
    server = DataPlaneServer(local_id=p2p.peer_id, limits=StreamLimits())

    async def handler(requests, context):
        answer_bytes = None
        async for message in requests:
            if message.metadata:
                answer_bytes = json.loads(message.metadata)["answer"]
        for message in _pb_messages(runtime_pb2.ExpertResponse, HEADER, _answer(answer_bytes)):
            yield message

    server.add_handler("bench", handler, runtime_pb2.ExpertRequest)
    await server.start(["127.0.0.1"], 0)
    await serve_offers(p2p, server)
    return {
        "maddrs": [str(m) for m in await p2p.get_visible_maddrs()],
        "peer_id": p2p.peer_id.to_base58(),
        "_keep": (p2p, server),
    }


SERVERS = {
    "p2pd": serve_p2pd,
    "tcp": lambda workdir: serve_stream(False, workdir),
    "tls": lambda workdir: serve_stream(True, workdir),
    "zmq-curve": serve_zmq,
    "data-plane": serve_data_plane,
}


# --- clients ----------------------------------------------------------------------------------------


class StreamCaller:
    def __init__(self, address: dict, use_tls: bool, workdir: str):
        self.address, self.ctx = address, _tls_contexts(workdir)[1] if use_tls else None
        self.idle: list = []

    async def call(self, payload: memoryview, answer_bytes: int) -> int:
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", self.address["port"], ssl=self.ctx, limit=4 * MB
            )
        await _send_frame(writer, _answer_header(answer_bytes), payload)
        _, answer = await _read_frame(reader)
        self.idle.append((reader, writer))
        return len(answer)


class P2PCaller:
    def __init__(self, address: dict, workdir: str):
        self.address = address

    async def start(self):
        from hivemind.p2p import P2P, PeerID

        from wire.bounded_streams import StreamPool

        self.p2p = await P2P.create(initial_peers=self.address["maddrs"])
        self.peer_id = PeerID.from_base58(self.address["peer_id"])
        self.pool = StreamPool()

    async def call(self, payload: memoryview, answer_bytes: int) -> int:
        from hivemind.proto import runtime_pb2

        from wire.bounded_streams import StreamLimits, iterate_bounded

        messages = _pb_messages(runtime_pb2.ExpertRequest, _answer_header(answer_bytes), payload)

        async def requests():
            for message in messages:
                yield message

        stream = await iterate_bounded(
            self.p2p, self.peer_id, "bench", requests(), runtime_pb2.ExpertResponse, StreamLimits(), pool=self.pool
        )
        return await _received_bytes(stream)


async def _received_bytes(stream) -> int:
    received = 0
    async for message in stream:
        received += sum(len(part.buffer) for part in message.tensors)
    return received


class DataPlaneCaller(P2PCaller):
    async def start(self):
        await super().start()
        from wire.data_plane import DataPlaneClient
        from wire.transport import Transport

        client = DataPlaneClient(self.p2p)
        self.transport = Transport(self.p2p, client)
        if not await client.reach(self.address["peer_id"]):
            raise RuntimeError("the data plane did not connect")

    async def call(self, payload: memoryview, answer_bytes: int) -> int:
        from hivemind.proto import runtime_pb2

        from wire.bounded_streams import StreamLimits

        messages = _pb_messages(runtime_pb2.ExpertRequest, _answer_header(answer_bytes), payload)

        async def requests():
            for message in messages:
                yield message

        stream = await self.transport.iterate(
            self.address["peer_id"], "bench", requests(), runtime_pb2.ExpertResponse, StreamLimits()
        )
        return await _received_bytes(stream)


class ZmqCaller:
    def __init__(self, address: dict, workdir: str):
        import zmq
        import zmq.asyncio

        self.zmq, self.address = zmq, address
        self.context = zmq.asyncio.Context()
        self.idle: list = []

    def _socket(self):
        zmq = self.zmq
        socket = self.context.socket(zmq.DEALER)
        socket.curve_serverkey = self.address["server_public"].encode()
        socket.curve_publickey = self.address["client_public"].encode()
        socket.curve_secretkey = self.address["client_secret"].encode()
        socket.setsockopt(zmq.MAXMSGSIZE, 256 * MB)
        socket.connect(f"tcp://127.0.0.1:{self.address['port']}")
        return socket

    async def call(self, payload: memoryview, answer_bytes: int) -> int:
        socket = self.idle.pop() if self.idle else self._socket()
        await socket.send_multipart([_answer_header(answer_bytes), payload], copy=len(payload) < 64 * KB)
        _, answer = await socket.recv_multipart(copy=False)
        self.idle.append(socket)
        return len(answer.buffer)


async def _caller(transport: str, address: dict, workdir: str):
    if transport in ("tcp", "tls"):
        return StreamCaller(address, transport == "tls", workdir)
    if transport == "zmq-curve":
        return ZmqCaller(address, workdir)
    caller = (P2PCaller if transport == "p2pd" else DataPlaneCaller)(address, workdir)
    await caller.start()
    return caller


async def run_client(transport: str, address: dict, workdir: str) -> None:
    caller = await _caller(transport, address, workdir)
    payloads = {size: memoryview(os.urandom(size)) for _, size, _, _, _ in ROWS}
    for _ in range(20):  # warm-up: connections, streams and code paths
        await asyncio.gather(*(caller.call(payloads[SMALL], SMALL) for _ in range(8)))
    await caller.call(payloads[MB], SMALL)
    _say({"ready": True})
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        row = json.loads(line)
        payload, answer, calls, concurrency = payloads[row["request"]], row["answer"], row["calls"], row["concurrency"]
        started = time.perf_counter()

        async def worker(count: int) -> int:
            received = 0
            for _ in range(count):
                received += await caller.call(payload, answer)
            return received

        received = await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - started
        if sum(received) != answer * (calls // concurrency) * concurrency:
            raise RuntimeError(f"answers carried {sum(received)} bytes, expected {answer * calls}")
        _say({"wall_s": wall})


async def run_server(transport: str, workdir: str) -> None:
    address = await SERVERS[transport](workdir)
    _say({key: value for key, value in address.items() if not key.startswith("_")})
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until this process's parent closes it


def _say(message: dict) -> None:
    print(json.dumps(message), flush=True)


# --- the orchestrator -------------------------------------------------------------------------------


def _start(role: str, transport: str, workdir: str, address: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, os.path.abspath(__file__), "--role", role, "--transport", transport]
    command += ["--workdir", workdir]
    if address is not None:
        command += ["--address", json.dumps(address)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def _read(process: subprocess.Popen, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"a {process.args[5]} {process.args[3]} process ended (rc {process.wait()})")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue  # a library's own output
    raise TimeoutError("no answer from a benchmark process")


def measure(transport: str, rows: list[tuple], scale: float) -> list[dict]:
    workdir = tempfile.mkdtemp(prefix="transport-cost-")
    server = _start("server", transport, workdir)
    client = None
    try:
        address = _read(server)
        client = _start("client", transport, workdir, address)
        _read(client)
        results = []
        for name, request, answer, calls, concurrency in rows:
            calls = max(concurrency, int(calls * scale) // concurrency * concurrency)
            before = sum(tree_cpu_s(pid) for pid in (server.pid, client.pid))
            client.stdin.write(
                json.dumps({"request": request, "answer": answer, "calls": calls, "concurrency": concurrency}) + "\n"
            )
            wall_s = _read(client)["wall_s"]
            cpu_s = sum(tree_cpu_s(pid) for pid in (server.pid, client.pid)) - before
            results.append(
                {
                    "transport": transport,
                    "row": name,
                    "request_bytes": request,
                    "answer_bytes": answer,
                    "calls": calls,
                    "concurrency": concurrency,
                    "wall_s": round(wall_s, 3),
                    "cpu_s": round(cpu_s, 3),
                    "cpu_ms_per_call": round(1000 * cpu_s / calls, 3),
                    "wall_ms_per_call": round(1000 * wall_s / calls, 3),
                    "mb_per_s": round((request + answer) * calls / MB / wall_s, 1),
                }
            )
            print(f"  {transport:<11} {name:<9} {results[-1]['cpu_ms_per_call']:>9.3f} ms CPU/call", flush=True)
        return results
    finally:
        for process in (client, server):
            if process is not None:
                process.stdin.close()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def per_mb(results: list[dict]) -> list[dict]:
    """Per transport: the fixed CPU per call (the small row) and the CPU per MB of each large row
    over that fixed cost."""
    summary = []
    for transport in dict.fromkeys(r["transport"] for r in results):
        rows = {r["row"]: r for r in results if r["transport"] == transport}
        small = rows.get("small")
        entry = {"transport": transport, "cpu_ms_per_call": small["cpu_ms_per_call"] if small else None}
        if "small x8" in rows:
            entry["cpu_ms_per_call_8_at_once"] = rows["small x8"]["cpu_ms_per_call"]
        for name in ("1 MB", "6 MB", "64 MB"):
            row = rows.get(name)
            if row is None or small is None:
                continue
            extra_ms = row["cpu_ms_per_call"] - small["cpu_ms_per_call"] * (1 + SMALL / row["request_bytes"])
            entry[f"cpu_ms_per_mb_{name.split()[0]}mb"] = round(extra_ms / (row["request_bytes"] / MB), 3)
            entry[f"wall_mb_per_s_{name.split()[0]}mb"] = row["mb_per_s"]
        summary.append(entry)
    return summary


def available(transport: str) -> str | None:
    """Why `transport` cannot run here, or None."""
    if transport == "zmq-curve":
        try:
            import zmq
        except ImportError:
            return "pyzmq is not installed"
        if not zmq.has("curve"):
            return "this pyzmq's libzmq has no CURVE"
    if transport == "data-plane":
        try:
            import wire.data_plane  # noqa: F401
        except ImportError:
            return "wire/data_plane.py is not in this tree"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help="comma-separated, of " + ", ".join(TRANSPORTS)
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every row's number of calls")
    parser.add_argument("--out", default="benchmarks/out/transport_cost.json")
    parser.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        asyncio.run(run_server(args.transport, args.workdir))
        return 0
    if args.role == "client":
        asyncio.run(run_client(args.transport, json.loads(args.address), args.workdir))
        return 0
    load_before = os.getloadavg()
    results, skipped = [], {}
    for transport in args.transports.split(","):
        why = available(transport)
        if why is not None:
            skipped[transport] = why
            print(f"  {transport}: skipped ({why})", flush=True)
            continue
        results.extend(measure(transport, list(ROWS), args.scale))
    summary = per_mb(results)
    print(f"\n{'transport':<11} {'ms/call':>8} {'x8':>8} {'ms/MB 1':>8} {'ms/MB 6':>8} {'ms/MB 64':>9}")
    for entry in summary:
        cells = [entry.get(key) for key in ("cpu_ms_per_call", "cpu_ms_per_call_8_at_once")]
        cells += [entry.get(f"cpu_ms_per_mb_{n}mb") for n in (1, 6, 64)]
        print(f"{entry['transport']:<11} " + " ".join(f"{c:>8.3f}" if c is not None else f"{'-':>8}" for c in cells))
    write_report(
        args.out,
        {
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "openssl": ssl.OPENSSL_VERSION},
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "skipped": skipped,
            "summary": summary,
            "rows": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
