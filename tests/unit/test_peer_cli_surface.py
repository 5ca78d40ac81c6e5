"""The peer's command-line surface is frozen: every flag and SWARM_* variable `swarm peer` had when its
configuration was flat (59 fields and the network's 8) keeps its name now that `PeerConfig` is nested
by section. A flag may be added here on purpose; none may disappear or be renamed by accident (the
14 --fault-* flags became one developer option, --faults, on purpose: issue #58)."""

from __future__ import annotations

import argparse
import dataclasses

from peers.config import PeerConfig
from process.config import env_variables, options
from swarm.cli import PROCESS_FLAGS, build_parser

PEER_FLAGS = {
    "--faults",  # issue #58: the fault injection of tests and benchmarks, one developer option (was 14 --fault-*)
    "--run",  # issue #30: the run authority
    "--credential",
    "--activation-cache-size",
    "--allowed-peers",
    "--announce-maddrs",
    "--announce-period-s",
    "--averaging",
    "--averaging-compression",
    "--averaging-every-steps",
    "--averaging-period-s",
    "--averaging-timeout-s",
    "--sync-delay",
    "--sync-delay-from",  # added deliberately: exact steps before the delay begins (issue #22)
    "--weight-prediction",  # added deliberately: weight prediction with --sync-delay 1 (issue #22)
    "--subspace-rank",  # added deliberately: subspace compression at stage boundaries (issue #27)
    "--subspace-kind",
    "--averaging-matchmaking-s",
    "--averaging-groups",  # added deliberately: rounds in the group the trainer's commit names (issue #22)
    "--averaging-loss-budget",  # added deliberately: the loss `--averaging auto` may trade for speed (issue #56)
    "--robust-averaging",  # added deliberately: robust reduction of the replicas' all-reduce (issue #25)
    "--bad-request-burst",
    "--bad-request-refill-per-s",
    "--checkpoint-dir",
    "--checkpoint-period-s",
    "--device",
    "--host-maddrs",
    "--lr-decay",  # added deliberately: the learning-rate schedule (issue #22)
    "--lr-decay-steps",
    "--lr-floor",
    "--warmup-steps",
    "--identity-path",
    "--init-weights",
    "--initial-peers",
    "--link-probe-peers",
    "--link-probe-period-s",
    "--load-state",
    "--lr",
    "--max-batch-size",
    "--max-concurrent-requests",
    "--max-request-mb",
    "--max-decoded-mb",  # issue #30
    "--max-in-flight-mb",  # issue #30
    "--hop-record-mb",  # issue #23: hop records for direct routing's spot checks
    "--hop-piece-kb",  # issue #23: a hop in pieces, each under a new stream's window
    "--data-plane",  # issue #55: calls over direct TLS connections, p2pd the fallback
    "--no-data-plane",
    "--data-plane-port",  # issue #55
    "--data-plane-announce-port",  # issue #55
    "--request-deadline-s",  # issue #30
    "--plan-signers",  # issue #30
    "--memory-limit-gb",
    "--metrics-host",
    "--metrics-port",
    "--model",
    "--model-dir",  # added deliberately: a Hugging Face model folder (models/hf_format.py)
    "--trainable",  # added deliberately: all or lora:R (models/lora.py)
    "--vocab-size",  # added deliberately: the vocabulary is the data's (swarm/data)
    "--no-load-state",
    "--no-standby",
    "--no-use-auto-relay",
    "--no-use-relay",
    "--num-layers",
    "--num-stages",
    "--num-threads",
    "--optimizer",
    "--outer-lr",
    "--outer-momentum",
    "--outer-codec",  # issue #56
    "--outer-topk-fraction",
    "--outer-error-feedback",
    "--outer-overlap",
    "--no-outer-overlap",
    "--outer-fragments",
    "--averaging-transport",
    "--precision",
    "--reachability-check",
    "--rebalance-loss-delay-s",
    "--rebalance-loss-watch-s",
    "--rebalance-min-gain",
    "--rebalance-period-s",
    "--seed",
    "--split-boundaries",
    "--stage",
    "--standby",
    "--standby-check-s",
    "--standby-refresh-s",
    "--standby-take-over-fraction",
    "--startup-timeout-s",
    "--status-file",
    "--target-batch-size",
    "--use-auto-relay",
    "--use-relay",
    "--weight-decay",
}
PEER_VARIABLES = {
    "SWARM_FAULTS",  # issue #58
    "SWARM_RUN",
    "SWARM_CREDENTIAL",
    "SWARM_ACTIVATION_CACHE_SIZE",
    "SWARM_ALLOWED_PEERS",
    "SWARM_MODEL_DIR",
    "SWARM_TRAINABLE",
    "SWARM_VOCAB_SIZE",
    "SWARM_ANNOUNCE_MADDRS",
    "SWARM_ANNOUNCE_PERIOD_S",
    "SWARM_AVERAGING",
    "SWARM_AVERAGING_COMPRESSION",
    "SWARM_AVERAGING_EVERY_STEPS",
    "SWARM_AVERAGING_PERIOD_S",
    "SWARM_AVERAGING_TIMEOUT_S",
    "SWARM_ROBUST_AVERAGING",  # added deliberately (issue #25)
    "SWARM_BAD_REQUEST_BURST",
    "SWARM_BAD_REQUEST_REFILL_PER_S",
    "SWARM_CHECKPOINT_DIR",
    "SWARM_CHECKPOINT_PERIOD_S",
    "SWARM_DEVICE",
    "SWARM_HOST_MADDRS",
    "SWARM_LR_DECAY",
    "SWARM_LR_DECAY_STEPS",
    "SWARM_LR_FLOOR",
    "SWARM_WARMUP_STEPS",
    "SWARM_IDENTITY_PATH",
    "SWARM_INITIAL_PEERS",
    "SWARM_INIT_WEIGHTS",
    "SWARM_LINK_PROBE_PEERS",
    "SWARM_LINK_PROBE_PERIOD_S",
    "SWARM_LOAD_STATE",
    "SWARM_LR",
    "SWARM_MAX_BATCH_SIZE",
    "SWARM_MAX_CONCURRENT_REQUESTS",
    "SWARM_MAX_REQUEST_MB",
    "SWARM_MAX_DECODED_MB",  # issue #30
    "SWARM_MAX_IN_FLIGHT_MB",  # issue #30
    "SWARM_HOP_RECORD_MB",  # issue #23
    "SWARM_DATA_PLANE",  # issue #55
    "SWARM_DATA_PLANE_PORT",  # issue #55
    "SWARM_DATA_PLANE_ANNOUNCE_PORT",  # issue #55
    "SWARM_HOP_PIECE_KB",
    "SWARM_REQUEST_DEADLINE_S",  # issue #30
    "SWARM_PLAN_SIGNERS",  # issue #30
    "SWARM_MEMORY_LIMIT_GB",
    "SWARM_METRICS_HOST",
    "SWARM_METRICS_PORT",
    "SWARM_MODEL",
    "SWARM_NUM_LAYERS",
    "SWARM_NUM_STAGES",
    "SWARM_NUM_THREADS",
    "SWARM_OPTIMIZER",
    "SWARM_OUTER_LR",
    "SWARM_OUTER_MOMENTUM",
    "SWARM_OUTER_CODEC",  # issue #56
    "SWARM_OUTER_TOPK_FRACTION",
    "SWARM_OUTER_ERROR_FEEDBACK",
    "SWARM_OUTER_OVERLAP",
    "SWARM_OUTER_FRAGMENTS",
    "SWARM_AVERAGING_TRANSPORT",
    "SWARM_PRECISION",
    "SWARM_REACHABILITY_CHECK",
    "SWARM_REBALANCE_LOSS_DELAY_S",
    "SWARM_REBALANCE_LOSS_WATCH_S",
    "SWARM_REBALANCE_MIN_GAIN",
    "SWARM_REBALANCE_PERIOD_S",
    "SWARM_SEED",
    "SWARM_SPLIT_BOUNDARIES",
    "SWARM_STAGE",
    "SWARM_STANDBY",
    "SWARM_STANDBY_CHECK_S",
    "SWARM_STANDBY_REFRESH_S",
    "SWARM_STANDBY_TAKE_OVER_FRACTION",
    "SWARM_STARTUP_TIMEOUT_S",
    "SWARM_STATUS_FILE",
    "SWARM_SYNC_DELAY",
    "SWARM_SYNC_DELAY_FROM",
    "SWARM_WEIGHT_PREDICTION",
    "SWARM_SUBSPACE_RANK",
    "SWARM_SUBSPACE_KIND",
    "SWARM_AVERAGING_MATCHMAKING_S",
    "SWARM_AVERAGING_GROUPS",
    "SWARM_AVERAGING_LOSS_BUDGET",
    "SWARM_TARGET_BATCH_SIZE",
    "SWARM_USE_AUTO_RELAY",
    "SWARM_USE_RELAY",
    "SWARM_WEIGHT_DECAY",
}


def _peer_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["peer"]


def test_swarm_peer_lists_every_flag_it_always_had():
    flags = (
        {flag for action in _peer_parser()._actions for flag in action.option_strings}
        - {"-h", "--help"}
        - PROCESS_FLAGS
    )
    assert flags == PEER_FLAGS


def test_every_peer_option_keeps_its_environment_variable():
    assert env_variables(PeerConfig) == PEER_VARIABLES


def test_no_section_shares_its_name_with_an_option():
    """`from_sources(PeerConfig, averaging=...)` names an option or a section, never both."""
    sections = {f.name for f in dataclasses.fields(PeerConfig) if "section" in f.metadata}
    assert sections and not sections & {field.name for _, field, _ in options(PeerConfig)}
