"""`swarm eval`: the validation loss of whatever the swarm holds now, once.

The same validation batches as `swarm train --eval-every` (swarm/trainer/data.py
`ValidationBatches`), through the same pipeline and failover, forward only: the peers keep nothing
and count no samples, and no optimizer steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import hivemind
import torch

from dht.authority import RunAccessConfig
from dht.node import NetworkConfig, start_dht, with_p2p_client
from models.config import lora_rank
from models.model_source import DEFAULT_MODEL
from models.subspace_options import SubspaceSettings
from process.config import ConfigError, option, section
from swarm.trainer.config import CompressionSettings, CorpusSettings, DiscoverySettings, FailoverSettings
from swarm.trainer.data import ValidationBatches, model_for_data, model_tokenizer, open_data
from swarm.trainer.metrics import TrainerMetrics
from swarm.trainer.run import connect, run_access


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    model: str = option(DEFAULT_MODEL, help="model name; must match the peers'")
    model_dir: str | None = option(None, help="the Hugging Face model folder the peers serve (--model-dir)")
    trainable: str = option("all", help="the peers' --trainable (all or lora:R): part of the model's fingerprint")
    num_stages: int | None = option(None, help="number of stages (default: read from the peers' records)")
    batches: int = option(4, help="validation batches")
    batch_size: int = option(32, help="samples per batch")
    microbatch_size: int = option(4, help="samples per microbatch sent through the pipeline")
    max_in_flight: int = option(8, help="microbatches in the pipeline at once")
    json_out: str | None = option(None, help="also write {'eval_loss', 'batches', 'tokens'} to this JSON file")
    network: NetworkConfig = section(NetworkConfig, help="joining the swarm's DHT")
    authority: RunAccessConfig = section(
        RunAccessConfig, help="a private run: its run file and a credential (an open run's peers let anyone evaluate)"
    )
    corpus: CorpusSettings = section(CorpusSettings, help="the data whose validation split is used")
    discovery: DiscoverySettings = section(DiscoverySettings, help="finding the stages' replicas on the DHT")
    failover: FailoverSettings = section(FailoverSettings, help="retrying failed calls and waiting for stages")
    subspace: SubspaceSettings = section(SubspaceSettings, help="the peers' subspace options (part of the model)")

    def __post_init__(self) -> None:
        try:
            lora_rank(self.trainable)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.batches < 1 or self.batch_size < 1 or self.microbatch_size < 1 or self.max_in_flight < 1:
            raise ConfigError("batches, batch_size, microbatch_size and max_in_flight must be at least 1")
        if self.batch_size % self.microbatch_size:
            raise ConfigError(
                f"batch_size {self.batch_size} must be a multiple of microbatch_size {self.microbatch_size}"
            )


async def evaluate(config: EvalConfig, dht: hivemind.DHT, say=print) -> dict:
    data = open_data(config.corpus.data, tokenizer=model_tokenizer(config.model_dir) or "bytes", say=say)
    model_config = config.subspace.apply(
        dataclasses.replace(model_for_data(config.model, config.model_dir, data), trainable=config.trainable)
    )
    validation = ValidationBatches(
        data.val,
        seq_len=model_config.seq_len,
        batch_size=config.batch_size,
        microbatch_size=config.microbatch_size,
        count=config.batches,
    )
    if validation.warning:
        say(validation.warning)
    schedule = await connect(
        dht,
        model=model_config.name,
        model_config=model_config,
        num_stages=config.num_stages,
        discovery=config.discovery,
        failover=config.failover,
        compression=CompressionSettings(),
        max_in_flight=config.max_in_flight,
        data_source=f"data {data.folder}",
        metrics=TrainerMetrics(),
        say=say,
        access=run_access(config.authority, dht, say),
    )
    loss = await schedule.evaluate(validation.batches())
    tokens = config.batches * config.batch_size * model_config.seq_len
    return {"eval_loss": loss, "batches": config.batches, "tokens": tokens, "num_stages": schedule.num_stages}


def run_eval(config: EvalConfig, say=print) -> int:
    torch.set_num_threads(1)
    dht = start_dht(config.network, client_mode=True, models=[config.model])
    try:
        result = asyncio.run(with_p2p_client(dht, evaluate(config, dht, say)))
    finally:
        dht.shutdown()
    say(
        f"validation loss {result['eval_loss']:.4f} over {result['batches']} batches "
        f"({result['tokens']:,} tokens, {result['num_stages']} stages)"
    )
    if config.json_out:
        with open(config.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
