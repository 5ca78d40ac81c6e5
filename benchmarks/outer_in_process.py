"""The in-process convergence table of replica agreement (issue #56): exact sync against outer
rounds (DiLoCo-style, compressed, overlapped), without a network, so that rows of 2M tokens fit one
machine. Bytes are counted from the encoded payloads; the rounds are peers/replicas/outer_rounds.py,
the code the peers run.

    flock /tmp/swarm-cpu.lock .venv/bin/python benchmarks/outer_in_process.py --rows sync \\
        --out benchmarks/out/outer_in_process.json
    flock /tmp/swarm-cpu.lock .venv/bin/python benchmarks/outer_in_process.py --rows outer:100:int8 \\
        --out benchmarks/out/outer_in_process.json      # merged into the same table

Every row trains `small` split into `--stages` stages (the peers' modules, `models.stages.build_stage`,
and their seeded initialisation) with `--replicas` replicas per stage, on the same batches (the
trainer's sampler, one seed), for the same tokens, with the peers' AdamW (lr 1e-3, betas 0.9/0.95,
weight decay 0.01) and the demo's learning-rate schedule (warmup a tenth of the steps, then cosine
to a tenth). The batch's microbatches are spread over the replicas as stochastic wiring does:
microbatch m goes to replica (m // R^s) % R of stage s, so every replica of every stage serves an
equal share and meets every replica of its neighbours. Each replica steps on the mean gradient of
the samples it served (the peers' accumulation).

Rows (`--rows`, comma-separated):
* `sync`: exact sync, the reference: every step, the replicas all-reduce their gradients weighted
  by samples and all step on the mean (one process's update); bytes: a butterfly all-reduce of the
  stage's gradient, 2 (R - 1) / R times its payload (codec none) sent per replica per step;
* `none`: replicas never average (the validation loss is the mean over every chain of replicas);
* `outer:H[:CODEC][:overlap][:fragF][:lrX][:mY][:ef|:noef]`: outer rounds every H steps, the
  pseudo-gradient coded with CODEC (fp32 = none, fp16, int8, int4, topkF, e.g. topk0.01; error
  feedback on for top-k unless `noef`, off for the rest unless `ef`), optionally overlapped (applied
  H / F steps late) and in F fragments, outer lr X and Nesterov momentum Y (default 0.7 / 0.9);
  bytes: each replica's payload sent to each of the R - 1 others (an all-gather), every round.
After the last step a round still in flight is finished and any progress not yet sent goes in one
last round (counted), so every replica ends at the anchor and the table compares one model per row.

One row per invocation fits a CPU-lock turn: `--out` is read if it exists and the new rows are
merged into it (a row of the same label is replaced; the spec must match). The ratios are against
the `sync` row. Loss at equal tokens does not depend on the machine's load; `train_s` does.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_stage  # noqa: E402
from peers.compute.lr_schedule import LearningRateSchedule  # noqa: E402
from peers.replicas.averaging import allreduce_bytes_each_way  # noqa: E402
from peers.replicas.outer_rounds import Contribution, OuterRounds, OuterSchedule, PseudoGradientCodec  # noqa: E402
from peers.replicas.outer_step import OuterSettings  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, ValidationBatches, open_data  # noqa: E402
from wire.compression import NoneCodec  # noqa: E402

SYNC, NONE = "sync", "none"


@dataclass(frozen=True)
class Spec:
    """What every row of one table shares."""

    model: str = "small"
    stages: int = 2
    replicas: int = 2
    tokens: int = 2_048_000
    batch_size: int = 32
    microbatch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int | None = None  # None: a tenth of the steps (the demo's)
    seed: int = 0
    eval_batches: int = 16

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * get_model_config(self.model).seq_len

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / self.tokens_per_step))

    @property
    def schedule(self) -> LearningRateSchedule:
        warmup = max(self.steps // 10, 1) if self.warmup_steps is None else self.warmup_steps
        return LearningRateSchedule(
            lr=self.lr, warmup_steps=warmup, decay="cosine", decay_steps=max(self.steps - warmup, 1)
        )


@dataclass(frozen=True)
class Row:
    kind: str  # sync, none or outer
    every: int = 0
    codec: PseudoGradientCodec = PseudoGradientCodec()
    overlap: bool = False
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @property
    def label(self) -> str:
        if self.kind != "outer":
            return self.kind
        parts = ["outer", str(self.every), self.codec.label]
        if self.overlap:
            parts.append("overlap")
        if self.fragments > 1:
            parts.append(f"frag{self.fragments}")
        if (self.outer_lr, self.outer_momentum) != (0.7, 0.9):
            parts += [f"lr{self.outer_lr:g}", f"m{self.outer_momentum:g}"]
        return ":".join(parts)

    @property
    def schedule(self) -> OuterSchedule:
        return OuterSchedule(every_steps=self.every, fragments=self.fragments, overlap=self.overlap)


def parse_row(text: str) -> Row:
    """A row's name (module docstring) -> Row; ValueError with what is wrong."""
    if text in (SYNC, NONE):
        return Row(text)
    words = text.split(":")
    if words[0] != "outer" or len(words) < 2 or not words[1].isdigit():
        raise ValueError(f"{text!r}: a row is sync, none or outer:H[:CODEC][:overlap][:fragF][:lrX][:mY][:ef|:noef]")
    fields: dict = {"every": int(words[1])}
    codec, fraction, feedback = "none", 0.01, None
    for word in words[2:]:
        if word in ("fp32", "none", "fp16", "int8", "int4"):
            codec = "none" if word == "fp32" else word
        elif word.startswith("topk"):
            codec, fraction = "topk", float(word[4:] or 0.01)
        elif word == "overlap":
            fields["overlap"] = True
        elif word in ("ef", "noef"):
            feedback = word == "ef"
        elif word.startswith("frag") and word[4:].isdigit():
            fields["fragments"] = int(word[4:])
        elif word.startswith("lr"):
            fields["outer_lr"] = float(word[2:])
        elif word.startswith("m"):
            fields["outer_momentum"] = float(word[1:])
        else:
            raise ValueError(f"{text!r}: unknown word {word!r}")
    row = Row("outer", codec=PseudoGradientCodec(codec, topk_fraction=fraction, error_feedback=feedback), **fields)
    row.schedule  # noqa: B018 - validates every / fragments
    OuterSettings(lr=row.outer_lr, momentum=row.outer_momentum)
    return row


def flat_values(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def write_flat(module: torch.nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in module.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def chain_of(microbatch: int, stages: int, replicas: int) -> list[int]:
    """The replica of each stage that microbatch `microbatch` of a step goes through."""
    return [(microbatch // replicas**s) % replicas for s in range(stages)]


def loss_through(chain: list[torch.nn.Module], mb, *, train: bool) -> torch.Tensor:
    tokens = mb.inputs
    x = tokens
    with torch.set_grad_enabled(train):
        for stage in chain[:-1]:
            x = stage(x, tokens=tokens)
        return chain[-1](x, mb.targets, tokens=tokens)


def train_row(spec: Spec, row: Row, data, say=print) -> dict:
    config = get_model_config(spec.model)
    torch.manual_seed(spec.seed)
    base = [build_stage(config, s, spec.stages, seed=spec.seed) for s in range(spec.stages)]
    copies = 1 if row.kind == SYNC else spec.replicas  # exact sync's replicas are one model
    stages = [[copy.deepcopy(b) if r else b for r in range(copies)] for b in base]
    optimizers = [
        [torch.optim.AdamW(m.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01) for m in replicas]
        for replicas in stages
    ]
    rounds = None
    if row.kind == "outer":
        settings = OuterSettings(lr=row.outer_lr, momentum=row.outer_momentum)
        rounds = [
            [OuterRounds(flat_values(m), row.schedule, settings, row.codec) for m in replicas] for replicas in stages
        ]
    sampler = MicrobatchSampler(
        data.train,
        seq_len=config.seq_len,
        batch_size=spec.batch_size,
        microbatch_size=spec.microbatch_size,
        seed=spec.seed,
        what="the training split",
    )
    counted = {"bytes_sent": 0, "rounds": 0, "round_payload_bytes_max": 0}  # over every replica of every stage
    numels = [sum(p.numel() for p in b.parameters()) for b in base]
    sync_payload = [NoneCodec().encode(torch.zeros(n)).nbytes for n in numels]
    schedule, losses, started = spec.schedule, [], time.monotonic()
    share = spec.batch_size // copies  # samples each replica of a stage serves in a step
    for step in range(spec.steps):
        for replicas in optimizers:
            for optimizer in replicas:
                optimizer.zero_grad(set_to_none=True)
                for group in optimizer.param_groups:
                    group["lr"] = schedule.rate(step)
        step_loss = 0.0
        for index, mb in enumerate(sampler.batch(step)):
            chain = [stages[s][r] for s, r in enumerate(chain_of(index, spec.stages, copies))]
            loss = loss_through(chain, mb, train=True)
            (loss * mb.size / share).backward()
            step_loss += loss.item() * mb.size / spec.batch_size
        for replicas in optimizers:
            for optimizer in replicas:
                optimizer.step()
        losses.append(step_loss)
        if row.kind == SYNC:
            for s in range(spec.stages):
                counted["bytes_sent"] += spec.replicas * allreduce_bytes_each_way(
                    sync_payload[s] // 4, spec.replicas, 4.0
                )
        if rounds is not None:
            outer_rounds(spec, row, stages, rounds, step + 1, counted)
        if (step + 1) % 50 == 0:
            recent = losses[-50:]
            say(f"  {row.label}: step {step + 1}/{spec.steps}, train loss {sum(recent) / len(recent):.4f}, "
                f"{time.monotonic() - started:.0f} s")  # fmt: skip
    if rounds is not None:
        flush_rounds(spec, stages, rounds, counted)
    train_s = time.monotonic() - started
    apart = max(float((flat_values(m) - flat_values(replicas[0])).abs().max()) for replicas in stages for m in replicas)
    val_loss, chains = evaluate(spec, config, stages, data, differ=apart > 0)
    tokens = spec.steps * spec.tokens_per_step
    return {
        "label": row.label,
        "row": {**asdict(row), "codec": asdict(row.codec)},
        "steps": spec.steps,
        "tokens": tokens,
        "averaging_bytes_per_token_per_replica": counted["bytes_sent"] / spec.replicas / tokens,
        "bytes_sent_per_replica": counted["bytes_sent"] / spec.replicas,
        "rounds_per_stage": counted["rounds"] / spec.stages,
        "largest_round_payload_bytes": counted["round_payload_bytes_max"],
        "val_loss": val_loss,
        "val_chains": chains,
        "replicas_apart_at_end": apart,
        "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "train_losses": [round(x, 5) for x in losses],
        "train_s": train_s,
    }


def outer_rounds(spec: Spec, row: Row, stages, rounds, steps_done: int, counted: dict) -> None:
    """After the local step that made `steps_done`: the overlapped rounds due now, then the new ones."""
    schedule = row.schedule
    for s, replicas in enumerate(stages):
        states = rounds[s]
        for fragment in range(schedule.fragments):
            begun = states[0].fragments[fragment].in_flight
            if begun is not None and schedule.applied_after(begun.begun_after) == steps_done:
                finish(states, replicas, fragment)
        for fragment in schedule.begins_after(steps_done):
            begin(states, replicas, fragment, steps_done, counted)
            if not schedule.overlap:
                finish(states, replicas, fragment)


def begin(states, replicas, fragment: int, steps_done: int, counted: dict) -> None:
    for state, module in zip(states, replicas):
        flat = flat_values(module)
        begun = state.begin(fragment, flat, steps_done)
        counted["bytes_sent"] += begun.payload.nbytes * (len(states) - 1)
        counted["round_payload_bytes_max"] = max(counted["round_payload_bytes_max"], begun.payload.nbytes)
    counted["rounds"] += 1


def finish(states, replicas, fragment: int) -> None:
    """Every member holds every payload (the in-process all-gather); each applies the round itself."""
    contributions = [
        Contribution(f"replica{r}", 1.0, state.fragments[fragment].in_flight.payload) for r, state in enumerate(states)
    ]
    for state, module in zip(states, replicas):
        flat = flat_values(module)
        state.finish(fragment, flat, contributions)
        write_flat(module, flat)


def flush_rounds(spec: Spec, stages, rounds, counted: dict) -> None:
    """After training: finish what is in flight, then send what is not yet sent, in one last round."""
    for s, replicas in enumerate(stages):
        states = rounds[s]
        for fragment in range(len(states[0].fragments)):
            if states[0].fragments[fragment].in_flight is not None:
                finish(states, replicas, fragment)
            unsent = any(
                not torch.equal(state.view(flat_values(m), fragment), state.fragments[fragment].base)
                for state, m in zip(states, replicas)
            )
            if unsent:
                begin(states, replicas, fragment, spec.steps, counted)
                finish(states, replicas, fragment)


def evaluate(spec: Spec, config, stages, data, *, differ: bool) -> tuple[float, int]:
    """The validation loss: of the one model when the replicas agree, else the mean over every chain."""
    for replicas in stages:
        for m in replicas:
            m.eval()
    validation = ValidationBatches(
        data.val,
        seq_len=config.seq_len,
        batch_size=spec.batch_size,
        microbatch_size=spec.microbatch_size,
        count=spec.eval_batches,
    )
    microbatches = [mb for batch in validation.batches() for mb in batch]
    copies = len(stages[0])
    chains = [chain_of(i, spec.stages, copies) for i in range(copies**spec.stages)] if differ else [[0] * spec.stages]
    total = 0.0
    for chain in chains:
        modules = [stages[s][r] for s, r in enumerate(chain)]
        total += sum(loss_through(modules, mb, train=False).item() for mb in microbatches) / len(microbatches)
    return total / len(chains), len(chains)


def compare(rows: list[dict]) -> None:
    sync = next((r for r in rows if r["label"] == SYNC), None)
    for row in rows:
        if sync is None:
            row["fewer_bytes_than_sync"] = row["val_loss_vs_sync"] = None
            continue
        b = row["averaging_bytes_per_token_per_replica"]
        row["fewer_bytes_than_sync"] = sync["averaging_bytes_per_token_per_replica"] / b if b else None
        row["val_loss_vs_sync"] = row["val_loss"] / sync["val_loss"] - 1


def table_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'row':<34}{'B/token/replica':>16}{'fewer bytes':>13}{'val loss':>10}{'vs sync':>9}{'rounds':>8}"]
    for row in rows:
        fewer = f"{row['fewer_bytes_than_sync']:>12,.0f}x" if row.get("fewer_bytes_than_sync") else f"{'-':>13}"
        vs = f"{row['val_loss_vs_sync']:>+9.2%}" if row.get("val_loss_vs_sync") is not None else f"{'-':>9}"
        lines.append(
            f"{row['label']:<34}{row['averaging_bytes_per_token_per_replica']:>16,.2f}{fewer}"
            f"{row['val_loss']:>10.4f}{vs}{row['rounds_per_stage']:>8.0f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", required=True, help="comma-separated rows: sync, none, outer:H[:...]")
    parser.add_argument("--model", default=Spec.model)
    parser.add_argument("--stages", type=int, default=Spec.stages)
    parser.add_argument("--replicas", type=int, default=Spec.replicas)
    parser.add_argument("--tokens", type=int, default=Spec.tokens, help="training tokens per row")
    parser.add_argument("--batch-size", type=int, default=Spec.batch_size)
    parser.add_argument("--microbatch-size", type=int, default=Spec.microbatch_size)
    parser.add_argument("--lr", type=float, default=Spec.lr)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: a tenth of the steps")
    parser.add_argument("--seed", type=int, default=Spec.seed)
    parser.add_argument("--eval-batches", type=int, default=Spec.eval_batches)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", default="benchmarks/out/outer_in_process.json", help="merged into if it exists")
    args = parser.parse_args(argv)
    try:
        rows = [parse_row(text.strip()) for text in args.rows.split(",")]
    except ValueError as e:
        parser.exit(2, f"outer_in_process: error: --rows {e}\n")
    spec = Spec(
        model=args.model,
        stages=args.stages,
        replicas=args.replicas,
        tokens=args.tokens,
        batch_size=args.batch_size,
        microbatch_size=args.microbatch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        eval_batches=args.eval_batches,
    )
    microbatches = spec.batch_size // spec.microbatch_size
    if spec.batch_size % spec.microbatch_size or microbatches % spec.replicas**spec.stages:
        parser.exit(
            2, "outer_in_process: error: the batch's microbatches must split evenly over every chain of replicas\n"
        )
    earlier: dict = {}
    if os.path.exists(args.out):
        earlier = json.loads(open(args.out).read())
        if earlier.get("spec") != asdict(spec):
            parser.exit(2, f"outer_in_process: error: {args.out} holds another spec's table: {earlier.get('spec')}\n")
    torch.set_num_threads(args.threads)
    data = open_data(None, say=lambda *_: None)
    load_before = [round(x, 2) for x in os.getloadavg()]
    print(f"{spec.model}, {spec.stages} stages x {spec.replicas} replicas, {spec.steps} steps x {spec.tokens_per_step:,} "
          f"tokens = {spec.steps * spec.tokens_per_step:,} per row; load before {load_before}", flush=True)  # fmt: skip
    results = {r["label"]: r for r in earlier.get("results", [])}
    for row in rows:
        result = train_row(spec, row, data)
        result.update(load_before=load_before, load_after=[round(x, 2) for x in os.getloadavg()],
                      date=time.strftime("%Y-%m-%d %H:%M"), threads=args.threads)  # fmt: skip
        results[row.label] = result
        print(f"{row.label}: {result['averaging_bytes_per_token_per_replica']:,.2f} B/token/replica, val loss "
              f"{result['val_loss']:.4f}, {result['train_s']:.0f} s", flush=True)  # fmt: skip
        ordered = sorted(results.values(), key=lambda r: (r["label"] != SYNC, r["label"] != NONE, r["label"]))
        compare(ordered)
        write_report(args.out, {"benchmark": "outer_in_process", "spec": asdict(spec), "steps": spec.steps,
                                "tokens_per_row": spec.steps * spec.tokens_per_step, "results": ordered})  # fmt: skip
    for line in table_lines(ordered):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
