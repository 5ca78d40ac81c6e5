"""Swarm against a fixed GPipe pipeline on an emulated world-wide network, in one invocation.

Every process runs in its own network namespace (`benchmarks.netem`): links shaped per region
pair (tc htb) with their latency added by a user-space delay proxy, each link's RTT and rate
probed before anything is measured. On the same topology, data, model and steps it runs:

  1. gpipe           the baseline: PyTorch's ScheduleGPipe over gloo, stage i on host stage<i>
  2. swarm none      swarm, trainer on host `trainer`, peer i on host stage<i>, no compression
  3. swarm int8      the same with 8-bit blockwise activations and gradients
  4. swarm adaptive  the same with the per-link adaptive codec
  5. swarm faults    int8 with standby replicas (hosts standby<i>): the peer of stage
                     `--slow-stage` runs `--slowdown` times slower, the peer of `--kill-stage`
                     is SIGKILLed once `--kill-at-step` steps are done
  6. gpipe kill      the baseline with the rank of `--kill-stage` SIGKILLed at the same step

(`--runs` picks a subset; `fp16` and `topk` are swarm with those fixed codecs, e.g. to compare
every codec on a mixed fast/slow topology such as `benchmarks/topologies/mixed4.json`.)

Replica rows (issue #56), on a topology with a second host per stage (`stage<i>b`, e.g.
`benchmarks/topologies/world2x2.json`): `replicas-<mode>` runs two replicas per stage, one on each
host, with direct routing and `--replica-codec` activations, and the peers' `--averaging`:
`replicas-none` (no averaging: the speed reference), `replicas-sync` (exact sync), `replicas-outer`
and `replicas-outer-overlap` (outer rounds every `--outer-every` steps with `--outer-codec`, waited
for or overlapped, the trainer's commits waited for: `--outer-commits wait`), and each of the two
with `-background` (`--outer-commits background`, the default: the next step starts while a step's
commit travels). The table also says what `--averaging auto` would choose from each stage's
probed replica link (peers/replicas/averaging_choice.py) under each `--loss-budgets` value (the
peers' `--averaging-loss-budget`), and each row's speed against no averaging.

Direct routing (`swarm train --routing direct`, issue #23): `direct-<codec>` (direct-none,
direct-int8, direct-adaptive, ...) is the swarm run with that codec where each peer sends its
activations straight to the next stage's peer and the gradients come back the same way (the
trainer's links carry tokens and the loss only); `direct-kill` is direct int8 with the standby
replicas (hosts standby<i>) and the peer of `--kill-stage` SIGKILLed once `--kill-at-step` steps
are done, nobody slowed. Link bytes are every host pair's counter, peer-to-peer links included,
as for GPipe; the trainer's share of them is reported apart (`trainer link B/tok`).

A direct run's peers send each hop in pieces of about 128 KiB, each on a stream of its own
(`--hop-piece-kb`, peers/serving/hop_pieces.py); `direct-none/one-stream` is the same run with one
stream per hop (`--hop-piece-kb 0`), to compare the two in one invocation.

A swarm run may serve a subspace model (issue #27): `direct-int4+fixed:32` is direct int4 where
every peer and the trainer run with `--subspace-rank 32 --subspace-kind fixed`, so only the 32
coefficients per token (in int4) and the token ids cross between stages.

and prints and writes (JSON) for each, over the steps after `--warmup`: tokens/s; bytes per token
on the links (every host pair's htb counter, so Ethernet/IP/TCP headers, encryption and DHT
traffic included) and, for swarm, the tensor payload the trainer counted; the CPU seconds all
processes in the namespaces used per 1,000 tokens; the busiest link direction and how much of the
time its bytes needed at its shaped rate; the loss reached (mean of the last 3 steps) and whether
the run finished. Needs root (namespaces, tc, iptables); says so and exits otherwise.

    nice -n 10 .venv/bin/python benchmarks/wan.py --topology benchmarks/topologies/world4.json \\
        --out benchmarks/out/wan.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpipe_baseline  # noqa: E402
from benchmarks.netem.network import EmulatedNetwork, NetemError, missing_requirements  # noqa: E402
from benchmarks.netem.probe import verify_links  # noqa: E402
from benchmarks.netem.topology import TopologyError, load_topology  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_stage  # noqa: E402
from peers.replicas.averaging_choice import choose_averaging  # noqa: E402
from swarm.local_swarm import LocalSwarm, LocalSwarmError, fault_args  # noqa: E402
from wire.compression import LinkEstimate  # noqa: E402

GPIPE_PORT = 29500
ONE_STREAM = "/one-stream"  # a direct run's suffix: each hop on one stream (--hop-piece-kb 0)
# gpipe / gpipe-kill: the baseline; faults: int8 swarm with a slowed and a killed peer; others: swarm with that codec
HUB_CODECS = ("none", "fp16", "int8", "int4", "topk", "adaptive")
RUNS = (
    "gpipe",
    *HUB_CODECS,
    "faults",
    "gpipe-kill",
    *(f"direct-{codec}" for codec in HUB_CODECS),
    "direct-kill",
)
REPLICA_RUNS = (
    "replicas-none",
    "replicas-sync",
    "replicas-outer",
    "replicas-outer-overlap",
    "replicas-outer-background",
    "replicas-outer-overlap-background",
)
BACKGROUND = "-background"  # a replica row whose trainer runs with --outer-commits background


@dataclass
class RunResult:
    name: str
    completed: bool
    steps_done: int
    steps: int
    tokens_per_s: float | None  # over the steps after warm-up (None if none completed)
    link_bytes_per_token: float | None  # bytes sent over every link (headers included) / tokens, after warm-up
    payload_bytes_per_token: float | None  # tensors as the trainer counted them (swarm only)
    initial_loss: float | None
    final_loss: float | None  # mean of the last 3 steps done
    wall_s: float
    cpu_s_per_1k_tokens: float | None = None  # CPU of every process, per 1,000 tokens, after warm-up
    cpu_s_per_1k_tokens_by_kind: dict[str, float] = field(default_factory=dict)
    busiest_link: str | None = None  # the host pair (one direction) whose link was busiest after warm-up
    busiest_link_busy: float | None = None  # its bytes / its shaped rate, as a fraction of the timed steps' time
    trainer_link_bytes_per_token: float | None = None  # of link_bytes_per_token, what the trainer's links carried
    notes: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    payload_by_codec: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # swarm: wire bytes sent/received per codec
    backward_inputs_skipped: int | None = None  # swarm: backwards answered from the peer's activation cache


@dataclass
class Settings:
    model: str
    steps: int
    warmup: int
    batch_size: int
    microbatch_size: int
    stage_hosts: list[str]
    trainer_host: str
    standby_hosts: dict[int, str]
    slow_stage: int
    slowdown: float
    kill_stage: int
    kill_at_step: int
    run_timeout_s: float
    replica_hosts: dict[int, str] = field(default_factory=dict)  # stage -> its second replica's host
    replica_codec: str = "int8"
    outer_every: int = 5
    outer_codec: str = "int8"
    loss_budgets: tuple[float, ...] = (0.01,)  # the budgets `--averaging auto` is shown choosing under

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * get_model_config(self.model).seq_len


def _say(text: str) -> None:
    print(text, flush=True)


@dataclass
class Measured:
    """What crossed the links and the CPU used, between the end of the warm-up and the end."""

    cpu_s: float
    link_bytes: dict[tuple[str, str], int]  # (src host, dst host) -> bytes
    cpu_s_by_kind: dict[str, float] = field(default_factory=dict)  # trainer, peer, p2pd, delay proxy, ...


def process_kind(pid: int) -> str:
    """What a process inside the namespaces is, from its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "gone"
    text = b" ".join(argv).decode(errors="replace")
    for needle, kind in (
        ("p2pd", "p2pd"),
        ("delay_proxy", "delay proxy"),
        ("gpipe_baseline", "gpipe rank"),
        ("swarm.cli peer", "peer"),
        ("swarm.cli train", "trainer"),
        ("swarm.cli dht", "bootstrap"),
    ):
        if needle in text:
            return kind
    return "other"


class RunMeter:
    """CPU seconds used by every process inside the namespaces (proxies, p2pd and DHT processes
    included) and bytes sent over every host pair's link, from the end of the warm-up (when
    `marker` shows up in the log at `log_path`) until `stop()`. CPU is sampled twice a second, so a
    process that ends keeps its last sample."""

    def __init__(self, net: EmulatedNetwork, log_path: str, marker: str, period_s: float = 0.5):
        self.net, self.log_path, self.marker, self.period_s = net, log_path, marker, period_s
        self.latest: dict[int, float] = {}
        self.kinds: dict[int, str] = {}
        self.at_marker: Measured | None = None
        self.latest_at_marker: dict[int, float] = {}
        self.result: Measured | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_forever, daemon=True)
        self._thread.start()

    def _update(self) -> None:
        usage = self.net.cpu_seconds()
        for pid in usage:
            if pid not in self.kinds:
                self.kinds[pid] = process_kind(pid)
        self.latest.update(usage)

    def _sample(self) -> None:
        self._update()
        if self.at_marker is None:
            try:
                with open(self.log_path, errors="replace") as f:
                    if self.marker in f.read():
                        self.latest_at_marker = dict(self.latest)
                        self.at_marker = Measured(sum(self.latest.values()), self.net.link_bytes())
            except OSError:
                pass

    def _sample_forever(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> Measured | None:
        """What was used since the marker; None if it never showed up. Idempotent."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._update()
            if self.at_marker is not None:
                now = self.net.link_bytes()
                by_kind: dict[str, float] = {}
                for pid, cpu_s in self.latest.items():
                    kind = self.kinds.get(pid, "other")
                    by_kind[kind] = by_kind.get(kind, 0.0) + cpu_s - self.latest_at_marker.get(pid, 0.0)
                self.result = Measured(
                    sum(self.latest.values()) - self.at_marker.cpu_s,
                    {k: v - self.at_marker.link_bytes.get(k, 0) for k, v in now.items()},
                    by_kind,
                )
        return self.result


def _fill_measured(
    result: RunResult, measured: Measured | None, step_seconds: list[float], s: Settings, net: EmulatedNetwork
) -> RunResult:
    """CPU per 1,000 tokens, link bytes per token, and the busiest link over the timed steps."""
    timed_s = sum(step_seconds[s.warmup : result.steps_done])
    timed_tokens = (result.steps_done - s.warmup) * s.tokens_per_step
    if measured is None or timed_tokens <= 0 or timed_s <= 0:
        return result
    result.cpu_s_per_1k_tokens = 1000 * measured.cpu_s / timed_tokens
    result.cpu_s_per_1k_tokens_by_kind = {
        kind: round(1000 * cpu_s / timed_tokens, 3) for kind, cpu_s in sorted(measured.cpu_s_by_kind.items())
    }
    result.link_bytes_per_token = sum(measured.link_bytes.values()) / timed_tokens
    trainer_bytes = sum(n for (src, dst), n in measured.link_bytes.items() if "trainer" in (src, dst))
    result.trainer_link_bytes_per_token = trainer_bytes / timed_tokens
    busy = {
        pair: nbytes * 8 / (net.topology.host_link(*pair).bandwidth_mbit * 1e6) / timed_s
        for pair, nbytes in measured.link_bytes.items()
    }
    (src, dst), fraction = max(busy.items(), key=lambda item: item[1])
    result.busiest_link, result.busiest_link_busy = f"{src}->{dst}", fraction
    return result


def _timed_tokens_per_s(step_seconds: list[float], warmup: int, tokens_per_step: int) -> float | None:
    timed = step_seconds[warmup:]
    return len(timed) * tokens_per_step / sum(timed) if timed else None


def _final_loss(losses: list[float]) -> float | None:
    tail = losses[-3:]
    return sum(tail) / len(tail) if tail else None


def _wait_for_line(path: str, text: str, process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until `text` appears in the log at `path`; False if the process ended or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, errors="replace") as f:
                if text in f.read():
                    return True
        except OSError:
            pass
        if process.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def _step_marker(step: int, steps: int) -> str:
    return f"step {step:>4}/{steps}"  # both the trainer and the baseline print this


# --- the baseline ------------------------------------------------------------------------------------
def _known_run(run: str) -> bool:
    """A run of RUNS, or a swarm run of a codec with a subspace model (`direct-int4+fixed:32`), or a
    direct run with one stream per hop (`direct-none/one-stream`)."""
    if run in REPLICA_RUNS:
        return True
    if run.startswith("direct-") and run.endswith(ONE_STREAM):
        run = run.removesuffix(ONE_STREAM)
    base, plus, subspace = run.partition("+")
    if not plus:
        return run in RUNS
    kind, _, rank = subspace.partition(":")
    swarm_run = base in RUNS and base not in ("gpipe", "gpipe-kill", "faults", "direct-kill")
    return swarm_run and kind in ("fixed", "learned") and rank.isdigit() and int(rank) > 0


def run_gpipe(net: EmulatedNetwork, s: Settings, workdir: str, *, kill: bool) -> RunResult:
    name = "gpipe kill" if kill else "gpipe"
    _say(f"\n== {name}: ScheduleGPipe over gloo, ranks on {s.stage_hosts}")
    world = len(s.stage_hosts)
    master = f"{net.ip(s.stage_hosts[0])}:{GPIPE_PORT}"
    reports = [os.path.join(workdir, f"{name.replace(' ', '-')}-rank{r}.json") for r in range(world)]
    logs = [os.path.join(workdir, f"{name.replace(' ', '-')}-rank{r}.log") for r in range(world)]
    commands = [
        [
            *net.exec_prefix(host),
            *gpipe_baseline.rank_command(
                r,
                world,
                master,
                model=s.model,
                steps=s.steps,
                batch_size=s.batch_size,
                microbatch_size=s.microbatch_size,
                report=reports[r],
                python=net.python,
            ),
        ]
        for r, host in enumerate(s.stage_hosts)
    ]
    started = time.monotonic()
    processes = gpipe_baseline.launch(commands, logs, env={"GLOO_SOCKET_IFNAME": "wan0", "PYTHONUNBUFFERED": "1"})
    meter = RunMeter(net, logs[-1], _step_marker(s.warmup, s.steps))
    notes = []
    try:
        if kill:
            # Rank 0 finishes a step last (its backward comes last): then every stage has stepped.
            marker = _step_marker(s.kill_at_step, s.steps)
            if _wait_for_line(logs[0], marker, processes[0], s.run_timeout_s):
                os.killpg(processes[s.kill_stage].pid, signal.SIGKILL)
                notes.append(
                    f"rank {s.kill_stage} ({s.stage_hosts[s.kill_stage]}) SIGKILLed after step {s.kill_at_step}"
                )
                _say(f"   {notes[-1]}")
        deadline = time.monotonic() + s.run_timeout_s
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                notes.append("timed out")
                break
    finally:
        measured = meter.stop()
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=10)
    wall_s = time.monotonic() - started
    written = [r for r in map(_read_json, reports) if r is not None]  # a SIGKILLed rank writes none
    last = _read_json(reports[-1]) or {}
    errors = sorted({_short_error(r["error"]) for r in written if r.get("error")})
    notes += [f"{sum(1 for r in written if r.get('error'))} ranks failed: {'; '.join(errors)}"] if errors else []
    steps_done = min((r.get("steps", 0) for r in written), default=0)
    step_seconds = last.get("step_seconds", [])
    completed = len(written) == world and all(r.get("completed") for r in written)
    if not completed and not any(p.returncode == 0 for p in processes):
        _say(f"   ranks exited with {[p.returncode for p in processes]}; see {logs[-1]}")
    losses = last.get("losses", [])
    result = RunResult(
        name=name,
        completed=completed,
        steps_done=steps_done,
        steps=s.steps,
        tokens_per_s=_timed_tokens_per_s(step_seconds[:steps_done], s.warmup, s.tokens_per_step),
        link_bytes_per_token=None,
        payload_bytes_per_token=None,
        initial_loss=losses[0] if losses else None,
        final_loss=_final_loss(losses[:steps_done]),
        wall_s=wall_s,
        notes=notes,
        losses=losses,
    )
    return _fill_measured(result, measured, step_seconds, s, net)


def _short_error(error: str) -> str:
    """gloo's errors start with a source path and end with advice: keep what happened."""
    text = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", error)
    text = re.sub(r"\[[0-9.]+\]:\d+", "", text)
    return text.split(". ")[0][:120].strip()


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


# --- swarm -------------------------------------------------------------------------------------------
def run_swarm(
    net: EmulatedNetwork,
    s: Settings,
    workdir: str,
    *,
    codec: str,
    faults: bool,
    routing: str = "hub",
    kill_only: bool = False,
    subspace: str = "",
    one_stream: bool = False,
    averaging: list[str] | None = None,
    replica_name: str = "",
    trainer_args: tuple[str, ...] = (),
) -> RunResult:
    """A swarm run. `faults`: standby replicas, the slow stage's peer slowed and the kill stage's peer
    SIGKILLed; `kill_only` (with `faults`): nobody slowed. `subspace` ("fixed:32"): a subspace model,
    its K coefficients per token in `codec` on the wire."""
    if replica_name:
        name = replica_name
    elif routing == "direct":
        name = "direct kill" if faults else f"direct {codec}"
    else:
        name = "swarm faults" if faults else f"swarm {codec}"
    subspace_args = []
    if subspace:
        kind, _, rank = subspace.partition(":")
        subspace_args = ["--subspace-rank", rank, "--subspace-kind", kind]
        name += f"+{subspace}"
    piece_args = ["--hop-piece-kb", "0"] if one_stream else []
    if one_stream:
        name += " one stream"
    _say(
        f"\n== {name}: trainer on {s.trainer_host}, peers on {s.stage_hosts}"
        + (f" + standby {s.standby_hosts}" if faults else "")
        + (f" + replicas {s.replica_hosts}, {' '.join(averaging)}" if averaging is not None else "")
        + f", {routing} routing"
    )
    report_path = os.path.join(workdir, f"{name.replace(' ', '-').replace(':', '')}.json")
    swarm_dir = os.path.join(workdir, name.replace(" ", "-").replace(":", ""))
    notes: list[str] = []
    started, meter, measured = time.monotonic(), None, None
    try:
        with LocalSwarm(
            model=s.model,
            num_stages=len(s.stage_hosts),
            workdir=swarm_dir,
            peer_args=["--target-batch-size", str(s.batch_size), "--num-threads", "1", *subspace_args, *piece_args],
        ) as swarm:
            trainer_prefix = net.exec_prefix(s.trainer_host)
            swarm.start_bootstrap(60.0, "--host-maddrs", net.maddr(s.trainer_host), prefix=trainer_prefix)
            peers = {}
            placements = [(stage, host) for stage, host in enumerate(s.stage_hosts)]
            if faults:
                placements += sorted(s.standby_hosts.items())
            if averaging is not None:  # a replica row: the second replica of every stage
                placements += sorted(s.replica_hosts.items())
            for stage, host in placements:
                extra = ["--host-maddrs", net.maddr(host), *(averaging or [])]
                if faults and not kill_only and host == s.stage_hosts[s.slow_stage]:
                    extra += fault_args(slowdown=s.slowdown)
                peers[host] = swarm.start_peer(stage, *extra, name=f"peer-{host}", prefix=net.exec_prefix(host))
            swarm.wait_online(list(peers.values()), timeout_s=180.0)
            _say(f"   {len(peers)} peers online after {time.monotonic() - started:.0f} s")
            trainer = swarm.start_trainer(
                "--num-stages",
                str(len(s.stage_hosts)),
                "--steps",
                str(s.steps),
                "--batch-size",
                str(s.batch_size),
                "--microbatch-size",
                str(s.microbatch_size),
                "--max-in-flight",
                str(s.batch_size // s.microbatch_size),
                "--codec",
                codec,
                "--routing",
                routing,
                "--host-maddrs",
                net.maddr(s.trainer_host),
                "--report",
                report_path,
                *subspace_args,
                *trainer_args,
                prefix=trainer_prefix,
            )
            meter = RunMeter(net, trainer.log_path, _step_marker(s.warmup, s.steps))
            if faults:
                if not kill_only:
                    notes.append(f"peer of stage {s.slow_stage} ({s.stage_hosts[s.slow_stage]}) {s.slowdown:g}x slower")
                marker = _step_marker(s.kill_at_step, s.steps)
                if _wait_for_line(trainer.log_path, marker, trainer.popen, s.run_timeout_s):
                    peers[s.stage_hosts[s.kill_stage]].signal(signal.SIGKILL)
                    notes.append(
                        f"peer of stage {s.kill_stage} ({s.stage_hosts[s.kill_stage]}) SIGKILLed "
                        f"after step {s.kill_at_step}"
                    )
                    _say(f"   {notes[-1]}")
            try:
                trainer.popen.wait(timeout=s.run_timeout_s)
            except subprocess.TimeoutExpired:
                notes.append(f"trainer timed out after {s.run_timeout_s:.0f} s")
            if trainer.popen.returncode not in (0, None):
                notes.append(
                    f"trainer exited with {trainer.popen.returncode}: {trainer.log().strip().splitlines()[-1:]}"
                )
            measured = meter.stop()  # before the peers stop: shutting down is not training
    finally:
        if meter is not None:
            meter.stop()
    wall_s = time.monotonic() - started
    report = _read_json(report_path) or {}
    steps_done = report.get("steps", 0)
    step_seconds = [s.tokens_per_step / t for t in report.get("tokens_per_s_by_step", []) if t > 0]
    losses = report.get("losses", [])
    if faults or report.get("microbatches_lost"):
        notes.append(f"{report.get('microbatches_lost', 'unknown')} microbatches lost")
    if report.get("microbatches_retried"):
        notes.append(f"{report['microbatches_retried']} microbatches retried")
    result = RunResult(
        name=name,
        completed=bool(report.get("completed")),
        steps_done=steps_done,
        steps=s.steps,
        tokens_per_s=_timed_tokens_per_s(step_seconds, s.warmup, s.tokens_per_step),
        link_bytes_per_token=None,
        payload_bytes_per_token=report.get("wire_bytes_per_token"),
        initial_loss=losses[0] if losses else None,
        final_loss=_final_loss(losses),
        wall_s=wall_s,
        notes=notes,
        losses=losses,
    )
    result.payload_by_codec = {
        direction: {codec: totals["wire_bytes"] for codec, totals in per_codec.items()}
        for direction, per_codec in report.get("bytes_by_codec", {}).items()
    }
    result.backward_inputs_skipped = report.get("backward_inputs_skipped")
    return _fill_measured(result, measured, step_seconds, s, net)


# --- the whole benchmark -----------------------------------------------------------------------------
def probe_pairs(s: Settings) -> list[tuple[str, str]]:
    """Every link a run uses, each pair once: trainer <-> peers (swarm), stage i -> i+1 (GPipe)."""
    pairs = []
    for host in [*s.stage_hosts, *s.standby_hosts.values()]:
        if host != s.trainer_host:
            pairs.append((s.trainer_host, host))
    for a, b in zip(s.stage_hosts, s.stage_hosts[1:]):
        if (a, b) not in pairs and (b, a) not in pairs:
            pairs.append((a, b))
    for stage, host in sorted(s.replica_hosts.items()):  # replica rows: trainer <-> the second replicas,
        for pair in [(s.trainer_host, host), (s.stage_hosts[stage], host)]:  # and each stage's replica link
            if pair[0] != pair[1] and pair not in pairs and pair[::-1] not in pairs:
                pairs.append(pair)
    return pairs


def replica_averaging_args(run: str, s: Settings) -> list[str]:
    """The peers' averaging flags of a replica row."""
    mode = run.removeprefix("replicas-").removesuffix(BACKGROUND)
    if mode in ("none", "sync"):
        return ["--averaging", mode]
    outer = ["--averaging", "outer", "--averaging-every-steps", str(s.outer_every), "--outer-codec", s.outer_codec]
    return outer + (["--outer-overlap"] if mode == "outer-overlap" else [])


def auto_choices(s: Settings, probes, step_s: float) -> dict[str, str]:
    """What `--averaging auto` would choose for each stage from its probed replica link, for a step of
    `step_s` (the no-averaging row's, when it ran), under each of `s.loss_budgets`."""
    config = get_model_config(s.model)
    choices = {}
    for stage, host in sorted(s.replica_hosts.items()):
        link = next((p for p in probes if {p.src, p.dst} == {s.stage_hosts[stage], host}), None)
        if link is None:
            continue
        values = sum(t.numel() for t in build_stage(config, stage, len(s.stage_hosts), seed=0).parameters())
        mbit = min(link.forward_mbit, link.reverse_mbit)
        estimate = LinkEstimate(bandwidth_bytes_per_s=mbit * 1e6 / 8, latency_s=link.rtt_ms / 2e3)
        for budget in s.loss_budgets:
            choice = choose_averaging(num_values=values, group_size=2, step_s=step_s, link=estimate, loss_budget=budget)
            choices[f"stage {stage}, budget {budget:g}"] = f"{choice.mode}: {choice.reason}"
    return choices


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[RunResult], baseline: RunResult | None) -> None:
    width = max([15, *(len(r.name) for r in results)])  # the run column fits the longest name
    _say(
        f"\n{'run':<{width}} steps  tokens/s  vs gpipe  link B/tok  trainer link B/tok  payload B/tok  CPU s/1k tok  "
        "busiest link (busy)         loss   notes"
    )
    for r in results:
        ratio = (
            r.tokens_per_s / baseline.tokens_per_s if baseline and r.tokens_per_s and baseline.tokens_per_s else None
        )
        busiest = f"{r.busiest_link} ({r.busiest_link_busy:.0%})" if r.busiest_link else "-"
        _say(
            f"{r.name:<{width}} {r.steps_done:>2}/{r.steps:<3} {_fmt(r.tokens_per_s, '>8,.0f')}  {'-' if ratio is None else f'{ratio:.2f}x':>8} "
            f"{_fmt(r.link_bytes_per_token, '>10,.0f')}  {_fmt(r.trainer_link_bytes_per_token, '>18,.0f')}  "
            f"{_fmt(r.payload_bytes_per_token, '>13,.0f')}  "
            f"{_fmt(r.cpu_s_per_1k_tokens, '>12.2f')}  {busiest:<27} {_fmt(r.final_loss, '>5.3f')}  {'; '.join(r.notes)}"
        )


def print_cpu_breakdown(results: list[RunResult]) -> None:
    _say("\nCPU seconds per 1,000 tokens after warm-up, by process kind:")
    width = max([15, *(len(r.name) for r in results)])
    for r in results:
        parts = ", ".join(f"{kind} {value:.2f}" for kind, value in r.cpu_s_per_1k_tokens_by_kind.items())
        _say(f"  {r.name:<{width}} {parts or '-'}")


def summarize_replica_rows(results: list[RunResult], s: Settings, probes) -> dict:
    """Each replica row's tokens/s against no averaging, and what `--averaging auto` would choose."""
    none = next((r for r in results if r.name == "replicas none" and r.tokens_per_s), None)
    step_s = s.tokens_per_step / none.tokens_per_s if none else 1.0
    ratios = {
        r.name: (r.tokens_per_s / none.tokens_per_s if none and r.tokens_per_s else None)
        for r in results
        if r.name.startswith("replicas ")
    }
    choices = auto_choices(s, probes, step_s)
    _say("\nreplica rows: tokens/s against no averaging")
    for name, ratio in ratios.items():
        _say(f"  {name:<{max(len(n) for n in ratios)}} {_fmt(ratio, '.2f')}x")
    for where, choice in choices.items():
        _say(f"  --averaging auto, {where} (step {step_s:.2f} s): {choice}")
    return {"vs_none": ratios, "auto_choices": choices, "step_s": step_s}


def loss_budgets(text: str) -> tuple[float, ...]:
    try:
        budgets = tuple(float(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers such as 0.01,0.06"
        ) from None
    if any(not 0.0 <= b < 10.0 for b in budgets):
        raise argparse.ArgumentTypeError("each loss budget is a share of validation loss (0.01 = 1%), from 0 up to 10")
    return budgets


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="benchmarks/topologies/world4.json")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4, help="hosts stage0..stage<N-1> serve the stages")
    parser.add_argument("--slow-stage", type=int, default=1)
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--kill-stage", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int, default=None, help="default: half of --steps")
    parser.add_argument(
        "--runs",
        default="gpipe,none,int8,adaptive,faults,gpipe-kill",
        help=f"comma-separated subset of {','.join(RUNS)}",
    )
    parser.add_argument("--probe-seconds", type=float, default=1.0)
    parser.add_argument("--run-timeout-s", type=float, default=420.0)
    parser.add_argument("--out", default="benchmarks/out/wan.json")
    parser.add_argument("--kill-codec", default="int8", help="the codec of the direct-kill run")
    parser.add_argument("--replica-codec", default="int8", help="replica rows: the activations' codec (direct routing)")
    parser.add_argument("--outer-every", type=int, default=5, help="replica rows: outer rounds every this many steps")
    parser.add_argument("--outer-codec", default="int8", help="replica rows: the outer rounds' codec")
    parser.add_argument(
        "--loss-budgets",
        type=loss_budgets,
        default=(0.01,),
        help="replica rows: comma-separated --averaging-loss-budget values to show --averaging auto's choice under",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    reason = missing_requirements()
    if reason:
        print(f"wan: cannot run here: {reason}", file=sys.stderr)
        return 2
    try:
        topology = load_topology(args.topology)
        stage_hosts = [f"stage{i}" for i in range(args.stages)]
        for host in [*stage_hosts, "trainer"]:
            topology.region_of(host)
    except TopologyError as e:
        print(f"wan: error: {e}", file=sys.stderr)
        return 2
    runs = args.runs.split(",")
    unknown = {run for run in runs if not _known_run(run)}
    if unknown:
        print(
            f"wan: error: unknown runs {sorted(unknown)} (a swarm run may add a subspace model: direct-int4+fixed:32)",
            file=sys.stderr,
        )
        return 2
    standby = {i: f"standby{i}" for i in (args.slow_stage, args.kill_stage) if f"standby{i}" in topology.hosts}
    replica_runs = [run for run in runs if run in REPLICA_RUNS]
    replica_hosts = {i: f"stage{i}b" for i in range(args.stages) if f"stage{i}b" in topology.hosts}
    if replica_runs and len(replica_hosts) != args.stages:
        print(
            "wan: error: the replica rows need hosts stage<i>b for every stage (a topology like world2x2)",
            file=sys.stderr,
        )
        return 2
    settings = Settings(
        model=args.model,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        microbatch_size=args.microbatch_size,
        stage_hosts=stage_hosts,
        trainer_host="trainer",
        standby_hosts=standby,
        slow_stage=args.slow_stage,
        slowdown=args.slowdown,
        kill_stage=args.kill_stage,
        kill_at_step=args.kill_at_step or args.steps // 2,
        run_timeout_s=args.run_timeout_s,
        replica_hosts=replica_hosts if replica_runs else {},
        replica_codec=args.replica_codec,
        outer_every=args.outer_every,
        outer_codec=args.outer_codec,
        loss_budgets=args.loss_budgets,
    )
    if ("faults" in runs or "direct-kill" in runs) and args.kill_stage not in standby:
        print(f"wan: error: the kill runs need a host standby{args.kill_stage} in the topology", file=sys.stderr)
        return 2
    used = {"trainer", *stage_hosts, *standby.values(), *settings.replica_hosts.values()}
    topology = topology.with_hosts({h: r for h, r in topology.hosts.items() if h in used})

    # SIGTERM (and SIGHUP) unwind like Ctrl-C, so the network and every process are torn down.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    workdir = tempfile.mkdtemp(prefix="wan-")
    results: list[RunResult] = []
    started = time.monotonic()
    try:
        with EmulatedNetwork(topology, workdir=workdir) as net:
            _say(net.describe())
            _say("probing every link the runs use (RTT and payload rate each way):")
            probes = verify_links(net, probe_pairs(settings), seconds=args.probe_seconds, say=_say)
            for run in runs:
                try:
                    if run in ("gpipe", "gpipe-kill"):
                        results.append(run_gpipe(net, settings, workdir, kill=run == "gpipe-kill"))
                    elif run in REPLICA_RUNS:
                        results.append(
                            run_swarm(
                                net,
                                settings,
                                workdir,
                                codec=settings.replica_codec,
                                faults=False,
                                routing="direct",
                                averaging=replica_averaging_args(run, settings),
                                replica_name=run.replace("-", " "),
                                trainer_args=("--outer-commits", "background" if run.endswith(BACKGROUND) else "wait"),
                            )
                        )
                    elif run.startswith("direct-"):
                        kill = run == "direct-kill"
                        base, _, subspace = run.removesuffix(ONE_STREAM).partition("+")
                        codec = args.kill_codec if kill else base.removeprefix("direct-")
                        results.append(
                            run_swarm(
                                net,
                                settings,
                                workdir,
                                codec=codec,
                                faults=kill,
                                routing="direct",
                                kill_only=kill,
                                subspace=subspace,
                                one_stream=run.endswith(ONE_STREAM),
                            )
                        )
                    else:
                        base, _, subspace = run.partition("+")
                        results.append(
                            run_swarm(
                                net,
                                settings,
                                workdir,
                                codec="int8" if base == "faults" else base,
                                faults=base == "faults",
                                subspace=subspace,
                            )
                        )
                except LocalSwarmError as e:  # peers that never came online: record it, go on
                    results.append(
                        RunResult(
                            name=run.replace("-", " ") if run.startswith("direct-") else f"swarm {run}",
                            completed=False,
                            steps_done=0,
                            steps=settings.steps,
                            tokens_per_s=None,
                            link_bytes_per_token=None,
                            payload_bytes_per_token=None,
                            initial_loss=None,
                            final_loss=None,
                            wall_s=0.0,
                            notes=[str(e).splitlines()[0]],
                        )
                    )
                r = results[-1]
                _say(
                    f"   {r.name}: {r.steps_done}/{r.steps} steps, {_fmt(r.tokens_per_s, ',.0f')} tokens/s, "
                    f"loss {_fmt(r.final_loss, '.3f')}, {r.wall_s:.0f} s"
                )
    except NetemError as e:
        print(f"wan: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("wan: interrupted; the network and all processes were torn down", file=sys.stderr)
        return 130
    print_table(results, next((r for r in results if r.name == "gpipe"), None))
    print_cpu_breakdown(results)
    replica_summary = summarize_replica_rows(results, settings, probes) if replica_runs else {}
    out = {
        "benchmark": "wan",
        "command": " ".join(["benchmarks/wan.py", *(argv or sys.argv[1:])]),
        "topology": topology.to_dict(),
        "settings": asdict(settings),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "wall_s": time.monotonic() - started,
        "links": [asdict(p) for p in probes],
        "results": [asdict(r) for r in results],
        "replica_rows": replica_summary,
        "workdir": workdir,
    }
    write_report(args.out, out)
    _say(f"logs in {workdir}; {out['wall_s']:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
