"""Latency in user space: a transparent TCP proxy that holds every chunk until its due time.

This kernel has no `netem` qdisc, so the emulated network adds delay here. One proxy runs inside
each host's namespace; an iptables rule there (`nat OUTPUT ... REDIRECT`) sends every outgoing TCP
connection to another emulated host to this proxy, which reads the address the application
dialled (SO_ORIGINAL_DST), connects there itself with a firewall mark the rule skips, and relays
both directions, each chunk released `one_way_delay_s` after it was read. Applications need no
change: libp2p, gloo and the probes dial the real addresses, and the server side sees a
connection from the dialling host's own address, so the bandwidth shaping (tc htb on each
host's link, per destination) applies to both directions.

Only the dialling side delays, by the pair's one-way delay in each direction: a connection's RTT
is the pair's RTT. The application's TCP sees a loopback hop to the proxy, so it is never limited
by its window over the long link: this models a well-tuned TCP (window >= bandwidth x delay).

    python -m benchmarks.netem.delay_proxy --port 7777 --mark 119 --delays '{"10.213.0.3": 0.05}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import sys

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CHUNK_BYTES = 64 * 1024
MAX_QUEUED_BYTES = 64 * 1024 * 1024  # per direction; the reader waits above this
CONNECT_TIMEOUT_S = 10.0


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """The (ip, port) the application dialled before REDIRECT rewrote it."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed_ip = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed_ip), port


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader -> writer, each chunk written no earlier than `delay_s` after it was read.
    Returns after relaying EOF; a reset or broken connection raises OSError."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    queued = 0
    room = asyncio.Event()
    room.set()

    async def read_side() -> None:
        nonlocal queued
        while True:
            await room.wait()
            data = await reader.read(CHUNK_BYTES)
            queue.put_nowait((loop.time() + delay_s, data))
            if not data:
                return
            queued += len(data)
            if queued > MAX_QUEUED_BYTES:
                room.clear()

    reading = asyncio.create_task(read_side())
    try:
        while True:
            if reading.done():
                reading.result()  # a reset raises here; after EOF the queue ends with b""
                due, data = await queue.get()
            else:
                get = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({get, reading}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    await asyncio.gather(get, return_exceptions=True)
                    continue
                due, data = get.result()
            wait_s = due - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            queued -= len(data)
            if queued <= MAX_QUEUED_BYTES:
                room.set()
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)


class DelayProxy:
    def __init__(self, delays_s: dict[str, float], mark: int, default_delay_s: float = 0.0):
        self.delays_s, self.mark, self.default_delay_s = delays_s, mark, default_delay_s
        self.connections = 0
        self._tasks: set[asyncio.Task] = set()

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        upstream_writer = None
        try:
            client_sock = client_writer.get_extra_info("socket")
            client_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ip, port = original_destination(client_sock)
            delay_s = self.delays_s.get(ip, self.default_delay_s)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.setblocking(False)
            try:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(upstream, (ip, port)), CONNECT_TIMEOUT_S)
            except BaseException:
                upstream.close()
                # The application's connect already succeeded (to us): a reset is the closest thing
                # to the refusal it would have seen, and makes it retry as it would then.
                client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                raise
            # The handshake crossed the link too: hold the connection for one RTT before relaying.
            await asyncio.sleep(2 * delay_s)
            upstream_reader, upstream_writer = await asyncio.open_connection(sock=upstream, limit=CHUNK_BYTES)
            self.connections += 1
            relays = [
                asyncio.create_task(relay(client_reader, upstream_writer, delay_s)),
                asyncio.create_task(relay(upstream_reader, client_writer, delay_s)),
            ]
            try:
                # Both directions end at EOF (half-closes pass through); a reset ends both.
                await asyncio.wait(relays, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in relays:
                    task.cancel()
                results = await asyncio.gather(*relays, return_exceptions=True)
            for result in results:
                if isinstance(result, Exception) and not isinstance(result, (OSError, asyncio.CancelledError)):
                    print(f"delay proxy: relay to {ip}:{port} failed: {result!r}", file=sys.stderr, flush=True)
        except (TimeoutError, OSError):
            pass  # a refused or reset connection: closing both ends tells the application
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()
            self._tasks.discard(asyncio.current_task())

    async def serve(self, port: int) -> None:
        server = await asyncio.start_server(self.handle, "127.0.0.1", port, limit=CHUNK_BYTES, backlog=1024)
        print(f"delay proxy ready on 127.0.0.1:{port}", flush=True)
        async with server:
            await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1 the REDIRECT rule points at")
    parser.add_argument("--mark", type=int, required=True, help="firewall mark of the proxy's own connections")
    parser.add_argument("--delays", required=True, help="JSON: destination IPv4 -> one-way delay in seconds")
    parser.add_argument("--default-delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    delays = {str(ip): float(s) for ip, s in json.loads(args.delays).items()}
    try:
        asyncio.run(DelayProxy(delays, args.mark, args.default_delay_s).serve(args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
