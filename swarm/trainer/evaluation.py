"""Validation loss through the swarm: the val split's windows go forward through every stage with
`eval_only` set (the peers compute under no_grad, cache no activations and count no samples; the
last stage returns the loss on the targets). Calls fail over like training calls (StageCaller)."""

from __future__ import annotations

import asyncio

from swarm.data.windows import Microbatch
from swarm.trainer.stage_call import Payload, StageCaller


async def evaluate_microbatch(caller: StageCaller, mb: Microbatch, microbatch_id: str) -> float:
    num_stages = caller.view.num_stages
    payload = Payload(mb.inputs)
    for stage in range(num_stages - 1):
        answer = await caller.call(stage, "forward", microbatch_id, mb.size, [("inputs", payload)], eval_only=True)
        payload = answer.payload("outputs")
    tensors = [("inputs", payload), ("targets", Payload(mb.targets))]
    answer = await caller.call(num_stages - 1, "forward", microbatch_id, mb.size, tensors, eval_only=True)
    return float(answer.response.loss)


async def evaluate(
    caller: StageCaller, batches: list[list[Microbatch]], *, run_id: str, max_in_flight: int = 8
) -> float:
    """Mean loss (per sample) over every microbatch of `batches`."""
    slots = asyncio.Semaphore(max_in_flight)
    microbatches = [mb for batch in batches for mb in batch]

    async def one(i: int, mb: Microbatch) -> float:
        async with slots:
            return await evaluate_microbatch(caller, mb, f"{run_id}:eval:{i}")

    losses = await asyncio.gather(*[one(i, mb) for i, mb in enumerate(microbatches)])
    total = sum(mb.size for mb in microbatches)
    return sum(loss * mb.size for loss, mb in zip(losses, microbatches)) / total
