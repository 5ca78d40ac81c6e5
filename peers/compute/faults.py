"""Fault injection for tests and benchmarks: a stage runtime that is slower than it should be,
fails a fraction of its calls, or returns garbage while computing correctly inside: obvious garbage
(NaNs, a wrong shape), which the trainer's answer check catches, or plausible lies (issue #25) that
only a spot check can catch: outputs scaled by 1 + `--faults garbage_size`, outputs plus noise of that
relative size, or one fixed direction of that size (bias), an earlier answer of the same shape
replayed, or answers computed from the weights frozen at start-up while the real ones train; on
every call or on backward calls alone (`--faults garbage_calls`), a backward's lie being in all it
makes: its input gradient, its loss, and the parameter gradient it adds and samples. A replica
can also lie to its groupmates in the averaging all-reduce (`--faults averaging`): its contribution
multiplied by 10 or negated. And a peer
can hold one call mid-hop (`--faults hold=forward|backward`): it has received the hop's tensors and
does not answer, logging that it holds them, so a test can SIGKILL it at exactly that moment. Or it
can lose one answer on the way back (`--faults lose_answer=N`): the Nth backward call is computed and
added to the gradients, then its stream fails instead of answering, as when a connection drops after
the work was done. Only built when `--faults` (the peer's one developer option) sets a fault, so the
normal code path never branches on it."""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass

import torch

from peers.compute.stage_runtime import StageRuntime, ThroughputMeter, WrongStageError
from peers.replicas.averaging import GradientSync, ParameterAveraging
from process.config import ConfigError, option

GARBAGE_KINDS = ("none", "nan", "shape", "scale", "noise", "bias", "replay", "stale")
# --faults garbage_calls: which calls lie (a backward's lie is in every answer it makes: its input
# gradient, its loss, and the parameter gradient it adds and samples)
GARBAGE_CALLS = ("all", "forward", "backward")
# Answers of the right shape and plausible values: what a spot check, not the answer check, must catch.
PLAUSIBLE_KINDS = ("scale", "noise", "bias", "replay", "stale")
# --faults averaging: what the replica's contribution to the all-reduce is multiplied by
AVERAGING_LIES = {"none": 1.0, "scale": 10.0, "flip": -1.0}
# How the extra time of a slowed compute is spent:
# - sleep: waiting, off the CPU, (slowdown - 1) x the compute's wall time. Simple, but on shared cores
#   the wall time includes waiting for a core, so contention is multiplied too (see `device`).
# - busy: computing, on the compute thread. The peer needs `slowdown` times the CPU time per call, so
#   a slowed peer and its partner compete for a shared CPU on equal terms and load that hits both
#   alike keeps their speeds `slowdown` apart. With `sleep` they do not: the slowed peer computes
#   only while its partner is busy too and so meets more contention, and its sleep then multiplies
#   that contention (a peer slowed 3x served 0.23 of its partner's share in a loaded CI run).
# - device: a separate device `slowdown` times slower than one uncontended core of this machine: the
#   call lasts `slowdown` x the CPU time the compute used on its thread, asleep for the rest; if
#   contention alone stretched the compute beyond that, nothing is added. Other processes' load is not
#   multiplied (with `sleep`, the same static swarm ran at 322 and 431 tok/s four minutes apart on the
#   shared machine, and a layout with more peers computing at once paid for their contention `slowdown` times).
SLOWDOWN_MODES = ("sleep", "busy", "device")
# --faults hold: where a call is held without an answer. forward: the inputs of a forward hop have
# arrived (a forward call, or the last stage's fused forward+backward, which answers the forward hop);
# backward: the gradient of a backward hop has arrived (a backward call on a stage before the last).
HOLD_POINTS = ("none", "forward", "backward", "round")
HOLD_MESSAGE = "holding microbatch {microbatch_id} in its {point} (injected by --faults hold)"
HOLD_ROUND_MESSAGE = "holding sync round {round} before it begins (injected by --faults hold=round)"
LOST_ANSWER_MESSAGE = "lost the answer to backward call {call} after adding it (injected by --faults lose_answer)"

logger = logging.getLogger(__name__)


def bias_direction(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The one direction of `shape` a `bias` liar pushes every answer of that shape along (unit norm,
    the same on every call: a lie that adds up step after step instead of averaging out)."""
    direction = torch.randn(shape, generator=torch.Generator().manual_seed(0xB1A5 + sum(shape)), dtype=dtype)
    return direction / direction.norm().clamp_min(1e-30)


def garbled(value, kind: str, *, size: float = 0.05, generator: torch.Generator | None = None):
    """What a broken peer sends instead of `value` (a tensor, a loss, or None), for the kinds that
    need nothing but the value: nan, shape, scale (times 1 + size), noise (plus Gaussian noise of
    norm `size` times the value's norm) and bias (plus `bias_direction` times that norm); a loss is
    scaled instead."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        if kind == "nan":
            return float("nan")
        return value * (1.0 + size) if kind in ("scale", "noise", "bias") else value
    if kind == "nan":
        return torch.full_like(value, float("nan"))
    if kind == "scale":
        return value * (1.0 + size)
    if kind == "noise":
        noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
        return value + noise * (size * value.norm() / noise.norm().clamp_min(1e-30))
    if kind == "bias":
        return value + bias_direction(tuple(value.shape), value.dtype).to(value.device) * (size * value.norm())
    if kind == "shape":
        return value[..., :-1].contiguous()  # one value short in the last dimension
    raise ValueError(f"garbled() cannot make {kind!r} answers: it needs the runtime (FaultyStageRuntime)")


class InjectedFault(RuntimeError):
    """A failure injected on purpose (`--faults fail_rate`)."""


class InjectedLostAnswer(ConnectionError):
    """The stream of a call fails after the call was computed (`--faults lose_answer`): not an answer."""


class InjectedWrongStageError(WrongStageError):
    """A "wrong stage" answer injected on purpose (`--faults wrong_stage`): a fake record's peer."""


@dataclass(frozen=True, kw_only=True)
class FaultSettings:
    """What to break, for tests and benchmarks (the peer's `faults` config section)."""

    fault_slowdown: float = option(1.0, help="testing only: make every compute this many times slower")
    fault_slowdown_mode: str = option(
        "sleep",
        help="testing only: spend --faults slowdown's extra time asleep (a "
        "separate slower device), busy computing (a slower device sharing this "
        "machine's CPU with the other peers), or as a device: each call lasts "
        "--faults slowdown x the CPU time it used (others' load not multiplied)",
        choices=list(SLOWDOWN_MODES),
    )
    fault_fail_rate: float = option(0.0, help="testing only: fail this fraction of calls")
    fault_garbage: str = option(
        "none",
        help="testing only: answer with garbage while computing correctly inside (nan: NaN values; "
        "shape: one value short; scale: outputs times 1 + --faults garbage_size; noise: plus noise of "
        "that relative size; bias: plus one fixed direction of that relative size; replay: the previous "
        "answer of the same shape; stale: computed from the weights frozen at start-up)",
        choices=list(GARBAGE_KINDS),
    )
    fault_garbage_rate: float = option(1.0, help="testing only: fraction of calls answered with --faults garbage")
    fault_garbage_calls: str = option(
        "all",
        help="testing only: which calls --faults garbage lies on (backward: the input gradient, the loss, and "
        "the parameter gradient it adds and samples; a spot check's recompute lies as the call it checks)",
        choices=list(GARBAGE_CALLS),
    )
    fault_garbage_size: float = option(
        0.05, help="testing only: relative size of --faults garbage=scale and noise (a fraction of the output's norm)"
    )
    fault_miss_sync_round: int = option(
        0,
        help="testing only: act as if the Nth sync averaging round failed after it completed (this "
        "replica does not step while its partners do, as when an all-reduce fails on one side only)",
    )
    fault_claim_speedup: float = option(
        1.0,
        help="testing only: lie about speed: announce this many times the throughput and report "
        "compute times this many times shorter (the rest as queueing)",
    )
    fault_wrong_stage: bool = option(False, help="testing only: answer every call 'wrong stage' (a fake record)")
    fault_averaging: str = option(
        "none",
        help="testing only: lie in the replicas' all-reduce: send a contribution (gradients in sync mode, "
        "parameters in periodic) multiplied by 10 (scale) or negated (flip); this replica's own state "
        "stays as an honest one's",
        choices=list(AVERAGING_LIES),
    )
    fault_hold: str = option(
        "none",
        help="testing only: hold one call for --faults hold_s and log it (forward, backward: mid-hop; round: a sync "
        "commit's named round, before it begins), after --faults hold_after such calls; a test kills the peer then",
        choices=list(HOLD_POINTS),
    )
    fault_hold_after: int = option(0, help="testing only: --faults hold's calls answered before the one held")
    fault_hold_s: float = option(300.0, help="testing only: how long --faults hold holds its call")
    fault_lose_answer: int = option(
        0,
        help="testing only: compute the Nth backward call and add its gradients, then fail its stream "
        "instead of answering (an answer lost on the way back)",
    )

    @property
    def enabled(self) -> bool:
        return (
            self.fault_slowdown != 1.0
            or self.fault_fail_rate > 0.0
            or self.fault_garbage != "none"
            or self.fault_claim_speedup != 1.0
            or self.fault_wrong_stage
            or self.fault_hold != "none"
            or self.fault_lose_answer > 0
        )

    def __post_init__(self) -> None:
        if self.fault_slowdown < 1.0 or not 0.0 <= self.fault_fail_rate <= 1.0:
            raise ConfigError("--faults slowdown must be >= 1 and --faults fail_rate within [0, 1]")
        if self.fault_slowdown_mode not in SLOWDOWN_MODES:
            raise ConfigError(f"--faults slowdown_mode must be one of {', '.join(SLOWDOWN_MODES)}")
        if not self.fault_claim_speedup >= 1.0:
            raise ConfigError("--faults claim_speedup must be >= 1")
        if self.fault_garbage_calls not in GARBAGE_CALLS:
            raise ConfigError(f"--faults garbage_calls must be one of {', '.join(GARBAGE_CALLS)}")
        if self.fault_garbage not in GARBAGE_KINDS or not 0.0 <= self.fault_garbage_rate <= 1.0:
            raise ConfigError(
                f"--faults garbage must be one of {', '.join(GARBAGE_KINDS)} and --faults garbage_rate within [0, 1]"
            )
        if not 0.0 <= self.fault_garbage_size < float("inf"):
            raise ConfigError("--faults garbage_size must be a finite number >= 0")
        if self.fault_averaging not in AVERAGING_LIES:
            raise ConfigError(f"--faults averaging must be one of {', '.join(AVERAGING_LIES)}")
        if self.fault_hold not in HOLD_POINTS or self.fault_hold_after < 0 or not self.fault_hold_s >= 0:
            raise ConfigError(
                f"--faults hold must be one of {', '.join(HOLD_POINTS)}, --faults hold_after and --faults hold_s >= 0"
            )
        if self.fault_lose_answer < 0:
            raise ConfigError("--faults lose_answer must be >= 0 (0: off)")


class RoundMissingSync(GradientSync):
    """Sync averaging that misses one round on its side (`--faults miss_sync_round=N`): the all-reduce
    completes for the partners, and this replica takes it as failed, so it does not step."""

    def __init__(self, *args, miss_round: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.miss_round = miss_round

    def finish_round(self, control):
        return self._maybe_missed(super().finish_round(control))

    def _named_round(self, *args):  # exact sync over gloo or by exchange
        return self._maybe_missed(super()._named_round(*args))

    def _maybe_missed(self, gathered):
        if gathered is not None and self.rounds == self.miss_round:
            print(f"fault: taking averaging round {self.rounds} as failed (--faults miss_sync_round)", flush=True)
            return None
        return gathered


class HeldRoundSync(GradientSync):
    """Sync averaging that holds one named round (gloo or by exchange) before it begins
    (`--faults hold=round`): the compute thread sleeps --faults hold_s with the commit received, so
    that the round's other members wait in it; a test kills this peer then."""

    def __init__(self, *args, hold_after: int, hold_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold_after, self.hold_s, self.named_rounds = hold_after, hold_s, 0

    def _named_round(self, *args):
        self.named_rounds += 1
        if self.named_rounds == self.hold_after + 1:
            logger.warning(HOLD_ROUND_MESSAGE.format(round=self.named_rounds))
            time.sleep(self.hold_s)
        return super()._named_round(*args)


class LyingContribution:
    """A replica averaging (mixed into GradientSync or ParameterAveraging) that hands the all-reduce
    its tensors multiplied by `factor` (`--faults averaging`). The all-reduce then writes the group's
    average over them, so after a round this replica holds what its groupmates hold; after a failed
    one its honest values are put back. The lie is made just before the all-reduce can read the
    tensors: when the round starts (sync, periodic by steps: the compute thread, which the all-reduce
    then holds), or when a scheduled round is let run (periodic by time)."""

    def __init__(self, *args, lie: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.factor = AVERAGING_LIES[lie]
        self._honest: list[torch.Tensor] | None = None
        print(f"fault: this replica's averaging contributions are multiplied by {self.factor:g} ({lie})", flush=True)

    def _lie(self) -> None:
        with self.averager.get_tensors() as tensors:
            self._honest = [t.clone() for t in tensors]
            for tensor in tensors:
                tensor.mul_(self.factor)

    def _tell_the_truth(self) -> None:
        if self._honest is not None:
            with self.averager.get_tensors() as tensors:
                for tensor, honest in zip(tensors, self._honest):
                    tensor.copy_(honest)
        self._honest = None

    def begin_round(self, group_size, weight, scheduled_time=None, *, wait_for_trigger=False, **kwargs):
        if not wait_for_trigger:  # the all-reduce may read the tensors as soon as the group forms
            self._lie()
        try:
            return super().begin_round(group_size, weight, scheduled_time, wait_for_trigger=wait_for_trigger, **kwargs)
        except Exception:
            self._tell_the_truth()
            raise

    def finish_round(self, control):
        if self._honest is None:
            self._lie()
        gathered = super().finish_round(control)
        if gathered is None:
            self._tell_the_truth()
        self._honest = None
        return gathered

    def _named_round(self, *args):  # exact sync over gloo or by exchange: the lie goes into the flat buffer sent
        self._lie()
        gathered = super()._named_round(*args)
        if gathered is None:
            self._tell_the_truth()
        self._honest = None
        return gathered


class LyingGradientSync(LyingContribution, GradientSync):
    """Sync averaging that sends its gradients multiplied (`--faults averaging`)."""


class LyingParameterAveraging(LyingContribution, ParameterAveraging):
    """Periodic averaging that sends its parameters multiplied (`--faults averaging`)."""


class FaultyStageRuntime:
    """Wraps a StageRuntime; forwards everything else to it unchanged. Garbage answers are made after
    the real compute, which keeps training the real weights (and caching the real activations): the
    peer lies about what it computed, never skips the work."""

    def __init__(self, runtime: StageRuntime, settings: FaultSettings, *, seed: int = 0):
        self._runtime, self._settings = runtime, settings
        self._rng = random.Random(seed)
        self._noise = torch.Generator().manual_seed(seed)
        # replay: the latest true answer per (rpc, shape), handed out in place of the next one
        self._earlier: dict[tuple[str, tuple], object] = {}
        # stale: the weights as they were at start-up, which the answers come from while the real ones train
        self._frozen = copy.deepcopy(runtime.module) if settings.fault_garbage == "stale" else None
        if self._frozen is not None:  # its trainable parameters' gradients are the stale lie a backward adds
            trainable = set(runtime.param_names)
            for name, param in self._frozen.named_parameters():
                param.requires_grad_(name in trainable)
        self._hold_calls = 0  # calls at --faults hold's point so far (one is held, once)
        self._backward_calls = 0  # backward calls computed so far (--faults lose_answer loses one answer)

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    @property
    def throughput(self) -> ThroughputMeter:
        """What the peer announces: the inner measurement, slowed down as the calls are."""
        settings = self._settings
        return ThroughputMeter(
            initial=self._runtime.throughput.value / settings.fault_slowdown * settings.fault_claim_speedup
        )

    def claimed_times(self, compute_s: float, queue_s: float) -> tuple[float, float]:
        """The (compute, queue) seconds to report: with --faults claim_speedup, compute time passed off as queueing."""
        claimed_s = compute_s / self._settings.fault_claim_speedup
        return claimed_s, queue_s + compute_s - claimed_s

    def _run(self, compute, *args, **kwargs):
        if self._settings.fault_wrong_stage:
            raise InjectedWrongStageError(f"this peer serves another stage than {self._runtime.stage} (injected)")
        if self._rng.random() < self._settings.fault_fail_rate:
            raise InjectedFault("injected failure (--faults fail_rate)")
        extra = self._settings.fault_slowdown - 1.0
        if self._settings.fault_slowdown_mode == "busy":
            started_cpu_s = time.thread_time()
            result = compute(*args, **kwargs)
            burn_cpu(extra * (time.thread_time() - started_cpu_s))
            return result
        started, started_cpu_s = time.perf_counter(), time.thread_time()
        result = compute(*args, **kwargs)
        elapsed_s = time.perf_counter() - started
        if self._settings.fault_slowdown_mode == "device":
            time.sleep(max(self._settings.fault_slowdown * (time.thread_time() - started_cpu_s) - elapsed_s, 0.0))
        else:
            time.sleep(extra * elapsed_s)
        return result

    def answer_lost(self, rpc: str) -> bool:
        """Whether the answer to this call, just computed, is lost on the way back (--faults lose_answer):
        the caller then fails the call's stream instead of answering."""
        if rpc != "backward" or self._settings.fault_lose_answer == 0:
            return False
        self._backward_calls += 1
        if self._backward_calls != self._settings.fault_lose_answer:
            return False
        logger.warning(LOST_ANSWER_MESSAGE.format(call=self._backward_calls))
        return True

    def _hold_if_due(self, point: str, microbatch_id: str) -> None:
        """At --faults hold's point, after --faults hold_after calls: say so, then hold this call (the
        compute thread) for --faults hold_s without answering."""
        if self._settings.fault_hold != point:
            return
        self._hold_calls += 1
        if self._hold_calls == self._settings.fault_hold_after + 1:
            logger.warning(HOLD_MESSAGE.format(microbatch_id=microbatch_id, point=point))
            time.sleep(self._settings.fault_hold_s)

    def _garbage_now(self, rpc: str) -> bool:
        settings = self._settings
        if settings.fault_garbage == "none" or settings.fault_garbage_calls not in ("all", rpc):
            return False
        return self._rng.random() < settings.fault_garbage_rate

    def _garbled(self, value):
        return garbled(
            value, self._settings.fault_garbage, size=self._settings.fault_garbage_size, generator=self._noise
        )

    def _replayed(self, rpc: str, answer, shape: tuple):
        """The previous true answer of this rpc and shape (the current one the first time); keeps the current."""
        earlier = self._earlier.get((rpc, shape), answer)
        self._earlier[(rpc, shape)] = answer
        return earlier

    def forward(
        self,
        microbatch_id: str,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._hold_if_due("forward", microbatch_id)
        outputs = self._run(self._runtime.forward, microbatch_id, inputs, targets, tokens)
        if not self._garbage_now("forward"):
            return outputs
        kind = self._settings.fault_garbage
        if kind == "replay":
            return self._replayed("forward", outputs, tuple(inputs.shape))
        if kind == "stale":
            return self._stale(inputs, targets, tokens=tokens)[0]
        return self._garbled(outputs)

    def backward(self, microbatch_id: str, inputs: torch.Tensor | None, **kwargs):
        grad_inputs, loss, _ = self.backward_sampled(microbatch_id, inputs, sample=False, **kwargs)
        return grad_inputs, loss

    def backward_sampled(self, microbatch_id: str, inputs: torch.Tensor | None, *, sample: bool = True, **kwargs):
        """The runtime's backward; when it lies, every answer lies alike: the input gradient, the loss,
        and the parameter gradient it adds (the accumulation's increase, replaced) and samples."""
        runtime = self._runtime
        self._hold_if_due("forward" if runtime.is_last else "backward", microbatch_id)
        if not self._garbage_now("backward"):
            return self._run(runtime.backward_sampled, microbatch_id, inputs, sample=sample, **kwargs)
        before = [grad_sum.clone() for grad_sum in runtime.grad_sums]
        counted = runtime.samples_accumulated
        grad_inputs, loss, _ = self._run(runtime.backward_sampled, microbatch_id, inputs, sample=False, **kwargs)
        added = runtime.samples_accumulated - counted  # 0: a repeat, or the runtime stepped (its own schedule)
        honest = [(after - earlier) / max(added, 1) for after, earlier in zip(runtime.grad_sums, before)]
        kind = self._settings.fault_garbage
        if kind == "replay":
            shape = None if inputs is None else tuple(inputs.shape)
            grad_inputs, loss, lied = self._replayed("backward", (grad_inputs, loss, honest), shape)
        elif kind == "stale":
            if inputs is None:  # served from the activation cache, which the real forward filled: honest
                lied = honest
            else:
                _, grad_inputs, loss, lied = self._stale(
                    inputs, kwargs.get("targets"), kwargs.get("grad_outputs"), grad=True, tokens=kwargs.get("tokens")
                )
        else:
            grad_inputs, loss, lied = self._garbled(grad_inputs), self._garbled(loss), self._garbled_grads(honest)
        if added > 0:
            for grad_sum, earlier, grad in zip(runtime.grad_sums, before, lied):
                grad_sum.copy_(earlier + grad * added)
        return grad_inputs, loss, runtime.sample_of(lied) if sample else None

    def recompute(self, rpc: str, inputs: torch.Tensor, **kwargs):
        """A spot check's recompute (the runtime's), lying as the call it checks would."""
        answer, loss, sampled = self._run(self._runtime.recompute, rpc, inputs, **kwargs)
        if not self._garbage_now(rpc):
            return answer, loss, sampled
        kind = self._settings.fault_garbage
        if kind == "replay":
            return self._replayed(f"recompute-{rpc}", (answer, loss, sampled), tuple(inputs.shape))
        if kind == "stale":
            grad = rpc == "backward"
            outputs, grad_inputs, stale_loss, grads = self._stale(
                inputs, kwargs.get("targets"), kwargs.get("grad_outputs"), grad=grad, tokens=kwargs.get("tokens")
            )
            if not grad:
                return (None, stale_loss, None) if self._runtime.is_last else (outputs, None, None)
            return grad_inputs, stale_loss, self._runtime.sample_of(grads)
        lied = None if sampled is None else self._garbled(torch.tensor(sampled, dtype=torch.float64)).tolist()
        return self._garbled(answer), self._garbled(loss), lied

    def _garbled_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameter gradient a lying backward adds: each tensor garbled as an answer would be; a
        wrong shape is the answer's alone (the accumulation keeps its shape), so that one adds honestly."""
        if self._settings.fault_garbage == "shape":
            return grads
        return [self._garbled(grad) for grad in grads]

    def _stale(self, inputs, targets=None, grad_outputs=None, *, grad: bool = False, tokens=None):
        """(outputs, input gradient, loss, parameter gradients) of the weights frozen at start-up, as
        the runtime would send them (the gradients only with `grad`)."""
        runtime = self._runtime
        inputs, targets = inputs.to(runtime.device), None if targets is None else targets.to(runtime.device)
        tokens = None if tokens is None else tokens.to(runtime.device)
        leaf = inputs if inputs.dtype == torch.int64 or not grad else inputs.detach().requires_grad_(True)
        with torch.enable_grad() if grad else torch.no_grad():
            outputs = self._frozen(leaf, targets, tokens=tokens)
            loss = float(outputs.detach()) if runtime.is_last else None
            input_grad, param_grads = None, None
            if grad:
                grad_outputs = None if grad_outputs is None else grad_outputs.to(runtime.device)
                trainable = dict(self._frozen.named_parameters())
                params = [trainable[name] for name in runtime.param_names]
                targets_of_grad = ([leaf] if leaf.requires_grad else []) + params
                seed = torch.ones_like(outputs) if runtime.is_last else grad_outputs
                grads = torch.autograd.grad(outputs, targets_of_grad, grad_outputs=seed, allow_unused=True)
                if leaf.requires_grad:
                    input_grad = runtime._to_wire(grads[0])
                param_grads = [
                    torch.zeros_like(p) if g is None else g for p, g in zip(params, grads[len(grads) - len(params) :])
                ]
        return runtime._to_wire(outputs.detach()), input_grad, loss, param_grads


_BURN_MATRIX_SIZE = 128  # one product takes well under a millisecond: the deadline is overshot by little


def burn_cpu(seconds: float) -> float:
    """Keep the calling thread computing until it has used `seconds` of CPU time (its own, so other
    processes' load stretches this as it stretches the real compute); returns the CPU time used.
    Matrix products release the GIL, so the peer's event loop keeps serving meanwhile. With one
    torch thread (the peer's default) a product runs on this thread, where `thread_time` sees it; with
    more, compute done on torch's other threads is not counted (the slowdown falls short), while this
    thread's waits for them, spent spinning, are (on a loaded machine it overshoots: 1.16x the CPU
    asked on 2 threads beside three busy loops, up to 1.48x; 1.01x on one)."""
    started = time.thread_time()
    if seconds <= 0.0:
        return 0.0
    matrix = torch.ones(_BURN_MATRIX_SIZE, _BURN_MATRIX_SIZE)
    deadline = started + seconds
    while time.thread_time() < deadline:
        torch.mm(matrix, matrix)
    return time.thread_time() - started
