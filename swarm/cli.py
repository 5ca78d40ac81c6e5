"""`swarm`: one command-line program for every role (bootstrap node, peer, trainer, status, demo).

Errors a user can fix are printed as one line (`swarm: error: ...`) with exit code 2, never as a
traceback; the full traceback is shown with SWARM_DEBUG=1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys

from process.config import ConfigError, add_config_arguments, describe, from_sources, given_options
from process.lifetime import EXIT_SIGNALLED, StopRequested, bind_children_to_parent
from process.stale_sockets import remove_stale_sockets

EXIT_USAGE = 2


# Flags besides a role's configuration's (not part of any config dataclass): every role's --verbose,
# and --help-all where --help lists a few flags (`swarm peer`).
PROCESS_FLAGS = frozenset({"--verbose", "--no-verbose", "--help-all"})
PROCESS_VARIABLES = frozenset({"SWARM_VERBOSE"})
QUIET_LIBRARIES = ("bitsandbytes",)  # warn about optional kernels we never use; shown at SWARM_LOGLEVEL=INFO/DEBUG
# Library warnings that say nothing a user can act on; shown at SWARM_LOGLEVEL=INFO/DEBUG. asyncio's
# line comes when a stream's bytes are still being written after its connection was lost: a caller
# that stopped while a peer was answering it (the answer is dropped either way, and the peer's own
# call ends in an error it handles).
QUIET_MESSAGES = {"asyncio": frozenset({"socket.send() raised exception."})}


class _DropMessages(logging.Filter):
    def __init__(self, messages: frozenset[str]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.messages


class _DropCancelledConnectionHandlers(logging.Filter):
    """Python 3.11's asyncio logs a traceback when a connection's handler task is cancelled: its
    done-callback calls `task.exception()`, which raises CancelledError (3.12 checks `cancelled()`
    first). hivemind's p2pd client serves each incoming stream through such a handler, so a process
    that stops while a stream is arriving printed a traceback after a clean shutdown."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        cancelled_handler = isinstance(exc, asyncio.CancelledError) and "StreamReaderProtocol.connection_made" in str(
            record.msg
        )
        return not cancelled_handler


def _configure_logging() -> None:
    level = os.environ.get("SWARM_LOGLEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    if logging.getLogger().getEffectiveLevel() >= logging.WARNING:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.ERROR)
        for name, messages in QUIET_MESSAGES.items():
            logging.getLogger(name).addFilter(_DropMessages(messages))
        logging.getLogger("asyncio").addFilter(_DropCancelledConnectionHandlers())


def verbose(args: argparse.Namespace) -> bool:
    """--verbose, SWARM_VERBOSE=1 or SWARM_LOGLEVEL=DEBUG: print the whole configuration at start."""
    if getattr(args, "verbose", None) is not None:
        return args.verbose
    if os.environ.get("SWARM_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return os.environ.get("SWARM_LOGLEVEL", "").upper() == "DEBUG"


def _missing_initial_peers(command: str, example: str) -> ConfigError:
    return ConfigError(
        f"no --initial-peers: {command} joins a running swarm; pass the address that `swarm dht` printed, "
        f"e.g. {example} --initial-peers /ip4/<ip>/tcp/31337/p2p/Qm... (or set SWARM_INITIAL_PEERS)"
    )


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is meant for the user, from every layer."""
    from dht.authority import CredentialError
    from dht.model_match import ModelMismatchError
    from dht.node import BootstrapError
    from dht.run_specs import SpecError
    from dht.split_agreement import SplitConflictError
    from models.balanced_split import BalancedSplitError
    from models.config import UnknownModelError
    from models.hf_format import ModelFolderError
    from models.interface import UserModelError
    from models.layer_costs import ProfileError
    from models.lora import LoraUnavailableError
    from models.model_source import VocabularyError
    from models.stages import StageSplitError
    from peers.compute.checkpoint import CheckpointError
    from swarm.export.assemble import ExportError
    from swarm.generate import GenerateError
    from swarm.trainer.data import CorpusError
    from swarm.trainer.discovery import DiscoveryError
    from swarm.trainer.failures import RoutingError
    from swarm.trainer.run import ResumeError

    return (
        ConfigError,
        BootstrapError,
        UnknownModelError,
        StageSplitError,
        CorpusError,
        DiscoveryError,
        RoutingError,
        CheckpointError,
        ResumeError,
        FileNotFoundError,
        SplitConflictError,
        BalancedSplitError,
        ProfileError,
        ModelFolderError,
        ModelMismatchError,
        UserModelError,
        LoraUnavailableError,
        ExportError,
        GenerateError,
        VocabularyError,
        CredentialError,
        SpecError,
    )


def cmd_dht(args: argparse.Namespace) -> int:
    from swarm.bootstrap import BootstrapConfig, run_bootstrap

    return run_bootstrap(from_sources(BootstrapConfig, args))


def cmd_peer(args: argparse.Namespace) -> int:
    from peers.config import PeerConfig
    from peers.launch import run_peer

    config = from_sources(PeerConfig, args)
    if not config.network.initial_peers:
        raise _missing_initial_peers("a peer", "swarm peer")
    # the options the user set; the others come from the run's spec (peers/settle.py prints the result)
    run_peer(config, given_options(PeerConfig, args), verbose=verbose(args))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from swarm.trainer.config import TrainerConfig
    from swarm.trainer.run import run_trainer

    config = from_sources(TrainerConfig, args)
    if not config.network.initial_peers:
        raise _missing_initial_peers("a trainer", "swarm train")
    if verbose(args):
        print(describe(config), flush=True)
    report = run_trainer(config, given=given_options(TrainerConfig, args))
    print(done_line(report), flush=True)
    return EXIT_SIGNALLED if report.stopped_early else 0


def done_line(report) -> str:
    """The trainer's last line: the first step's loss, then the mean of the last (up to) 5 steps'."""
    loss = "no loss yet"
    if report.initial_loss is not None and report.final_loss is not None:
        tail = min(5, len(report.losses))
        last = "the last step" if tail == 1 else f"mean of the last {tail} steps"
        loss = f"loss {report.initial_loss:.4f} (first step) -> {report.final_loss:.4f} ({last})"
    return (
        f"{'stopped early' if report.stopped_early else 'done'}: {report.steps} steps, {loss}, "
        f"{report.tokens_per_s:,.0f} tokens/s, {report.microbatches_lost} microbatches lost"
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from swarm.evaluate import EvalConfig, run_eval

    return run_eval(from_sources(EvalConfig, args))


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from swarm.data.prepare import PrepareConfig, run_prepare

    return run_prepare(from_sources(PrepareConfig, args, inputs=args.inputs))


def cmd_status(args: argparse.Namespace) -> int:
    from swarm.status import StatusConfig, run_status

    config = from_sources(StatusConfig, args)
    if not config.initial_peers:
        raise _missing_initial_peers("`swarm status`", "swarm status")
    return run_status(config)


def cmd_monitor_targets(args: argparse.Namespace) -> int:
    from swarm.monitor import MonitorConfig, run_monitor_targets

    return run_monitor_targets(from_sources(MonitorConfig, args))


def cmd_profile(args: argparse.Namespace) -> int:
    from swarm.profile_cli import ProfileConfig, run_profile

    return run_profile(from_sources(ProfileConfig, args))


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.export.config import ExportConfig
    from swarm.export.run import run_export

    run_export(from_sources(ExportConfig, args))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from swarm.generate import GenerateConfig, run_generate

    return run_generate(from_sources(GenerateConfig, args))


def cmd_run_create(args: argparse.Namespace) -> int:
    from swarm.run_authority import RunCreateConfig, run_create

    return run_create(from_sources(RunCreateConfig, args), given_options(RunCreateConfig, args))


def cmd_run_update(args: argparse.Namespace) -> int:
    from swarm.run_authority import RunUpdateConfig, run_update

    return run_update(from_sources(RunUpdateConfig, args))


def cmd_run_issue(args: argparse.Namespace) -> int:
    from swarm.run_authority import RunIssueConfig, run_issue

    return run_issue(from_sources(RunIssueConfig, args))


def cmd_demo(args: argparse.Namespace) -> int:
    from swarm.demo import DemoConfig, run_demo

    return run_demo(from_sources(DemoConfig, args))


def build_parser() -> argparse.ArgumentParser:
    from peers.config import VOLUNTEER_OPTIONS, PeerConfig
    from swarm.bootstrap import BootstrapConfig
    from swarm.data.prepare import PrepareConfig
    from swarm.demo import DemoConfig
    from swarm.evaluate import EvalConfig
    from swarm.export.config import ExportConfig
    from swarm.generate import GenerateConfig
    from swarm.monitor import MonitorConfig
    from swarm.planner.plan_cli import PlanConfig, run_plan
    from swarm.profile_cli import ProfileConfig
    from swarm.run_authority import RunCreateConfig, RunIssueConfig, RunUpdateConfig
    from swarm.status import StatusConfig
    from swarm.trainer.config import TrainerConfig

    parser = argparse.ArgumentParser(
        prog="swarm",
        description="Train one model across many volunteer machines: "
        "peers serve pipeline stages, trainers stream microbatches through them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    roles = [
        ("dht", cmd_dht, BootstrapConfig, "run a bootstrap DHT node and print its multiaddrs"),
        ("peer", cmd_peer, PeerConfig, "serve one pipeline stage of a model"),
        ("train", cmd_train, TrainerConfig, "train a model through the swarm's stages"),
        ("eval", cmd_eval, EvalConfig, "the validation loss of the model the swarm holds now"),
        ("status", cmd_status, StatusConfig, "show the stages, their peers, state and throughput"),
        ("demo", cmd_demo, DemoConfig, "start a whole swarm on this machine, train, and stop it"),
        (
            "export",
            cmd_export,
            ExportConfig,
            "assemble the trained model from live peers or checkpoints into one folder",
        ),
        ("generate", cmd_generate, GenerateConfig, "sample text from an exported model folder"),
        ("profile", cmd_profile, ProfileConfig, "measure a model layer by layer and suggest a balanced stage split"),
    ]
    for name, handler, config_cls, help_text in roles:
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        # a volunteer's `swarm peer --help` lists where and how much; --help-all lists the rest
        add_config_arguments(p, config_cls, brief=VOLUNTEER_OPTIONS if name == "peer" else None)
        p.add_argument(
            "--verbose",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="print the whole configuration at start-up [env SWARM_VERBOSE]",
        )
        p.set_defaults(handler=handler)
    plan = sub.add_parser(
        "plan",
        help="assign devices to stages from a latency/bandwidth topology (DT-FM cost model)",
        description="Search a balanced assignment of devices to pipeline stages that minimises the "
        "data-parallel + pipeline communication cost of a topology file.",
    )
    add_config_arguments(plan, PlanConfig)
    plan.set_defaults(handler=run_plan)
    data = sub.add_parser("data", help="prepare a corpus: tokenizer and token shards")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="TOOL")
    prepare = data_sub.add_parser(
        "prepare",
        help="tokenize text files, folders and .jsonl(.gz) files into token shards the trainer streams",
        description="Tokenize INPUT... (text files, folders read recursively, .jsonl/.jsonl.gz with one "
        "document per line) into DIR: token shards, a validation split held out by document, "
        "tokenizer.json and meta.json. Running it again on the same inputs reuses DIR.",
    )
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, folders, .jsonl(.gz) files")
    add_config_arguments(prepare, PrepareConfig, skip=("inputs",))
    prepare.set_defaults(handler=cmd_data_prepare)
    monitor = sub.add_parser("monitor", help="tools for Prometheus monitoring of a swarm")
    monitor_sub = monitor.add_subparsers(dest="monitor_command", required=True, metavar="TOOL")
    targets = monitor_sub.add_parser(
        "targets", help="keep a Prometheus file_sd file of the peers' metrics endpoints up to date from the DHT"
    )
    add_config_arguments(targets, MonitorConfig)
    targets.set_defaults(handler=cmd_monitor_targets)
    run = sub.add_parser("run", help="a run's owner: create the run and its spec, update it, issue credentials")
    run_sub = run.add_subparsers(dest="run_command", required=True, metavar="TOOL")
    for name, handler, config_cls, help_text in (
        ("create", cmd_run_create, RunCreateConfig, "create a run: its owner key, run file and signed spec"),
        ("update", cmd_run_update, RunUpdateConfig, "publish a new version of the run's learning-rate schedule"),
        ("issue", cmd_run_issue, RunIssueConfig, "sign a credential for one trainer or peer of the run"),
    ):
        p = run_sub.add_parser(name, help=help_text, description=help_text)
        add_config_arguments(p, config_cls)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    _configure_logging()
    bind_children_to_parent()  # the DHT process and p2pd end with this process, also on SIGKILL
    remove_stale_sockets()  # what SIGKILLed processes could not remove
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (KeyboardInterrupt, StopRequested):
        print("swarm: interrupted", file=sys.stderr)
        return EXIT_SIGNALLED
    except _user_errors() as e:
        if os.environ.get("SWARM_DEBUG"):
            raise
        print(f"swarm {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def run() -> None:
    """The `swarm` command (and `python -m swarm.cli`): main(), then exit.

    Before exiting, every object still alive is frozen out of the garbage collector: the exit frees
    them all anyway, and the interpreter's last full collection over a process that holds torch and
    hivemind took seconds (a peer took 6.3 s from "offline" to exit, 0.7 s with this), which every
    `docker stop`, Ctrl-C and test teardown waited for. Everything the process must finish (offline
    record, checkpoint, reports) is done before main() returns."""
    code = main()
    gc.freeze()
    sys.exit(code)


def run_forked() -> None:
    """`run()` in a child of a fork server (process/fork_server.py, as `swarm demo` and the tests
    start their processes). hivemind's MPFuture locks are process-shared semaphores made at import:
    forked children would share the server's with every other process it forks, and one killed while
    holding one (a SIGKILLed peer's DHT sending an update) would block all the others' updates for
    good. A process started afresh has its own; so does each child, from here."""
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    run()


if __name__ == "__main__":
    run()
