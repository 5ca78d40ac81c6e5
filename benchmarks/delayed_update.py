"""What a one-step-late update costs in loss, the optimizer alone (issue #22): `--sync-delay 1`
applies step t's averaged gradient after step t+1's forward and backward, so every gradient is
computed on parameters one update old. This trains the demo's model in one process on the same
batches, exact and one step late, with a constant learning rate and with the demo's schedule
(warmup for a tenth of the steps, then cosine to a tenth), and reports the validation loss at
checkpoints along the way (equal tokens), so the gap can be read against the number of steps.

It measures the staleness alone: no swarm, no averaging, no timing (the swarm with the same delay
equals this loop to 1e-5: tests/integration/test_replicas.py `delayed_reference`).

    nice -n 10 .venv/bin/python benchmarks/delayed_update.py --model small --steps 200 \\
        --checkpoints 20,50,100,200 --out benchmarks/out/delayed_update.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from collections.abc import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.lr_schedule import schedule_settings  # noqa: E402
from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from models.stages import build_full_model  # noqa: E402
from peers.compute.stage_runtime import OptimizerSettings  # noqa: E402
from peers.compute.weight_prediction import is_plain_adamw, trial_update  # noqa: E402
from swarm.trainer.data import MicrobatchSampler, ValidationBatches, open_data  # noqa: E402


def validation_loss(model, validation: ValidationBatches) -> float:
    with torch.no_grad():
        losses = [
            model(torch.cat([mb.inputs for mb in batch]), torch.cat([mb.targets for mb in batch])).item()
            for batch in validation.batches()
        ]
    return sum(losses) / len(losses)


@torch.no_grad()
def linear_adamw_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    gradients: Sequence[torch.Tensor],
    rate: float,
) -> list[torch.Tensor]:
    """Row `late_local_linear` (measured worse; not a peer option): AdamW's next update with its
    second moment held where it is, linear in `gradients`, so that the mean of the replicas'
    predictions is the prediction of their mean gradient. Falls back to
    `trial_update` for another optimizer, a parameter without state yet (the first step), or
    AdamW's amsgrad / maximize."""
    if not is_plain_adamw(optimizer):
        return trial_update(optimizer, params, gradients, rate)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    states = [optimizer.state.get(p) for p in params]
    if any(not state or float(state["step"]) < 1 for state in states):
        return trial_update(optimizer, params, gradients, rate)
    updates = []
    for param, gradient, state in zip(params, gradients, states):
        group = group_of[id(param)]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        first = (beta1 * state["exp_avg"] + (1 - beta1) * gradient) / (1 - beta1 ** (step + 1))
        second = state["exp_avg_sq"] / (1 - beta2**step)
        updates.append(-rate * group["weight_decay"] * param.detach() - rate * first / (second.sqrt() + group["eps"]))
    return updates


def local_step_gradients(model, params, real, local_steps, microbatches, replicas: int):
    """One step with `local-step` prediction: each replica's share of the microbatches on the real
    parameters plus its predicted update (none before the first). Returns the batch's mean loss and
    each replica's mean gradients."""
    share = -(-len(microbatches) // replicas)
    losses, gradients = [], []
    for index in range(replicas):
        mine = microbatches[index * share : (index + 1) * share]
        with torch.no_grad():
            for i, (param, base) in enumerate(zip(params, real)):
                param.copy_(base + local_steps[index][i] if local_steps else base)
        model.zero_grad(set_to_none=True)
        loss = model(torch.cat([mb.inputs for mb in mine]), torch.cat([mb.targets for mb in mine]))
        loss.backward()
        losses.append(loss.item())
        gradients.append([p.grad.clone() for p in params])
    return sum(losses) / len(losses), gradients


def train(
    args,
    data,
    settings: OptimizerSettings,
    delay: int,
    checkpoints: list[int],
    predict: bool = False,
    delay_from: int = 0,
    local_replicas: int = 0,
    blend: bool = False,
    linear: bool = False,
) -> dict:
    """`args.steps` steps; the gradient of step t is applied `delay` steps late (the k-th update
    applied uses the rate of step k, as a stage's own step count does). At each checkpoint (a number
    of batches trained: equal tokens) the validation loss of the model with what still waits applied,
    as the trainer's flush at the end of a run does; training then goes on from before that flush.

    `predict` (weight prediction, after PipeMare/SpecTrain): forwards and backwards run on the
    parameters plus the last update applied (a guess at the parameters the exact schedule would
    use, one update further), while the optimizer steps the real ones.

    `delay_from`: steps before it are exact (their update applied before the next forward); the
    delay begins with that step's gradient (as ZeRO-Offload's delayed parameter update does, after
    the first steps, where the parameters move most). With `local_replicas`, the first late step
    computes on the exact parameters and the prediction begins with the next.

    `local_replicas` R (weight prediction `local-step`, with `delay`): the batch's microbatches are
    split among R replicas in order, and each replica computes its share on the real parameters plus
    the update the optimizer would make from its own share's mean gradient of the step before (what
    a replica holds while its group averages); the optimizer steps the real parameters with the
    whole batch's mean, as the group's average. R=1 is the exact schedule computed one step late.
    `blend`: each replica predicts from its share's gradient times 1/R plus the last averaged
    gradient times 1 - 1/R (the others' shares guessed as the last mean) instead of its share's."""
    config = dataclasses.replace(get_model_config(args.model), vocab_size=data.vocab_size)
    torch.manual_seed(0)
    model = build_full_model(config)
    params = list(model.parameters())
    optimizer = settings.build(params)
    schedule = settings.schedule()
    sampler = MicrobatchSampler(data.train, seq_len=config.seq_len, batch_size=args.batch_size, microbatch_size=4)
    validation = ValidationBatches(data.val, seq_len=config.seq_len, batch_size=32, microbatch_size=4, count=4)
    losses, waiting, applied, val, started = [], [], [0], {}, time.perf_counter()
    real = [p.detach().clone() for p in params]  # what the optimizer steps; `params` may hold a prediction
    last = [torch.zeros_like(p) for p in params]  # the last update applied
    local_steps: list[list[torch.Tensor]] = []  # local-step prediction: each replica's predicted update

    @torch.no_grad()
    def apply(gradients, next_step: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = schedule.rate(applied[0])
        for param, base, gradient in zip(params, real, gradients):
            param.copy_(base)
            param.grad = gradient
        optimizer.step()
        for param, base, update in zip(params, real, last):
            update.copy_(param - base)
            base.copy_(param)
            if predict and next_step >= delay_from:
                param.add_(update)
        applied[0] += 1

    for step in range(args.steps):
        microbatches = sampler.batch(step)
        local = bool(local_replicas and delay and step >= delay_from)  # exact before `delay_from`
        if local:
            loss_value, local_gradients = local_step_gradients(
                model, params, real, local_steps, microbatches, local_replicas
            )
            losses.append(loss_value)
            waiting.append([sum(g) / len(g) for g in zip(*local_gradients)])
        else:
            model.zero_grad(set_to_none=True)
            loss = model(torch.cat([mb.inputs for mb in microbatches]), torch.cat([mb.targets for mb in microbatches]))
            loss.backward()
            losses.append(loss.item())
            waiting.append([p.grad.clone() for p in params])
        applied_now = None
        while len(waiting) > (delay if step >= delay_from else 0):
            applied_now = waiting.pop(0)
            apply(applied_now, step + 1)
        if local:
            if blend and applied_now is not None:
                local_gradients = [
                    [
                        mine / local_replicas + mean * (1 - 1 / local_replicas)
                        for mine, mean in zip(gradients, applied_now)
                    ]
                    for gradients in local_gradients
                ]
            with torch.no_grad():
                for param, base in zip(params, real):
                    param.copy_(base)
            predict_update = linear_adamw_update if linear else trial_update
            local_steps = [
                predict_update(optimizer, params, gradients, schedule.rate(applied[0])) for gradients in local_gradients
            ]
        if step + 1 in checkpoints:  # as the trainer's flush at the end of a run: what waits is applied
            saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), applied[0], real, last))
            saved_params = [p.detach().clone() for p in params]
            for gradients in waiting:
                apply(gradients, step + 1)
            with torch.no_grad():
                for param, base in zip(params, real):
                    param.copy_(base)  # validated on the real parameters, not a prediction
            val[step + 1] = round(validation_loss(model, validation), 4)
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            applied[0] = saved[2]
            for mine, kept in zip(real + last, saved[3] + saved[4]):
                mine.copy_(kept)
            with torch.no_grad():
                for param, kept in zip(params, saved_params):
                    param.copy_(kept)
    return {
        "delay": delay,
        "predict": predict,
        "delay_from": delay_from,
        "local_replicas": local_replicas,
        "blend": blend,
        "linear": linear,
        "val_loss_at": val,
        "final_train_loss": round(sum(losses[-5:]) / 5, 4),
        "losses": [round(x, 4) for x in losses],
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoints", default="20,50,100,200", help="steps at which to measure validation loss")
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--delay-from",
        type=int,
        default=None,
        help="also a row that is exact before this step and one step late (predicted) from it; name "
        "late_local_step_from_N in --rows for local-step prediction from it instead (default: no such row)",
    )
    parser.add_argument("--schedules", default="constant,demo_schedule", help="which of constant, demo_schedule")
    parser.add_argument(
        "--rows", default="exact,late,late_predicted,late_local_step", help="which rows (exact is the reference)"
    )
    parser.add_argument(
        "--tokenizer",
        default="bpe:4096",
        help="of the bundled Shakespeare corpus; `bytes` is what `swarm train` and benchmarks/replica_speed.py use",
    )
    parser.add_argument(
        "--late-beta1", type=float, default=None, help="AdamW's beta1 for the late rows only (default: 0.9, as exact)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="late_local_step: replicas per stage sharing each batch (each predicts from its own share)",
    )
    parser.add_argument("--out", default="delayed_update.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = sorted({int(c) for c in args.checkpoints.split(",") if int(c) <= args.steps} | {args.steps})
    data = open_data(None, tokenizer=args.tokenizer)
    report = {"args": vars(args), "load_before": os.getloadavg(), "rows": {}}
    rows = [
        ("exact", 0, False, 0, 0, False, False),
        ("late", 1, False, 0, 0, False, False),
        ("late_predicted", 1, True, 0, 0, False, False),
        ("late_local_step", 1, False, 0, args.replicas, False, False),
        ("late_local_blend", 1, False, 0, args.replicas, True, False),
        ("late_local_linear", 1, False, 0, args.replicas, False, True),
    ]
    wanted = {"exact", *args.rows.split(",")}
    if args.delay_from is not None:
        from_rows = [
            (f"late_predicted_from_{args.delay_from}", 1, True, args.delay_from, 0, False, False),
            (f"late_local_step_from_{args.delay_from}", 1, False, args.delay_from, args.replicas, False, False),
        ]
        rows += from_rows
        if not wanted & {row[0] for row in from_rows}:  # neither named in --rows: the predicted one
            wanted.add(from_rows[0][0])
    rows = [row for row in rows if row[0] in wanted]
    for name, scheduled in (("constant", False), ("demo_schedule", True)):
        if name not in args.schedules.split(","):
            continue
        settings = schedule_settings(args.steps, scheduled)
        for label, delay, predict, delay_from, local_replicas, blend, linear in rows:
            if delay and args.late_beta1 is not None:
                settings = dataclasses.replace(settings)
                object.__setattr__(settings, "betas", (args.late_beta1, settings.betas[1]))  # not an init field
            row = train(args, data, settings, delay, checkpoints, predict, delay_from, local_replicas, blend, linear)
            report["rows"][f"{name}/{label}"] = row
            print(f"{name} {label}: val {row['val_loss_at']} ({row['seconds']} s)", flush=True)
        exact = report["rows"][f"{name}/exact"]["val_loss_at"]
        for label, *_ in rows[1:]:
            other = report["rows"][f"{name}/{label}"]["val_loss_at"]
            gaps = {c: round(other[c] / exact[c] - 1, 4) for c in checkpoints}
            report[f"{name}/{label}_gap"] = gaps
            print(f"{name}: {label} vs exact, validation loss {gaps}", flush=True)
    report["load_after"] = os.getloadavg()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
