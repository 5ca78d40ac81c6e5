"""Spot checks of replicas' answers (issues #25, #59), as pure decisions: which call to check, how far
apart two honest answers may be, who is in the minority, and when a third opinion is needed.

A fraction (`--verify-fraction`) of the training compute is checked: a stage's forward (outputs),
the last stage's fused call (loss, input gradient, gradient sample) and a backward (input gradient,
gradient sample: peers/compute/grad_sample.py), each recomputed by another replica of the stage in
float32 from the same request. Two answers agree when every component is within `tolerance`:
`TIGHT` + the error of each answer's precision (`PRECISION_ERRORS`, measured; the checked one's as
its replica announces it, a recompute's none) + twice the answer codec's error bound for tensors
that crossed in it. `judge` finds the majority among up to `MAX_OPINIONS` answers and bans the
rest; two answers that disagree with no third to ask are a `Dispute`, held for a `third_opinion`.
A further opinion comes from the replicas checks contradicted least (`least_contradicted`).
Only sync replicas of one averaging group that compute on their own parameters are compared
(`comparable_replicas`, `unchecked_because`), and only answers of the same step
(`recompute_is_stale`). The reasoning and the measurements:
docs/design/trainer.md, benchmarks/RESULTS.md ("Every answer checkable").
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

import torch

from wire.compression import relative_error_bound

TIGHT = 1e-3  # relative difference two honest float32 sync replicas may show with an exact codec
# What an answer computed in autocast to this precision may differ from a float32 recompute of it,
# relative: measured on the stages served (benchmarks/precision_bounds.py: bf16 at most 4.8e-3, fp16
# 6.5e-4 over tiny and small, their mean + 7 sd below these bounds).
PRECISION_ERRORS = {"fp32": 0.0, "bf16": 0.015, "fp16": 0.003}
CHECK_PRECISION = "fp32"  # what a checker recomputes in: the strictest, so that its own error adds nothing
CODED = ("outputs", "grad_inputs")  # components that cross the wire in the answer codec (the others: floats)


def precision_error(precision: str) -> float:
    """The error a precision's answers may show against float32 ('': not stated, as older peers: fp32;
    an unknown name is held to float32: announcing it buys nothing)."""
    return PRECISION_ERRORS.get(precision, 0.0)


def tolerance(codec: str, precisions: tuple[str, str] = ("fp32", "fp32"), *, coded: bool = True) -> float:
    """How far apart (relative to the larger norm) two honest answers may be: computed in
    `precisions`, sent with `codec` (`coded`: the component crossed the wire in it)."""
    codec_term = 2.0 * relative_error_bound(codec) if coded else 0.0
    return TIGHT + precision_error(precisions[0]) + precision_error(precisions[1]) + codec_term


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| over the larger of ||a||, ||b|| (0 when both are zero; inf for different shapes)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()))
    difference = float((a - b).norm())
    return 0.0 if difference == 0.0 else difference / scale if scale > 0.0 else float("inf")


@dataclass(frozen=True)
class Answer:
    """What a check compares of one replica's answer: its components by name ("outputs",
    "grad_inputs", "loss" as a 0-d tensor, "grad_sample") and the precision it was computed in."""

    components: Mapping[str, torch.Tensor]
    precision: str = "fp32"


def as_answer(value: Answer | torch.Tensor) -> Answer:
    return value if isinstance(value, Answer) else Answer({"outputs": value})


def difference(a: Answer, b: Answer, codec: str) -> tuple[float, float]:
    """The largest share of its tolerance a component of two answers uses (> 1: they disagree), and
    that component's relative difference. A component one answer has and the other lacks: inf."""
    share, raw = 0.0, 0.0
    for name in set(a.components) | set(b.components):
        if name not in a.components or name not in b.components:
            return float("inf"), float("inf")
        d = relative_difference(a.components[name], b.components[name])
        allowed = tolerance(codec, (a.precision, b.precision), coded=name in CODED)
        if d / allowed > share:
            share, raw = d / allowed, d
    return share, raw


def unchecked_because(precision: str = "", weight_prediction: str = "") -> str | None:
    """Why a replica's answers cannot be held to another's, from its record (None: they can): each
    step computed on parameters predicted from its own gradients (`--weight-prediction local-step`:
    honest replicas then answer apart). Its precision is no reason: the bound takes it in."""
    if weight_prediction == "local-step":
        return "computes each step on parameters predicted from its own gradients (--weight-prediction local-step)"
    return None


def comparable_replicas(
    first: str,
    averaging: Mapping[str, str],
    members: Set[str] | None = None,
    unchecked: Mapping[str, str | None] | None = None,
) -> set[str]:
    """The replicas whose answers must equal `first`'s: those that average with it in sync
    (`averaging`: replica -> its record's averaging mode), in its group (`members`: a run's
    credentialed replicas, who average only among themselves; None: no run authority), none of
    them unchecked (`unchecked`: replica -> `unchecked_because` its record; None: all checkable)."""

    def checkable(peer: str) -> bool:
        return unchecked is None or unchecked.get(peer) is None

    if averaging.get(first) != "sync" or (members is not None and first not in members) or not checkable(first):
        return set()
    return {
        p for p, mode in averaging.items() if mode == "sync" and (members is None or p in members) and checkable(p)
    } - {first}


class CallSampler:
    """Which calls to check (or, with another `purpose`, which microbatches to pick for it): each
    with probability `fraction` (times the call's `weight`), from an RNG seeded by the run's seed and
    the purpose, so the same run picks the same calls (in the order the pipeline asks), each purpose
    its own."""

    def __init__(self, fraction: float, *, seed: int = 0, purpose: str = "spot-checks"):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"the fraction of calls to pick for {purpose} must lie in [0, 1], got {fraction}")
        self.fraction = fraction
        self._rng = random.Random(f"{purpose}:{seed}")

    def pick(self, weight: float = 1.0) -> bool:
        return self.fraction > 0.0 and self._rng.random() < self.fraction * weight


# A check's recompute of a backward served from the replica's activation cache redoes its forward:
# about 3 units of compute (forward 1, backward 2) for a call of 2. Picked with this weight, the
# checks recompute the fraction --verify-fraction of the training compute, whatever the call.
CACHED_BACKWARD_WEIGHT = 2.0 / 3.0


def check_weight(stage: int, call: str, num_stages: int) -> float:
    """The weight `CallSampler.pick` gives a call: a backward before the last stage (served from the
    activation cache) `CACHED_BACKWARD_WEIGHT`, any other call 1 (its recompute costs what it did)."""
    return CACHED_BACKWARD_WEIGHT if call == "backward" and stage < num_stages - 1 else 1.0


def calls_to_check(num_stages: int) -> list[tuple[int, str]]:
    """Every training call of one microbatch that a check may pick, in the pipeline's order:
    (stage, "forward") for each stage but the last, then (stage, "backward") from the last (its
    fused forward+backward) down to stage 0."""
    return [(s, "forward") for s in range(num_stages - 1)] + [(s, "backward") for s in reversed(range(num_stages))]


@dataclass(frozen=True)
class Verdict:
    """What answers to one request say about who answered.

    agreed: whether every answer agrees with every other.
    minority: replicas whose answers agree with none of the majority's (`judge`).
    trusted: the replica whose answer the pipeline goes on with: the first (the call the pipeline
        made) unless it is in the minority; then one of the majority.
    largest_agreeing_share: the largest share of the tolerance two agreeing answers used (<= 1),
    largest_agreeing_difference: ... and that component's relative difference.
    """

    agreed: bool
    minority: tuple[str, ...]
    trusted: str
    largest_agreeing_difference: float = 0.0
    largest_agreeing_share: float = 0.0

    @property
    def decided(self) -> bool:
        """Whether the answers settle who lied (all agree, or a minority is known)."""
        return self.agreed or bool(self.minority)


MAX_OPINIONS = 5  # answers one check may gather (the call's own and recomputes) before it gives up deciding


def judge(answers: Mapping[str, Answer | torch.Tensor], tolerance_or_codec: float | str) -> Verdict:
    """The verdict on two to MAX_OPINIONS answers to one request (replica -> its answer, the
    pipeline's own call first). `tolerance_or_codec`: the answer codec (tolerances per component and
    precision, `difference`), or one tolerance for bare tensors. The majority is a group of at least
    two answers that all agree with each other, larger than any group the other answers form, and
    agreeing with none of them: those others are the minority. Two answers that disagree, three
    that disagree pairwise or agree in a chain (a with b, b with c, not a with c), or two groups of
    two: nobody is."""
    if not 2 <= len(answers) <= MAX_OPINIONS:
        raise ValueError(f"a verdict needs two to {MAX_OPINIONS} answers, got {len(answers)}")
    peers = list(answers)
    shares: dict[tuple[str, str], tuple[float, float]] = {}
    for p in peers:
        for q in peers:
            if p == q:
                continue
            if isinstance(tolerance_or_codec, str):
                shares[(p, q)] = difference(as_answer(answers[p]), as_answer(answers[q]), tolerance_or_codec)
            else:
                d = relative_difference(
                    as_answer(answers[p]).components["outputs"], as_answer(answers[q]).components["outputs"]
                )
                shares[(p, q)] = (d / tolerance_or_codec if tolerance_or_codec > 0 else float("inf") * d, d)
    close = {pair: share <= 1.0 for pair, (share, _) in shares.items()}
    agreeing = [shares[pair] for pair in shares if close[pair]]
    share, spread = max(agreeing, default=(0.0, 0.0))

    def verdict(agreed: bool, minority: tuple[str, ...], trusted: str) -> Verdict:
        return Verdict(agreed, minority, trusted, largest_agreeing_difference=spread, largest_agreeing_share=share)

    def agree(group) -> bool:
        return all(close[(p, q)] for p in group for q in group if p != q)

    if all(close.values()):
        return verdict(True, (), peers[0])
    for size in range(len(peers) - 1, 1, -1):
        for group in itertools.combinations(peers, size):
            rest = [p for p in peers if p not in group]
            if not agree(group) or any(close[(p, q)] for p in rest for q in group):
                continue
            if any(agree(other) for n in range(size, len(rest) + 1) for other in itertools.combinations(rest, n)):
                continue  # another group as large: no majority
            return verdict(False, tuple(rest), peers[0] if peers[0] in group else group[0])
    return verdict(False, (), peers[0])


def least_contradicted(candidates: Iterable[str], records: Mapping[str, tuple[int, int]]) -> set[str]:
    """Whom a check asks for a further opinion once two answers disagree: the candidates whose answers
    checks have contradicted least so far (`records`: replica -> (mismatches, checks); a replica
    never checked has a rate of 0). A liar's every check is a mismatch, an honest replica's only the
    undecided ones it was in, so an opinion that can settle the check comes sooner; ties are left
    to the scheduler."""
    rates = {p: records.get(p, (0, 0))[0] / max(records.get(p, (0, 0))[1], 1) for p in candidates}
    lowest = min(rates.values(), default=0.0)
    return {p for p, rate in rates.items() if rate <= lowest}


@dataclass(frozen=True)
class Dispute:
    """Two replicas' answers to one checked call that disagree, with no third to ask yet: held until
    a third opinion can be had before the replicas step again, then reported if none could."""

    stage: int
    call: str  # "forward" or "backward" (the last stage's: its fused call)
    microbatch_id: str
    peers: tuple[str, str]  # the checked replica, its checker
    share: float  # the share of the tolerance their answers' difference used (> 1)
    step: int  # the trainer's step it was answered in: a third opinion must come from the same


def recompute_is_stale(
    checked_steps: int | None, recompute_steps: int | None, *, steps_may_move: bool, floor: int = 0
) -> bool:
    """Whether a recompute cannot be compared with the answer it checks because the replicas stepped
    between the two: the checked replica computed at `checked_steps` (the optimizer steps its
    parameters had taken, as it says), the recompute at more. Only where another trainer's commit
    may land between a call and its check (several trainers share the run's steps: `steps_may_move`);
    a single trainer commits after its checks, so there a difference of steps excuses nothing. Nor
    does a claim below `floor`, the steps that replica answered this trainer's last commit with, nor
    an answer that states no steps."""
    if not steps_may_move or checked_steps is None or recompute_steps is None:
        return False
    return floor <= checked_steps < recompute_steps


def third_opinion(dispute: Dispute, comparable: Iterable[str], excluded: Set[str], step: int) -> str | None:
    """Whom to ask for a third opinion on `dispute`: a replica comparable with the checked one
    (`comparable_replicas`) outside the dispute and `excluded` (banned, refusing us), while the
    stage is still at the dispute's step (after a step the parameters moved on: nobody can)."""
    if step != dispute.step:
        return None
    candidates = sorted(set(comparable) - set(dispute.peers) - set(excluded))
    return candidates[0] if candidates else None
