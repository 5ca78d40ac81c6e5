"""`swarm export`: gather every stage (live replicas or checkpoint folders), check that they make one
model, and write one folder: `model.safetensors`, `config.json` (a Hugging Face GPT-2 or Llama
folder, models/hf_format.py), `swarm.json` (where each stage came from), and a tokenizer
(`tokenizer.json` of `--data`, or the byte tokenizer of a byte-level run).

A user architecture (`--model module.path:function`, models/interface.py) and a learned-subspace
model (models/subspace.py) have no transformers class to load them: their folder is in the
project's own format (models/project_folder.py: `model.safetensors` in the project's tensor naming,
`swarm.json` with the config and the split, and the tokenizer), which `swarm generate` loads, and
the export says so in one line. A fixed-subspace model only constrains its weights: its subspace is
folded into them (models/subspace.py `fold_fixed_subspace`) and it is written as a plain GPT-2 or
Llama folder.

The folder is written beside `--out` under a temporary name and renamed, so `--out` is complete or
absent; an existing `--out` is refused unless `--overwrite`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import tempfile
import time

from dht.announce import fetch_stage_records_async
from dht.authority import load_run_access
from dht.model_match import check_same_model
from dht.node import start_dht, with_p2p_client
from models.config import GPTConfig
from models.hf_format import TOKENIZER_FILE, write_model_folder
from models.model_source import model_hash, resolve_model
from models.project_folder import needs_project_folder, write_project_folder
from models.subspace import fold_fixed_subspace
from swarm.data.tokenizer import byte_tokenizer
from swarm.export.adapters import adapter_rank, merge_parts, write_adapters
from swarm.export.assemble import (
    ExportError,
    StagePart,
    assemble_state,
    block_boundaries,
    check_stages_fit,
    choose_replica,
    describe_steps,
    same_step,
)
from swarm.export.config import ExportConfig
from swarm.export.live import download_snapshot, find_split
from swarm.export.offline import read_checkpoint_parts

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BYTE_VOCAB_SIZE = 256
USER_ARCHITECTURE_NOTE = (
    "the weights are in the project's own tensor naming (what --init-weights reads): a transformers "
    "folder needs a known architecture (gpt2 or llama), and a user architecture is none; `swarm generate` loads it"
)
LEARNED_SUBSPACE_NOTE = (
    "a learned subspace's boundary projections and token anchors are no transformers layer: the folder is in "
    "the project's own format (models/project_folder.py), which `swarm generate` loads"
)


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out: str
    config: GPTConfig
    steps_done: int
    sources: dict[int, str]
    warnings: list[str]


def pick_stages(replicas: dict[int, list[StagePart]], say=print) -> tuple[dict[int, StagePart], list[str]]:
    """The most-trained replica of each stage, and one warning per stage whose replicas disagree."""
    chosen, warnings = {}, []
    for stage, parts in sorted(replicas.items()):
        choice = choose_replica(parts)
        chosen[stage] = choice.part
        if choice.disagreement:
            warnings.append(f"warning: {choice.disagreement}")
            say(warnings[-1])
    return chosen, warnings


def tokenizer_source(data: str | None, model_dir: str | None = None) -> str | None:
    """The tokenizer.json to copy: the prepared data's, else the model folder's (--model-dir), else
    None (a byte run gets the byte tokenizer; `check_tokenizer` refuses any other run)."""
    if data is None:
        own = os.path.join(model_dir, TOKENIZER_FILE) if model_dir else None
        return own if own and os.path.isfile(own) else None
    path = os.path.join(data, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ExportError(f"--data {data!r} has no {TOKENIZER_FILE} (a folder made by `swarm data prepare` has one)")
    return path


def check_tokenizer(config: GPTConfig, tokenizer: str | None) -> None:
    """A folder without its tokenizer cannot be sampled from or loaded by AutoTokenizer: refuse to
    write one, unless the vocabulary is bytes (whose tokenizer the export writes itself)."""
    if tokenizer is None and config.vocab_size != BYTE_VOCAB_SIZE:
        raise ExportError(
            f"the model's vocabulary is {config.vocab_size:,} tokens, and only the run's prepared data holds "
            "their tokenizer: pass --data DIR (the folder `swarm data prepare` made, or the trainer's --data)"
        )


def write_export(
    config: GPTConfig,
    chosen: dict[int, StagePart],
    out: str,
    *,
    data: str | None,
    overwrite: bool,
    extra_meta: dict,
    seed: int = 0,
    model_dir: str | None = None,
) -> str:
    """Write the folder atomically: everything into a temporary folder beside `out`, then one rename.
    `seed`: the peers' --seed, from which a fixed subspace's basis derives."""
    out = os.path.normpath(out)
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out!r} already exists; choose another --out or pass --overwrite")
    tokenizer = tokenizer_source(data, model_dir)
    check_tokenizer(config, tokenizer)
    boundaries = block_boundaries(chosen)
    state = assemble_state(chosen, boundaries=boundaries)
    if config.subspace_rank and config.subspace_kind == "fixed":  # a plain model computes the same
        state = fold_fixed_subspace(config, state, seed)
        extra_meta = {**extra_meta, "folded_subspace": {"kind": "fixed", "rank": config.subspace_rank, "seed": seed}}
        config = dataclasses.replace(config, subspace_rank=0)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export.", dir=parent)
    try:
        if needs_project_folder(config):
            folder = write_project_folder(
                config, state, os.path.join(staging, "model"), boundaries=boundaries, extra_meta=extra_meta
            )
            if tokenizer is not None:
                shutil.copyfile(tokenizer, os.path.join(folder, TOKENIZER_FILE))
        else:
            folder = write_model_folder(
                config, state, os.path.join(staging, "model"), tokenizer_json=tokenizer, extra_meta=extra_meta
            )
        if tokenizer is None and config.vocab_size == BYTE_VOCAB_SIZE:
            with open(os.path.join(folder, TOKENIZER_FILE), "w") as f:
                f.write(byte_tokenizer().to_str())
        source_config = os.path.join(os.path.dirname(tokenizer), TOKENIZER_CONFIG_FILE) if tokenizer else None
        if source_config and os.path.isfile(source_config):  # the data's or the folder's: its special tokens
            shutil.copyfile(source_config, os.path.join(folder, TOKENIZER_CONFIG_FILE))
        elif os.path.exists(os.path.join(folder, TOKENIZER_FILE)):
            # transformers' AutoTokenizer takes tokenizer.json as it is with this class (no per-model rebuild)
            with open(os.path.join(folder, TOKENIZER_CONFIG_FILE), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
        if os.path.exists(out):
            trash = os.path.join(staging, "old")
            os.replace(out, trash)
        os.replace(folder, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def gather_offline(config: ExportConfig, model_config: GPTConfig, say=print):
    replicas, boundaries = read_checkpoint_parts(config.checkpoint_dir, config.model, model_config.n_layers)
    files = sum(len(ps) for ps in replicas.values())
    say(f"[export] read {files} checkpoint(s) of {config.model}: stages {sorted(replicas)} of {len(boundaries) - 1}")
    return replicas, boundaries, []


async def gather_live(dht, config: ExportConfig, say=print):
    num_stages, boundaries = await find_split(dht, config.model, config.num_stages, config.wait_s)
    access = load_run_access(config.authority, peer_id=dht.peer_id.to_base58())
    replicas = await download_snapshot(
        dht,
        config.model,
        num_stages,
        wait_s=config.wait_s,
        timeout_s=config.download_timeout_s,
        say=say,
        credential=access.credential.decode() if access and access.credential else None,
    )
    records = [r for s in range(num_stages) for r in await fetch_stage_records_async(dht, config.model, s)]
    return replicas, boundaries, records


def run_export(config: ExportConfig, say=print) -> ExportResult:
    started = time.monotonic()
    model_config = config.subspace.apply(resolve_model(config.model, config.model_dir))
    if os.path.exists(config.out) and not config.overwrite:  # before any download
        raise ExportError(f"{config.out!r} already exists; choose another --out or pass --overwrite")
    if config.data is not None:
        tokenizer_source(config.data)
    if config.checkpoint_dir:
        replicas, boundaries, records = gather_offline(config, model_config, say)
    else:
        dht = start_dht(config, client_mode=True, models=[config.model])
        try:
            replicas, boundaries, records = asyncio.run(with_p2p_client(dht, gather_live(dht, config, say)))
        finally:
            dht.shutdown()
    chosen, warnings = pick_stages(replicas, say)
    rank = adapter_rank(chosen)
    if rank is None and config.adapters_only:
        raise ExportError("--adapters-only: these stages hold full weights (--trainable all), not adapters")
    if rank is not None:  # the base weights are the peers' starting point; the adapters go on top
        vocab = config.vocab_size or next((r.vocab_size for r in records if r.vocab_size), None)
        model_config = config.subspace.apply(
            dataclasses.replace(resolve_model(config.model, config.model_dir, vocab), trainable=f"lora:{rank}")
        )
        check_same_model(records, model_hash(model_config), model=config.model, who="export")
        bounds = tuple(boundaries) if boundaries else block_boundaries(chosen)
        if config.adapters_only:
            out = write_adapters(model_config, chosen, bounds, rank, config.out, overwrite=config.overwrite)
            say(f"[export] wrote the rank-{rank} adapters of {config.model} to {out}")
            return ExportResult(
                out, model_config, chosen[0].steps_done, {s: p.source for s, p in chosen.items()}, warnings
            )
        say(f"[export] merging rank-{rank} adapters into the base weights")
        chosen = merge_parts(
            model_config, chosen, bounds, seed=config.seed, model_dir=config.model_dir, init_weights=config.init_weights
        )
        model_config = dataclasses.replace(model_config, trainable="all")
    # Replicas that agree step together, so their stages must be at one step; independent replicas
    # (a stage whose replicas disagree) each step on their share, and steps no longer line up.
    model_config = check_stages_fit(model_config, chosen, boundaries=boundaries, steps_must_match=not warnings)
    if not same_step(chosen):
        warnings.append(
            f"warning: the stages are at different steps ({describe_steps(chosen)}): replicas that do not "
            "average each step on their own share of the samples"
        )
        say(warnings[-1])
    if rank is None:
        check_same_model(records, model_hash(model_config), model=config.model, who="export")
    steps = chosen[0].steps_done
    parameters = sum(t.numel() for p in chosen.values() for t in p.state.values())
    sources = {s: p.source for s, p in sorted(chosen.items())}
    meta = {
        "model": config.model,
        "steps_done": steps,
        "stage_steps": {str(s): p.steps_done for s, p in sorted(chosen.items())},
        "num_stages": len(chosen),
        "boundaries": list(block_boundaries(chosen)),
        "sources": {str(s): src for s, src in sources.items()},
    }
    out = write_export(
        model_config,
        chosen,
        config.out,
        data=config.data,
        overwrite=config.overwrite,
        extra_meta=meta,
        seed=config.seed,
        model_dir=config.model_dir,
    )
    say(
        f"[export] wrote {out}: {config.model} ({model_config.arch}, {parameters:,} parameters, "
        f"vocabulary {model_config.vocab_size}) after {steps} steps, from {len(chosen)} stages "
        f"in {time.monotonic() - started:.1f} s"
    )
    if model_config.arch == "user":
        say(f"[export] note: {USER_ARCHITECTURE_NOTE}")
    elif needs_project_folder(model_config):
        say(f"[export] note: {LEARNED_SUBSPACE_NOTE}")
    return ExportResult(out, model_config, steps, sources, warnings)
