"""Three bf16 replicas of each stage of `tiny`, one lying by 3% (issue #59), checked in process over
1,000 calls: the trainer's decisions (swarm/trainer/spot_checks.py) on the replicas' real answers,
each checked answer computed in bf16 autocast as a bf16 peer computes it, each check a float32
recompute (`StageRuntime.recompute`) as a checker makes it. No honest replica is ever in the
minority, and the liar always is. (tests/integration/test_checks_every_call.py does the same on
real processes, for fewer calls.)"""

from __future__ import annotations

import random

import torch

from models.config import get_model_config
from peers.compute.faults import FaultSettings, FaultyStageRuntime
from peers.compute.stage_runtime import OptimizerSettings, StageRuntime
from swarm.trainer.data import MicrobatchSampler, load_corpus
from swarm.trainer.spot_checks import CHECK_PRECISION, Answer, judge

CONFIG = get_model_config("tiny")
CALLS = 1000
LIE = 0.03


def answer(components: dict, precision: str) -> Answer:
    return Answer(
        {k: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64) for k, v in components.items()},
        precision,
    )


def recomputed(replica, stage: int, rpc: str, inputs, extra: dict) -> Answer:
    """A checker's answer: its float32 recompute of the call, as the components a check compares."""
    tensor, loss, sample = replica[stage].recompute(rpc, inputs, precision=CHECK_PRECISION, **extra)
    out = {"outputs" if rpc == "forward" else "grad_inputs": tensor} if tensor is not None else {}
    out.update({"loss": loss} if loss is not None else {})
    out.update({"grad_sample": sample} if sample is not None else {})
    return answer(out, CHECK_PRECISION)


def test_over_a_thousand_checks_no_honest_bf16_replica_is_outvoted_and_the_liar_always_is():
    torch.set_num_threads(1)
    optimizer = OptimizerSettings(lr=3e-3, target_batch_size=10**9)

    def replica(lies: bool):
        stages = [StageRuntime(CONFIG, s, 2, optimizer=optimizer, precision="bf16") for s in range(2)]
        for stage in stages:
            stage.auto_step = False  # sync replicas step together (below)
        if lies:
            stages = [
                FaultyStageRuntime(s, FaultSettings(fault_garbage="scale", fault_garbage_size=LIE)) for s in stages
            ]
        return stages

    replicas = {"honest-a": replica(False), "honest-b": replica(False), "liar": replica(True)}
    sampler = MicrobatchSampler(load_corpus(), seq_len=CONFIG.seq_len, batch_size=8, microbatch_size=2)
    rng = random.Random(1)
    checks = {"honest": 0, "liar": 0}
    step = 0
    while sum(checks.values()) < CALLS:
        for mb in sampler.batch(step):
            name = rng.choice(list(replicas))  # the replica the pipeline's call went to
            first, last = replicas[name]
            mb_id = f"{step}:{mb.index}"
            outputs = first.forward(mb_id, mb.inputs)
            grad, loss, sample = last.backward_sampled(mb_id, outputs, targets=mb.targets)
            _, _, first_sample = first.backward_sampled(mb_id, None, grad_outputs=grad, batch_size=mb.size)
            calls = [
                (0, "forward", {"outputs": outputs}, mb.inputs, {}),
                (
                    1,
                    "backward",
                    {"grad_inputs": grad, "loss": loss, "grad_sample": sample},
                    outputs,
                    {"targets": mb.targets},
                ),
                (0, "backward", {"grad_sample": first_sample}, mb.inputs, {"grad_outputs": grad}),
            ]
            for stage, rpc, told, inputs, extra in calls:
                # as the trainer asks: one other replica, a third when they differ
                others = [other for other in replicas if other != name]
                rng.shuffle(others)
                answers = {name: answer(told, "bf16")}
                answers[others[0]] = recomputed(replicas[others[0]], stage, rpc, inputs, extra)
                verdict = judge(answers, "none")
                if not verdict.agreed:
                    answers[others[1]] = recomputed(replicas[others[1]], stage, rpc, inputs, extra)
                    verdict = judge(answers, "none")
                assert verdict.minority == (("liar",) if "liar" in answers else ()), (name, stage, rpc, verdict)
                assert verdict.largest_agreeing_share < 0.6  # honest answers agree with a margin
                checks["liar" if name == "liar" else "honest"] += 1
        # sync replicas: every one steps on the mean of what all accumulated (the liar's lies included)
        for s in range(2):
            stages = [replicas[r][s] for r in replicas]
            samples = sum(stage.samples_accumulated for stage in stages)
            mean = [sum(stage.grad_sums[i] for stage in stages) / samples for i in range(len(stages[0].params))]
            for stage in stages:
                stage.apply_gradients(mean)
        step += 1
    assert checks["honest"] >= 600 and checks["liar"] >= 250, checks
