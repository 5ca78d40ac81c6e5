"""What weight prediction costs a replica one step late (issue #22), one stage at a time, on one
thread, without a network:

* the local-step update: `trial_update` (a real optimizer step, undone) against `adamw_update`
  (AdamW's update in closed form, what the peers use with AdamW), and how far apart they are;
* a training forward and backward of one microbatch on the parameters, and on the predicted point
  (`StageRuntime._training_weights`: parameters plus the update, made once and shared);
* the memory `--cached` forwards keep for their backwards (the distinct tensors their graphs save):
  with one predicted point shared by all, and with the sum made in every forward (as the peers did
  before 31f980d).

    .venv/bin/python benchmarks/prediction_cost.py --out benchmarks/out/prediction_cost.json

Times are medians over `--repeats` alternating calls; on a shared machine they are only as steady
as its load (recorded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_file import write_report  # noqa: E402
from models.config import get_model_config  # noqa: E402
from peers.compute.stage_runtime import StageRuntime  # noqa: E402
from peers.compute.weight_prediction import adamw_update, trial_update  # noqa: E402


def median_ms(calls: dict, repeats: int) -> dict[str, float]:
    """Each call's median time in ms, the calls alternating so that a change in load hits each."""
    for call in calls.values():
        call()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: round(1000 * statistics.median(t), 2) for name, t in times.items()}


def stage_inputs(config, stage: int, microbatch: int, generator: torch.Generator):
    inputs = (
        torch.randint(0, config.vocab_size, (microbatch, config.seq_len), generator=generator)
        if stage == 0
        else torch.randn(microbatch, config.seq_len, config.d_model, generator=generator)
    )
    targets = torch.randint(0, config.vocab_size, (microbatch, config.seq_len), generator=generator)
    return inputs, targets


def measure_stage(config, stage: int, num_stages: int, args) -> dict:
    generator = torch.Generator().manual_seed(stage)
    runtime = StageRuntime(config, stage, num_stages)
    params = runtime.params
    for _ in range(3):  # AdamW state to read
        runtime.apply_gradients([torch.randn_like(p) * 1e-3 for p in params])
    gradients = [torch.randn_like(p) * 1e-3 for p in params]
    trial, closed = (
        trial_update(runtime.optimizer, params, gradients, 1e-3),
        adamw_update(runtime.optimizer, params, gradients, 1e-3),
    )
    update_ms = median_ms(
        {
            "trial_update": lambda: trial_update(runtime.optimizer, params, gradients, 1e-3),
            "adamw_update": lambda: adamw_update(runtime.optimizer, params, gradients, 1e-3),
        },
        args.repeats,
    )
    inputs, targets = stage_inputs(config, stage, args.microbatch, generator)
    targets = targets if runtime.is_last else None
    seed = None if runtime.is_last else torch.randn(args.microbatch, config.seq_len, config.d_model)

    def forward_backward(predicted: bool) -> None:
        runtime.predicted_update = closed if predicted else None
        weights = runtime._training_weights()
        outputs = runtime._train_forward(inputs, targets, None, weights)
        torch.autograd.grad(outputs, params if weights is None else weights, grad_outputs=seed, allow_unused=True)

    step_ms = median_ms(
        {
            "on the parameters": lambda: forward_backward(False),
            "on the predicted point": lambda: forward_backward(True),
        },
        args.repeats,
    )

    def cached_forwards_mib(shared: bool) -> float:
        """MiB of the distinct tensors the graphs of `--cached` forwards save for their backwards."""
        runtime.predicted_update = closed
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        kept = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            for _ in range(args.cached):
                if shared:
                    kept.append(runtime._train_forward(inputs, targets, None, runtime._training_weights()))
                else:  # the sum in every forward, as before 31f980d
                    point = {n: p + u for n, p, u in zip(runtime.param_names, params, closed)}
                    kept.append(torch.func.functional_call(runtime.module, point, (inputs, targets), {"tokens": None}))
        return round(sum(saved.values()) / 2**20, 1)

    memory = {"per-forward sum": cached_forwards_mib(False), "one shared point": cached_forwards_mib(True)}
    return {
        "stage": stage,
        "values": sum(p.numel() for p in params),
        "parameter_mib": round(sum(p.numel() * p.element_size() for p in params) / 2**20, 2),
        "update_ms": update_ms,
        "closed_form_max_difference": max((a - b).abs().max().item() for a, b in zip(trial, closed)),
        "update_max_abs": max(a.abs().max().item() for a in trial),
        "forward_backward_ms": step_ms,
        f"mib_for_{args.cached}_cached_forwards": memory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cached", type=int, default=8, help="cached forwards for the memory figure")
    parser.add_argument("--out", default="benchmarks/out/prediction_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = get_model_config(args.model)
    load_before = [round(x, 2) for x in os.getloadavg()]
    stages = []
    for stage in range(args.stages):
        result = measure_stage(config, stage, args.stages, args)
        stages.append(result)
        print(
            f"stage {stage}: update {result['update_ms']} ms (closed form within "
            f"{result['closed_form_max_difference']:.1e}); forward+backward {result['forward_backward_ms']} ms; "
            f"{args.cached} cached forwards {result[f'mib_for_{args.cached}_cached_forwards']} MiB "
            f"(parameters {result['parameter_mib']} MiB)",
            flush=True,
        )
    write_report(
        args.out,
        {
            "args": vars(args),
            "machine": {
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": [round(x, 2) for x in os.getloadavg()],
            },
            "stages": stages,
        },
    )


if __name__ == "__main__":
    main()
