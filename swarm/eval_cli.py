"""`swarm eval`: the validation loss of whatever the swarm holds now, once, forward only through
the stages (swarm/trainer/evaluation.py), on the val split of a prepared dataset."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import torch

from dht.model_match import ModelMismatchError
from dht.node import NetworkConfig, start_dht
from dht.vocabulary import check_vocabulary
from models.model_source import model_hash, resolve_model
from process.config import ConfigError, option, section
from swarm.data.errors import DataError
from swarm.trainer.client import StageClient
from swarm.trainer.config import FailoverSettings
from swarm.trainer.data import open_training_data, validation_batches
from swarm.trainer.discovery import SwarmView, discover_num_stages, wait_for_every_stage
from swarm.trainer.evaluation import evaluate
from swarm.trainer.stage_call import StageCaller


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    model: str = option("small", help="model name; must match the peers'")
    model_dir: str | None = option(None, help="the Hugging Face model folder the peers serve (--model-dir)")
    num_stages: int | None = option(None, help="number of stages (default: read from the peers' records)")
    data: str | None = option(None, help="a folder prepared by `swarm data prepare` (default: the Shakespeare corpus)")
    batches: int = option(4, help="validation batches to run")
    batch_size: int = option(32, help="samples per batch")
    microbatch_size: int = option(4, help="samples per microbatch sent through the pipeline")
    discovery_timeout_s: float = option(120.0, help="give up if no peer of the model appears within this time")
    network: NetworkConfig = section(NetworkConfig, help="joining the swarm's DHT")
    failover: FailoverSettings = section(FailoverSettings, help="retrying failed calls and waiting for stages")

    def __post_init__(self) -> None:
        self.model = resolve_model(self.model, self.model_dir).name
        if self.batches < 1 or self.batch_size < 1 or self.microbatch_size < 1:
            raise ConfigError("batches, batch_size and microbatch_size must be at least 1")
        if self.batch_size % self.microbatch_size:
            raise ConfigError(
                f"batch_size {self.batch_size} must be a multiple of microbatch_size {self.microbatch_size}"
            )


async def evaluate_swarm(config: EvalConfig, dht, say=print) -> float:
    data = open_training_data(config.data, say)
    if not len(data.val):
        raise DataError(f"{data.folder} has no validation split; prepare the data with --val-fraction > 0")
    model_config = resolve_model(config.model, config.model_dir, data.vocab_size)
    batches = validation_batches(
        data.val,
        seq_len=model_config.seq_len,
        batch_size=config.batch_size,
        microbatch_size=config.microbatch_size,
        batches=config.batches,
    )
    num_stages = config.num_stages or await discover_num_stages(dht, config.model, config.discovery_timeout_s, say)
    client = StageClient(await dht.replicate_p2p(), model=config.model, num_stages=num_stages)
    view = SwarmView(dht, model=config.model, num_stages=num_stages, say=say, model_hash=model_hash(model_config))
    try:
        await wait_for_every_stage(view, config.discovery_timeout_s)
    except ModelMismatchError:
        check_vocabulary(view.foreign, data.vocab_size, model=config.model, mine=f"the data at {data.folder}")
        raise
    check_vocabulary(
        [r for records in view.records for r in records],
        data.vocab_size,
        model=config.model,
        mine=f"the data at {data.folder}",
    )
    caller = StageCaller(
        view, client, d_model=model_config.d_model, seq_len=model_config.seq_len, failover=config.failover, say=say
    )
    return await evaluate(caller, batches, run_id=secrets.token_hex(4))


def run_eval(config: EvalConfig) -> int:
    torch.set_num_threads(1)
    dht = start_dht(config.network, client_mode=True)
    try:
        loss = asyncio.run(evaluate_swarm(config, dht))
    finally:
        dht.shutdown()
    print(f"validation loss {loss:.4f} ({config.batches} batches of {config.batch_size})", flush=True)
    return 0
