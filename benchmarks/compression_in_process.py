"""The in-process mode of `benchmarks/compression.py` (issue #27): the convergence table of the
codecs without a swarm, so that a run of many tokens fits one machine.

The stages of the split model (`models.stages.build_stage`, the peers' own modules and seeded
initialisation) run in sequence in this process, each with its own AdamW (the peers' defaults:
lr 1e-3, betas 0.9/0.95, weight decay 0.01). Every tensor that crosses a stage boundary goes
through the wire's own code: `wire.tensors.encode_tensor` (with error feedback for top-k
gradients, as the trainer and the peers use it) and `wire.tensors.decode_tensors`, forward (the
activations) and backward (the gradients of the activations); the bytes are the encoded payloads'
(`EncodedTensor.nbytes`: parts' buffers, headers and framing excluded). Every row trains on the same
batches (`MicrobatchSampler`, same seed), from the same initial weights, for the same tokens, with
the same learning-rate schedule (`--lr-warmup-steps`, `--lr-decay`: the peers' own).

What it counts differs from the live swarm's byte counter on purpose: a boundary tensor is counted
once, as it would cross one direct link between stages. In a live swarm it goes stage -> trainer ->
next stage and is counted on both legs (sent and received), and the token ids and targets cross too.

Subspace rows (`fixed:K`, `learned:K`, optionally `+codec`, e.g. `fixed:16+int8`): the model is
built with `GPTConfig.subspace_rank` K of that kind (models/subspace.py), so a boundary tensor is
the (B, T, K) coefficients, encoded with the row's codec; the token ids the next stage needs cross
too, as the wire sends them (`encode_tensor(ids)`: lossless, in the narrowest integer type that
holds their range, 1 byte per token per boundary for a 256-token vocabulary), counted forward in `token_id_bytes_per_token` and in the total. Gradients back are K
per token. The fp32 row is the plain model (no subspace), the reference of every ratio.

Validation: the loss on the same validation batches (`ValidationBatches`, the trainer's), once with
the activations through the codec as a swarm evaluates (`val_loss`) and once exact (`val_loss_exact`:
the trained weights alone).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from models.config import SUBSPACE_KINDS, get_model_config, with_subspace
from models.stages import build_stage
from peers.compute.lr_schedule import LearningRateSchedule
from swarm.trainer.data import Microbatch, MicrobatchSampler, ValidationBatches, open_data
from wire.compression import ErrorFeedback
from wire.tensors import decode_tensors, encode_tensor

FP32_LABEL = "fp32"  # the "none" codec: float32 activations and gradients as they are


@dataclass(frozen=True)
class RunSpec:
    """What every row shares: the model, split, data, budget and optimizer."""

    model: str = "small"
    stages: int = 4
    tokens: int = 2_000_000  # training tokens per row (rounded up to whole steps)
    batch_size: int = 32
    microbatch_size: int = 4
    lr: float = 1e-3
    lr_warmup_steps: int = 0  # the peers' schedule (peers/compute/lr_schedule.py): linear warmup,
    lr_decay: str = "constant"  # then constant or a cosine/linear decay to a tenth of lr over the rest
    seed: int = 0
    eval_batches: int = 8
    device: str = "cpu"
    progress_every: int = 0  # print the mean training loss every N steps (0: only the row's line)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * get_model_config(self.model).seq_len

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens / self.tokens_per_step))

    @property
    def schedule(self) -> LearningRateSchedule:
        """The rate at each step, as the peers apply it with --warmup-steps/--lr-decay."""
        decay_steps = 0 if self.lr_decay == "constant" else max(self.steps - self.lr_warmup_steps, 1)
        return LearningRateSchedule(
            lr=self.lr, warmup_steps=self.lr_warmup_steps, decay=self.lr_decay, decay_steps=decay_steps
        )


@dataclass(frozen=True)
class Row:
    """One row of the table: a codec on every boundary tensor, with or without a subspace."""

    codec: str = "none"
    params: dict = field(default_factory=dict)
    subspace_rank: int = 0
    subspace_kind: str = "fixed"
    gradient_codec: str | None = None  # the gradients' codec when it differs from the activations'

    @property
    def backward_codec(self) -> str:
        return self.codec if self.gradient_codec is None else self.gradient_codec

    @property
    def label(self) -> str:
        codec = FP32_LABEL if self.codec == "none" else self.codec
        if self.gradient_codec is not None:
            codec = f"{codec}/{FP32_LABEL if self.gradient_codec == 'none' else self.gradient_codec}"
        if not self.subspace_rank:
            return codec
        base = f"{self.subspace_kind}:{self.subspace_rank}"
        return base if self.codec == "none" else f"{base}+{codec}"


def parse_row(name: str, codecs: tuple[str, ...], params: dict | None = None) -> Row:
    """`fp32`, a codec, `fixed:K` / `learned:K`, or `fixed:K+codec`; the codec may be `ACT/GRAD`,
    one for the activations and another for the gradients (`int4/fp32`: what each direction's
    codec costs alone); ValueError otherwise."""
    subspace, plus, codec = name.partition("+")
    if not plus and ":" not in name:
        subspace, codec = "", name
    codec, slash, gradient_codec = codec.partition("/")
    codec = "none" if codec in ("", FP32_LABEL) else codec
    gradient_codec = ("none" if gradient_codec == FP32_LABEL else gradient_codec) if slash else None
    for each in (codec, gradient_codec):
        if each is not None and each not in codecs:
            raise ValueError(f"{name!r}: unknown codec {each!r}; choose from fp32, {', '.join(codecs)}")
    rank, kind = 0, "fixed"
    if subspace:
        kind, _, rank_text = subspace.partition(":")
        if kind not in SUBSPACE_KINDS or not rank_text.isdigit() or int(rank_text) < 1:
            raise ValueError(f"{name!r}: a subspace row is KIND:K[+codec], KIND one of {', '.join(SUBSPACE_KINDS)}")
        rank = int(rank_text)
    return Row(
        codec=codec, params=dict(params or {}), subspace_rank=rank, subspace_kind=kind, gradient_codec=gradient_codec
    )


@dataclass
class WireCounter:
    """Payload bytes that crossed the stage boundaries, by direction (token ids apart)."""

    activation_bytes: int = 0
    gradient_bytes: int = 0
    token_id_bytes: int = 0
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)


def cross_boundary(
    tensor: torch.Tensor, codec: str, params: dict, counter: WireCounter | None, *, boundary: int, is_gradient: bool
) -> torch.Tensor:
    """`tensor` as the next stage (forward) or the previous one (backward) receives it: encoded and
    decoded by the wire's functions, on the tensor's device; its payload bytes counted."""
    feedback = counter.feedback if counter is not None and is_gradient and codec == "topk" else None
    encoded = encode_tensor(tensor.detach(), codec, params, feedback=feedback, feedback_key=boundary)
    if counter is not None:
        if is_gradient:
            counter.gradient_bytes += encoded.nbytes
        else:
            counter.activation_bytes += encoded.nbytes
    return decode_tensors({"tensor": encoded})["tensor"].to(tensor.device)


def _forward(stages, mb: Microbatch, codec: str, params: dict, counter: WireCounter | None, device):
    """Loss of one microbatch through all stages; returns (loss, [(stage output, next stage's input)])."""
    tokens = mb.inputs.to(device)
    x, links = tokens, []
    for index, stage in enumerate(stages[:-1]):
        out = stage(x, tokens=tokens)
        x = cross_boundary(out, codec, params, counter, boundary=index, is_gradient=False)
        x.requires_grad_(torch.is_grad_enabled())
        links.append((out, x))
        if stages[index + 1].needs_tokens and counter is not None:  # the ids cross beside the coefficients
            counter.token_id_bytes += encode_tensor(mb.inputs, "none").nbytes
    return stages[-1](x, mb.targets.to(device), tokens=tokens), links


def train_row(spec: RunSpec, codec: str | Row, params: dict | None, data, say=print) -> dict:
    """Train a fresh split model with the row's codec on every boundary (and its subspace, if
    any); the row of the table. `codec` is a codec name (with `params`) or a `Row`."""
    row = codec if isinstance(codec, Row) else Row(codec=codec, params=dict(params or {}))
    codec, params = row.codec, row.params
    device = torch.device(spec.device)
    config = with_subspace(get_model_config(spec.model), row.subspace_rank, row.subspace_kind)
    torch.manual_seed(spec.seed)
    stages = [build_stage(config, i, spec.stages, seed=spec.seed).to(device) for i in range(spec.stages)]
    optimizers = [
        torch.optim.AdamW(stage.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01) for stage in stages
    ]
    sampler = MicrobatchSampler(
        data.train,
        seq_len=config.seq_len,
        batch_size=spec.batch_size,
        microbatch_size=spec.microbatch_size,
        seed=spec.seed,
        what="the training split",
    )
    counter, losses, started = WireCounter(), [], time.monotonic()
    schedule = spec.schedule
    for step in range(spec.steps):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
            for group in optimizer.param_groups:
                group["lr"] = schedule.rate(step)
        step_loss = 0.0
        for mb in sampler.batch(step):
            loss, links = _forward(stages, mb, codec, params, counter, device)
            (loss * mb.size / spec.batch_size).backward()  # the last stage, down to its input
            for boundary in reversed(range(len(links))):
                out, received = links[boundary]
                grad = cross_boundary(
                    received.grad, row.backward_codec, params, counter, boundary=boundary, is_gradient=True
                )
                out.backward(grad)
            step_loss += loss.item() * mb.size / spec.batch_size
        for optimizer in optimizers:
            optimizer.step()
        losses.append(step_loss)
        if spec.progress_every and (step + 1) % spec.progress_every == 0:
            recent = losses[-spec.progress_every :]
            say(
                f"  {row.label}: step {step + 1}/{spec.steps}, train loss {sum(recent) / len(recent):.4f}, "
                f"{time.monotonic() - started:.0f} s"
            )
    train_s = time.monotonic() - started
    for stage in stages:
        stage.eval()
    validation = ValidationBatches(
        data.val,
        seq_len=config.seq_len,
        batch_size=spec.batch_size,
        microbatch_size=spec.microbatch_size,
        count=spec.eval_batches,
    )
    with torch.no_grad():
        microbatches = [mb for batch in validation.batches() for mb in batch]
        val_loss = sum(_forward(stages, mb, codec, params, None, device)[0].item() for mb in microbatches)
        val_exact = sum(_forward(stages, mb, "none", {}, None, device)[0].item() for mb in microbatches)
    tokens = spec.steps * spec.tokens_per_step
    total = counter.activation_bytes + counter.gradient_bytes + counter.token_id_bytes
    return {
        "codec": codec,
        "gradient_codec": row.backward_codec,
        "label": row.label,
        "params": params,
        "subspace_rank": row.subspace_rank,
        "subspace_kind": row.subspace_kind if row.subspace_rank else None,
        "steps": spec.steps,
        "tokens": tokens,
        "activation_bytes_per_token": counter.activation_bytes / tokens,
        "gradient_bytes_per_token": counter.gradient_bytes / tokens,
        "token_id_bytes_per_token": counter.token_id_bytes / tokens,
        "bytes_per_token": total / tokens,
        "val_loss": val_loss / len(microbatches),
        "val_loss_exact": val_exact / len(microbatches),
        "initial_train_loss": losses[0],
        "final_train_loss": sum(losses[-5:]) / len(losses[-5:]),
        "train_losses": [round(loss, 5) for loss in losses],
        "train_s": train_s,
    }


def compare_to_fp32(rows: list[dict]) -> None:
    """Add each row's ratios to the fp32 row (when there is one): bytes and validation loss."""
    fp32 = next((row for row in rows if row["label"] == FP32_LABEL), None)
    for row in rows:
        if fp32 is None:
            row["fewer_bytes_than_fp32"] = row["val_loss_ratio_to_fp32"] = None
            continue
        row["fewer_bytes_than_fp32"] = fp32["bytes_per_token"] / row["bytes_per_token"]
        row["val_loss_ratio_to_fp32"] = row["val_loss"] / fp32["val_loss"]


def run_table(spec: RunSpec, codecs: list[tuple[str, dict] | Row], say=print) -> dict:
    """Every codec's row on the same data, seed and budget; the JSON the benchmark writes."""
    config = get_model_config(spec.model)
    data = open_data(None, say=lambda *_: None)  # the trainer's default corpus, prepared once
    say(
        f"in-process: {spec.model} in {spec.stages} stages on {spec.device}, {spec.steps} steps x "
        f"{spec.tokens_per_step:,} tokens = {spec.steps * spec.tokens_per_step:,} training tokens per row"
    )
    rows = []
    for entry in codecs:
        row = train_row(
            spec, entry if isinstance(entry, Row) else Row(codec=entry[0], params=entry[1]), None, data, say=say
        )
        rows.append(row)
        say(
            f"{row['label']:<16} act {row['activation_bytes_per_token']:>8,.1f} B/token  ids "
            f"{row['token_id_bytes_per_token']:>5,.1f}  grad {row['gradient_bytes_per_token']:>8,.1f} B/token  "
            f"val loss {row['val_loss']:.4f} (exact {row['val_loss_exact']:.4f})  train {row['train_s']:.0f} s"
        )
    compare_to_fp32(rows)
    return {
        "mode": "in-process",
        "model": spec.model,
        "stages": spec.stages,
        "boundaries": spec.stages - 1,
        "hidden": config.d_model,
        "seq_len": config.seq_len,
        "steps": spec.steps,
        "tokens_per_row": spec.steps * spec.tokens_per_step,
        "batch_size": spec.batch_size,
        "microbatch_size": spec.microbatch_size,
        "lr": spec.lr,
        "lr_warmup_steps": spec.lr_warmup_steps,
        "lr_decay": spec.lr_decay,
        "seed": spec.seed,
        "eval_batches": spec.eval_batches,
        "device": spec.device,
        "results": rows,
    }


def table_lines(out: dict) -> list[str]:
    """The convergence table, one line per row."""
    lines = ["row              act B/token  ids B/token  grad B/token  fewer bytes  val loss  vs fp32  (exact weights)"]
    for row in out["results"]:
        fewer = f"{row['fewer_bytes_than_fp32']:>10.2f}x" if row["fewer_bytes_than_fp32"] else "          -"
        ratio = f"{row['val_loss_ratio_to_fp32'] - 1:+7.2%}" if row["val_loss_ratio_to_fp32"] else "      -"
        lines.append(
            f"{row['label']:<16} {row['activation_bytes_per_token']:>11,.1f} {row.get('token_id_bytes_per_token', 0):>12,.1f}"
            f" {row['gradient_bytes_per_token']:>13,.1f}  {fewer}  {row['val_loss']:>8.4f}  {ratio}"
            f"  ({row['val_loss_exact']:.4f})"
        )
    return lines
