"""An emulated wide-area network on one machine: one Linux network namespace per host, joined by
veth pairs to a bridge that lives in a namespace of its own, with every host pair's bandwidth
shaped (tc htb, per destination, on each host's link) and its latency added by a transparent
delay proxy in each host's namespace (`delay_proxy`; this kernel has no `netem`).

Nothing outside the namespaces it creates is touched: no address, route, rule or interface of
the machine's own namespace, and every address used lies in `subnet`, which only exists inside
them. Iptables rules live inside the host namespaces and vanish with them. `close()` (also run by
`with`, and by `start()` when it fails half-way) kills every process inside the namespaces and
deletes them; `cleanup_stale()` removes what a killed run of this module left behind.

    with EmulatedNetwork(topology) as net:
        subprocess.run([*net.exec_prefix("trainer"), "python", ...])
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.netem.topology import Topology
from process.lifetime import pid_alive

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMESPACE_PATTERN = re.compile(r"^swn(\d+)[-.]")
COMMAND_TIMEOUT_S = 20.0
DEFAULT_SUBNET = "10.213.0.0/24"
INTERFACE = "wan0"
_CLASS_SENT = re.compile(r"^class htb (\S+) .*?\n\s*Sent (\d+) bytes", re.MULTILINE)


class NetemError(RuntimeError):
    """The emulated network could not be built or checked; the message says why."""


def _tool(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin")


def run_command(args: list[str], timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run one command with a timeout; a failure raises NetemError with its stderr."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NetemError(f"`{' '.join(args)}` did not finish within {timeout_s:.0f} s") from None
    except FileNotFoundError:
        raise NetemError(f"`{args[0]}` is not installed") from None
    if check and done.returncode != 0:
        raise NetemError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def missing_requirements() -> str | None:
    """Why this machine cannot emulate a network (None if it can): root, ip, tc, iptables, htb, nat."""
    if os.geteuid() != 0:
        return "network emulation needs root (namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables"):
        if _tool(tool) is None:
            return f"network emulation needs `{tool}`, which is not installed"
    namespace = f"swn{os.getpid()}-check"
    try:
        run_command(["ip", "netns", "add", namespace])
    except NetemError as e:
        return f"cannot create a network namespace: {e}"
    try:
        run_command(["ip", "-n", namespace, "link", "add", "chk0", "type", "veth", "peer", "name", "chk1"])
        run_command(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                "tc",
                "qdisc",
                "add",
                "dev",
                "chk0",
                "root",
                "handle",
                "1:",
                "htb",
                "default",
                "1",
            ]
        )
        run_command(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                "iptables",
                "-w",
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-p",
                "tcp",
                "-d",
                "10.0.0.1/32",
                "-m",
                "mark",
                "!",
                "--mark",
                "1",
                "-j",
                "REDIRECT",
                "--to-ports",
                "1",
            ]
        )
    except NetemError as e:
        return f"this kernel or toolset cannot shape or redirect traffic: {e}"
    finally:
        run_command(["ip", "netns", "del", namespace], check=False)
    return None


def list_namespaces() -> list[str]:
    out = run_command(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process inside a namespace this module created (so all of them are ours)."""
    for _ in range(3):
        pids = [int(p) for p in run_command(["ip", "netns", "pids", namespace], check=False).split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def delete_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    run_command(["ip", "netns", "del", namespace], check=False)


def cleanup_stale() -> list[str]:
    """Delete the namespaces of runs of this module whose process is gone; returns their names."""
    removed = []
    for namespace in list_namespaces():
        match = NAMESPACE_PATTERN.match(namespace)
        if match and not pid_alive(int(match.group(1))):
            delete_namespace(namespace)
            removed.append(namespace)
    return removed


def normal_priority() -> None:
    """The proxies are the network: a `nice`d benchmark must not make its links slower. They use
    little CPU, so they run at the default priority whatever the caller's niceness."""
    os.setpriority(os.PRIO_PROCESS, 0, 0)


@dataclass(frozen=True)
class Host:
    name: str
    region: str
    namespace: str
    ip: str


class EmulatedNetwork:
    """Namespaces, links, shaping and delay proxies for every host of `topology`.

    subnet: the addresses hosts get (inside the namespaces only).
    proxy_port, mark: where the REDIRECT rule sends outgoing connections, and the firewall mark of
        the proxy's own connections, which the rule lets through.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        subnet: str = DEFAULT_SUBNET,
        proxy_port: int = 7777,
        mark: int = 0x77,
        python: str = sys.executable,
        workdir: str | None = None,
    ):
        if not topology.hosts:
            raise NetemError(f"topology {topology.name!r} places no hosts")
        network = ipaddress.ip_network(subnet)
        if network.num_addresses < len(topology.hosts) + 3:
            raise NetemError(f"subnet {subnet} is too small for {len(topology.hosts)} hosts")
        self.topology, self.subnet, self.prefix_len = topology, str(network), network.prefixlen
        self.proxy_port, self.mark, self.python = proxy_port, mark, python
        self._own_workdir = workdir is None  # made here: removed by close(), with the proxies' logs
        self.workdir = workdir or tempfile.mkdtemp(prefix="netem-")
        run_id = f"swn{os.getpid()}"
        self.hub = f"{run_id}.hub"
        addresses = network.hosts()
        next(addresses)  # .1 stays free
        self.hosts = {
            name: Host(name, region, f"{run_id}-{name}", str(next(addresses)))
            for name, region in topology.hosts.items()
        }
        self._classes: dict[tuple[str, str], str] = {}  # (src host, dst host) -> htb class on src's link
        self._created: list[str] = []
        self._proxies: list[subprocess.Popen] = []
        self.started = False

    # --- queries --------------------------------------------------------------------------------------
    def exec_prefix(self, host: str) -> list[str]:
        """Prepend to a command to run it inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace]

    def ip(self, host: str) -> str:
        return self.hosts[host].ip

    def maddr(self, host: str, port: int = 0) -> str:
        return f"/ip4/{self.hosts[host].ip}/tcp/{port}"

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> EmulatedNetwork:
        reason = missing_requirements()
        if reason:
            raise NetemError(reason)
        cleanup_stale()
        try:
            self._create_hub()
            for index, host in enumerate(self.hosts.values()):
                self._create_host(index, host)
            for host in self.hosts.values():
                self._shape(host)
                self._redirect(host)
            for host in self.hosts.values():
                self._start_proxy(host)
            self._wait_for_proxies()
        except BaseException:
            self.close()
            raise
        self.started = True
        return self

    def close(self) -> None:
        """Stop the proxies, kill whatever still runs inside the namespaces, delete them. Idempotent."""
        for proxy in self._proxies:
            if proxy.poll() is None:
                try:
                    os.killpg(proxy.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proxy.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._proxies.clear()
        for namespace in reversed(self._created):
            delete_namespace(namespace)
        self._created.clear()
        self.started = False
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def pids(self) -> list[int]:
        """Every process running inside the hosts' namespaces (the proxies included)."""
        inodes = set()
        for host in self.hosts.values():
            try:
                inodes.add(os.stat(f"/run/netns/{host.namespace}").st_ino)
            except OSError:
                pass
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                        pids.append(int(entry))
                except OSError:
                    continue  # gone, or not ours to inspect
        return pids

    def cpu_seconds(self) -> dict[int, float]:
        """CPU time (user + system) used so far by each process inside the hosts' namespaces."""
        ticks = os.sysconf("SC_CLK_TCK")
        usage = {}
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it just ended
            usage[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        return usage

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes sent so far from each host to each other host (its htb class's counter)."""
        sent = {}
        for host in self.hosts.values():
            out = run_command(["ip", "netns", "exec", host.namespace, "tc", "-s", "class", "show", "dev", INTERFACE])
            by_class = {m.group(1): int(m.group(2)) for m in _CLASS_SENT.finditer(out)}
            for (src, dst), classid in self._classes.items():
                if src == host.name:
                    sent[(src, dst)] = by_class.get(classid, 0)
        return sent

    def leftovers(self) -> list[str]:
        """Namespaces of this network that still exist (empty after `close`)."""
        mine = {self.hub, *(h.namespace for h in self.hosts.values())}
        return [n for n in list_namespaces() if n in mine]

    def __enter__(self) -> EmulatedNetwork:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- building -------------------------------------------------------------------------------------
    def _add_namespace(self, namespace: str) -> None:
        run_command(["ip", "netns", "add", namespace])
        self._created.append(namespace)
        run_command(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _create_hub(self) -> None:
        self._add_namespace(self.hub)
        run_command(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        run_command(["ip", "-n", self.hub, "link", "set", "br0", "up"])

    def _create_host(self, index: int, host: Host) -> None:
        self._add_namespace(host.namespace)
        hub_side = f"v{index}"
        run_command(
            [
                "ip",
                "link",
                "add",
                INTERFACE,
                "netns",
                host.namespace,
                "type",
                "veth",
                "peer",
                "name",
                hub_side,
                "netns",
                self.hub,
            ]
        )
        run_command(["ip", "-n", self.hub, "link", "set", hub_side, "master", "br0"])
        run_command(["ip", "-n", self.hub, "link", "set", hub_side, "up"])
        run_command(["ip", "-n", host.namespace, "addr", "add", f"{host.ip}/{self.prefix_len}", "dev", INTERFACE])
        run_command(["ip", "-n", host.namespace, "link", "set", INTERFACE, "up"])

    def _shape(self, host: Host) -> None:
        """Egress of `host`: one htb class per destination host at the pair's bandwidth."""
        tc = ["ip", "netns", "exec", host.namespace, "tc"]
        run_command([*tc, "qdisc", "add", "dev", INTERFACE, "root", "handle", "1:", "htb", "default", "1"])
        run_command(
            [
                *tc,
                "class",
                "add",
                "dev",
                INTERFACE,
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                "10gbit",
                "quantum",
                "60000",
            ]
        )  # ARP and anything not to a host
        for index, other in enumerate(h for h in self.hosts.values() if h.name != host.name):
            link = self.topology.link(host.region, other.region)
            rate = f"{max(round(link.bandwidth_mbit * 1000), 8)}kbit"
            classid = f"1:{100 + index}"
            self._classes[(host.name, other.name)] = classid
            run_command(
                [
                    *tc,
                    "class",
                    "add",
                    "dev",
                    INTERFACE,
                    "parent",
                    "1:",
                    "classid",
                    classid,
                    "htb",
                    "rate",
                    rate,
                    "ceil",
                    rate,
                    "quantum",
                    "1514",
                ]
            )
            run_command(
                [
                    *tc,
                    "filter",
                    "add",
                    "dev",
                    INTERFACE,
                    "parent",
                    "1:",
                    "protocol",
                    "ip",
                    "prio",
                    "1",
                    "u32",
                    "match",
                    "ip",
                    "dst",
                    f"{other.ip}/32",
                    "flowid",
                    classid,
                ]
            )

    def _redirect(self, host: Host) -> None:
        """Outgoing TCP to other hosts goes through the delay proxy, except the proxy's own."""
        iptables = ["ip", "netns", "exec", host.namespace, "iptables", "-w", "-t", "nat", "-A", "OUTPUT", "-p", "tcp"]
        run_command([*iptables, "-d", f"{host.ip}/32", "-j", "RETURN"])
        run_command(
            [
                *iptables,
                "-d",
                self.subnet,
                "-m",
                "mark",
                "!",
                "--mark",
                str(self.mark),
                "-j",
                "REDIRECT",
                "--to-ports",
                str(self.proxy_port),
            ]
        )

    def _start_proxy(self, host: Host) -> None:
        delays = {
            other.ip: self.topology.link(host.region, other.region).one_way_delay_s
            for other in self.hosts.values()
            if other.name != host.name
        }
        os.makedirs(self.workdir, exist_ok=True)  # again after a close() that removed it
        log_path = os.path.join(self.workdir, f"proxy-{host.name}.log")
        with open(log_path, "w") as log:
            proxy = subprocess.Popen(
                [
                    *self.exec_prefix(host.name),
                    self.python,
                    "-m",
                    "benchmarks.netem.delay_proxy",
                    "--port",
                    str(self.proxy_port),
                    "--mark",
                    str(self.mark),
                    "--delays",
                    json.dumps(delays),
                ],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=normal_priority,
            )
        self._proxies.append(proxy)

    def _wait_for_proxies(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for host, proxy in zip(self.hosts.values(), self._proxies):
            log_path = os.path.join(self.workdir, f"proxy-{host.name}.log")
            while True:
                with open(log_path, errors="replace") as f:
                    text = f.read()
                if "ready" in text:
                    break
                if proxy.poll() is not None:
                    raise NetemError(f"the delay proxy of {host.name} exited: {text.strip()[-500:]}")
                if time.monotonic() > deadline:
                    raise NetemError(f"the delay proxy of {host.name} did not start within {timeout_s:.0f} s")
                time.sleep(0.05)

    def describe(self) -> str:
        lines = [f"emulated network {self.topology.name!r}: {len(self.hosts)} hosts in {self.subnet}"]
        for host in self.hosts.values():
            lines.append(f"  {host.name:<10} {host.region:<10} {host.ip:<15} netns {host.namespace}")
        return "\n".join(lines)
