"""The command-line surface of `swarm train` and `swarm plan`, frozen: every flag, every SWARM_*
variable and every default they had before their configs were nested by section (issue #19) is
still there. A flag that goes away, or a default that changes, must change this file too."""

from __future__ import annotations

import argparse
import re

from process.config import env_variables, from_sources, options
from swarm.cli import PROCESS_FLAGS, PROCESS_VARIABLES, build_parser
from swarm.planner.plan_config import PlanConfig
from swarm.trainer.config import TrainerConfig

NETWORK_FLAGS = {
    "--allowed-peers",
    "--announce-maddrs",
    "--host-maddrs",
    "--identity-path",
    "--initial-peers",
    "--startup-timeout-s",
    "--use-auto-relay",
    "--no-use-auto-relay",
    "--use-relay",
    "--no-use-relay",
    "--plan-signers",  # issue #30
}
NETWORK_DEFAULTS = {
    "initial_peers": [],
    "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
    "announce_maddrs": [],
    "identity_path": None,
    "startup_timeout_s": 30.0,
    "allowed_peers": [],
    "use_relay": True,
    "use_auto_relay": False,
    "plan_signers": [],  # issue #30
}

# Read from `swarm train --help` and TrainerConfig before the nesting (flat, on NetworkConfig).
TRAIN_FLAGS_BEFORE = NETWORK_FLAGS | {
    "--batch-size",
    "--codec",
    "--data",
    "--discovery-timeout-s",
    "--log-every",
    "--max-in-flight",
    "--max-retries",
    "--metrics-host",
    "--metrics-port",
    "--microbatch-size",
    "--model",
    "--model-dir",  # added deliberately: a Hugging Face model folder (models/hf_format.py)
    "--trainable",  # added deliberately: all or lora:R (models/lora.py)
    "--eval-every",  # added deliberately: validation loss through the swarm (issue #20)
    "--eval-batches",
    "--num-stages",
    "--refresh-period-s",
    "--report",
    "--resume",
    "--no-resume",
    "--seed",
    "--stage-wait-timeout-s",
    "--steps",
    "--stop-timeout-s",  # added deliberately: how long SIGTERM waits for the step in flight (issue #29)
    "--topk-fraction",
}
TRAIN_DEFAULTS_BEFORE = NETWORK_DEFAULTS | {
    "model": "small",
    "model_dir": None,
    "trainable": "all",
    "eval_every": 0,
    "eval_batches": 4,
    "num_stages": None,
    "steps": 100,
    "batch_size": 32,
    "microbatch_size": 4,
    "max_in_flight": 8,
    "stop_timeout_s": 30.0,
    "data": None,
    "seed": 0,
    "report": None,
    "resume": False,
    "refresh_period_s": 3.0,
    "max_retries": 8,
    "stage_wait_timeout_s": 300.0,
    "discovery_timeout_s": 120.0,
    "codec": "none",
    "topk_fraction": 0.1,
    "log_every": 1,
    "metrics_port": 0,
    "metrics_host": "127.0.0.1",
}

# Added since (issue #30): the run authority, both unset by default (no authority, as before).
TRAIN_FLAGS_ADDED = {"--run", "--credential"}
TRAIN_DEFAULTS_ADDED = {"run": None, "credential": None}
# Added deliberately (issue #25): spot checks of replicas' answers, off by default.
TRAIN_FLAGS_ADDED |= {"--verify-fraction"}
TRAIN_DEFAULTS_ADDED |= {"verify_fraction": 0.0}
# Added deliberately (issue #22): trainers on one run read disjoint parts of the data.
TRAIN_FLAGS_ADDED |= {"--data-shard"}
TRAIN_DEFAULTS_ADDED |= {"data_shard": "0/1"}
# Added deliberately (issue #23): activations stage to stage instead of through the trainer; direct by
# default since session 19 (measured better than hub: benchmarks/RESULTS.md, "Direct routing on world4").
TRAIN_FLAGS_ADDED |= {"--routing"}
TRAIN_DEFAULTS_ADDED |= {"routing": "direct"}
# Added deliberately (issue #23): direct routing's replicas timed on the trainer's clock; off by default.
TRAIN_FLAGS_ADDED |= {"--hub-timing-fraction"}
TRAIN_DEFAULTS_ADDED |= {"hub_timing_fraction": 0.0}
# Added deliberately (issue #22): gradient clipping by the global norm over every stage; off by default.
TRAIN_FLAGS_ADDED |= {"--clip-grad-norm"}
TRAIN_DEFAULTS_ADDED |= {"clip_grad_norm": 0.0}
# Added deliberately (issue #27): subspace compression at stage boundaries; off by default.
TRAIN_FLAGS_ADDED |= {"--subspace-rank", "--subspace-kind"}
TRAIN_DEFAULTS_ADDED |= {"subspace_rank": 0, "subspace_kind": "fixed"}
# Added deliberately (issue #27): what --codec adaptive may cost in validation loss; only adaptive reads it.
TRAIN_FLAGS_ADDED |= {"--codec-loss-budget"}
TRAIN_DEFAULTS_ADDED |= {"codec_loss_budget": 0.02}
# Added deliberately (issue #55): calls over the peers' data plane (direct TLS), p2pd the fallback; on.
TRAIN_FLAGS_ADDED |= {"--data-plane", "--no-data-plane"}
TRAIN_DEFAULTS_ADDED |= {"data_plane": True}
# Added deliberately (issue #56): outer-rounds replicas' commits in the background; the default since the
# calls name the commit they follow (benchmarks/RESULTS.md, "Outer rounds": no cost in validation loss).
TRAIN_FLAGS_ADDED |= {"--outer-commits"}
TRAIN_DEFAULTS_ADDED |= {"outer_commits": "background"}

# Read from `swarm plan --help` before it had a config (flags added by hand with argparse).
PLAN_FLAGS_BEFORE = NETWORK_FLAGS | {
    "--activation-wire-ratio",
    "--c-dp-gb",
    "--c-pp-gb",
    "--from-dht",
    "--macro-batch-samples",
    "--max-link-age-s",
    "--method",
    "--model",
    "--out",
    "--patience-rounds",
    "--placement",
    "--plan-ttl-s",
    "--profile",
    "--publish",
    "--save-topology",
    "--seed",
    "--split-boundaries",
    "--stages",
    "--time-limit-s",
    "--topology",
}
PLAN_FLAGS_ADDED = {"--no-from-dht", "--no-publish"}  # booleans are BooleanOptionalAction, as in every command
PLAN_DEFAULTS_BEFORE = NETWORK_DEFAULTS | {
    "topology": None,
    "out": None,
    "seed": 0,
    "time_limit_s": 60.0,
    "patience_rounds": 30,
    "method": "search",
    "placement": "best",
    "profile": None,
    "split_boundaries": None,
    "macro_batch_samples": None,
    "activation_wire_ratio": 1.0,
    "from_dht": False,
    "model": "small",
    "stages": None,
    "c_pp_gb": None,
    "c_dp_gb": None,
    "max_link_age_s": 600.0,
    "publish": False,
    "plan_ttl_s": 3600.0,
    "save_topology": None,
}
# Before, only the network options of `swarm plan` had variables (issue #29); now every flag has one.
PLAN_VARIABLES_BEFORE = {f"SWARM_{name.upper()}" for name in NETWORK_DEFAULTS}


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def flags(name: str) -> set[str]:
    return {s for a in subcommand(name)._actions for s in a.option_strings} - {"-h", "--help"} - PROCESS_FLAGS


def documented_variables(name: str) -> set[str]:
    """The variables `swarm NAME --help` names, one `[env SWARM_...]` per flag."""
    return set(re.findall(r"\[env (SWARM_\w+)\]", " ".join(subcommand(name).format_help().split()))) - PROCESS_VARIABLES


def leaf_values(config) -> dict:
    values = {}
    for path, field, _ in options(type(config)):
        holder = config
        for part in path:
            holder = getattr(holder, part)
        values[field.name] = getattr(holder, field.name)
    return values


def variable_of(flag: str) -> str:
    return "SWARM_" + flag.removeprefix("--").removeprefix("no-").replace("-", "_").upper()


def test_swarm_train_keeps_every_flag_variable_and_default():
    assert flags("train") == TRAIN_FLAGS_BEFORE | TRAIN_FLAGS_ADDED
    expected_variables = {variable_of(f) for f in TRAIN_FLAGS_BEFORE | TRAIN_FLAGS_ADDED}
    assert documented_variables("train") == env_variables(TrainerConfig) == expected_variables
    args = build_parser().parse_args(["train"])
    assert leaf_values(from_sources(TrainerConfig, args, env={})) == TRAIN_DEFAULTS_BEFORE | TRAIN_DEFAULTS_ADDED


def test_swarm_plan_keeps_every_flag_and_default_and_now_has_a_variable_per_flag():
    assert flags("plan") == PLAN_FLAGS_BEFORE | PLAN_FLAGS_ADDED
    expected_variables = {variable_of(f) for f in PLAN_FLAGS_BEFORE}
    assert PLAN_VARIABLES_BEFORE < expected_variables
    assert documented_variables("plan") == env_variables(PlanConfig) == expected_variables
    args = build_parser().parse_args(["plan", "--topology", "t.json", "--out", "p.json"])
    defaults = leaf_values(from_sources(PlanConfig, args, env={}))
    assert {**defaults, "topology": None, "out": None} == PLAN_DEFAULTS_BEFORE  # (both required: given)
    assert (str(defaults["topology"]), str(defaults["out"])) == ("t.json", "p.json")


def test_a_plan_variable_sets_its_option_and_a_flag_wins_over_it():
    env = {"SWARM_TIME_LIMIT_S": "5", "SWARM_TOPOLOGY": "t.json", "SWARM_OUT": "p.json", "SWARM_METHOD": "opfence"}
    config = from_sources(PlanConfig, build_parser().parse_args(["plan", "--method", "search"]), env=env)
    assert (config.search.time_limit_s, str(config.topology), config.search.method) == (5.0, "t.json", "search")
