"""Spot checks of replicas' answers (issue #25), as pure decisions: which forward call to verify, how
far apart two honest answers may be, and who is in the minority.

A replica can lie plausibly: answer with the right shape and finite values (which the answer check,
`stage_call.check_answer`, lets through) that are not what its weights compute: outputs scaled by
1.05, plus noise, an old answer replayed, answers from stale weights. The trainer cannot recompute a
stage (it holds no weights), but replicas of one stage hold the same parameters between commits
(sync averaging), so the same request must get the same answer from each. A fraction
(`--verify-fraction`) of forward calls, drawn by a seeded RNG, is sent again, unchanged (the same
encoded inputs, the same answer codec), to a second replica; answers further apart than the
tolerance go to a third, and a replica whose answer agrees with neither of two agreeing others is
banned for the run. Two answers that disagree with no third replica to ask decide nothing: each
could be the liar.

The tolerance, relative to the larger answer's norm: `TIGHT` plus twice the answer codec's relative
error bound (wire.compression.RELATIVE_ERROR_BOUNDS: each answer may be that far from what its
replica computed): 1e-3 uncompressed, 3e-3 with fp16, 0.041 with int8, 0.241 with int4. `TIGHT` is
1e-3, not the 1e-4 that float nondeterminism alone would need, because sync replicas do not hold
bit-identical parameters: hivemind's all-reduce leaves last-bit differences that AdamW turns into
full-size steps on noise-level gradients, so replicas part a little more every step (validation
losses through two routes measured 1.3e-4 and 4.7e-3 apart, tests/integration/test_corpus.py), and
`--averaging-compression fp16/int8` leaves them 6e-5 / 1.6e-3 apart after one step
(peers/replicas/averaging.py). A report's `verify_largest_agreeing_difference` shows the margin left
in a run. A lie of 5% (`--faults garbage_size` 0.05) is caught with every codec but int4 (which lets
lies of up to ~24% through) and top-k.
top-k's bound is 1 (it drops the rest of the tensor), which makes every answer pass: under
`--codec topk` spot checks catch nothing plausible. Replicas that average periodically (not in
sync), or not at all, hold other parameters, and so do replicas outside a run's averaging group:
a check only asks replicas that average in sync in the first one's group (`comparable_replicas`,
from their records), and verifies nothing on stages without two of them. Replicas computing in
fp16/bf16 autocast (`--precision`, announced in their records) differ by more than 1e-3, so they
are not checked at all (the tolerance is for float32): spot checks need float32 peers. Nor are
replicas one step late with `--weight-prediction local-step` (also in their records): each computes
a step on the parameters plus the update its own gradients make, so honest replicas answer apart
(`unchecked_because`).

Under direct routing the trainer never holds a stage's inputs or outputs: a chain that answered
is checked afterwards, its stage's inputs and outputs as the stage's neighbours in the chain say they
crossed (peers/serving/hop_records.py, swarm/trainer/chain_call.py `ChainCaller.audit`), with the
same decisions as here; the lie has been applied to its microbatch by then.

What a check does not catch: a liar that lies only when it is not checked cannot know which calls
are checked (a checked call is an ordinary forward, with the same microbatch id), but it can lie on
backward calls, which are never checked, or collude with the replica asked to verify it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Set
from dataclasses import dataclass

import torch

from wire.compression import relative_error_bound

TIGHT = 1e-3  # relative difference two honest sync replicas may show with an exact codec (see above)


def tolerance(codec: str) -> float:
    """How far apart (relative to the larger norm) two honest answers sent with `codec` may be."""
    return TIGHT + 2.0 * relative_error_bound(codec)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| over the larger of ||a||, ||b|| (0 when both are zero; inf for different shapes)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()))
    difference = float((a - b).norm())
    return 0.0 if difference == 0.0 else difference / scale if scale > 0.0 else float("inf")


def computes_in_float32(precision: str) -> bool:
    """Whether a record's precision is what the tolerance is for ('': not stated, as older peers)."""
    return precision in ("", "fp32")


def unchecked_because(precision: str = "", weight_prediction: str = "") -> str | None:
    """Why a replica's answers cannot be held to another's within the tolerance, from its record
    (None: they can): half precision, or each step computed on parameters predicted from its own
    gradients (`--weight-prediction local-step`: honest replicas then answer a little apart)."""
    if not computes_in_float32(precision):
        return f"computes in {precision} (the tolerance is for float32 peers)"
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
    """Which forward calls to verify (or, with another `purpose`, which microbatches to pick for it):
    each with probability `fraction`, from an RNG seeded by the run's seed and the purpose, so the
    same run picks the same calls (in the order the pipeline asks), each purpose its own."""

    def __init__(self, fraction: float, *, seed: int = 0, purpose: str = "spot-checks"):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"the fraction of calls to pick for {purpose} must lie in [0, 1], got {fraction}")
        self.fraction = fraction
        self._rng = random.Random(f"{purpose}:{seed}")

    def pick(self) -> bool:
        return self.fraction > 0.0 and self._rng.random() < self.fraction


@dataclass(frozen=True)
class Verdict:
    """What answers to one request say about who answered.

    agreed: whether every answer agrees with every other.
    minority: replicas whose answer agrees with no other while the others agree among themselves.
    trusted: the replica whose answer the pipeline goes on with: the first (the call the pipeline
        made) unless it is in the minority; then one of the majority.
    """

    agreed: bool
    minority: tuple[str, ...]
    trusted: str
    largest_agreeing_difference: float = 0.0  # the largest difference of two answers within the tolerance

    @property
    def decided(self) -> bool:
        """Whether the answers settle who lied (all agree, or a minority is known)."""
        return self.agreed or bool(self.minority)


def judge(answers: Mapping[str, torch.Tensor], tolerance: float) -> Verdict:
    """The verdict on two or three answers to one request (replica -> its answer, the pipeline's
    own call first). A replica is in the minority when its answer is further than `tolerance` from
    every other, and the others all agree with each other: with two answers that disagree, or three
    that disagree pairwise (or agree in a chain: a with b, b with c, not a with c), nobody is."""
    if not 2 <= len(answers) <= 3:
        raise ValueError(f"a verdict needs two or three answers, got {len(answers)}")
    peers = list(answers)
    differences = {(p, q): relative_difference(answers[p], answers[q]) for p in peers for q in peers if p != q}
    close = {pair: difference <= tolerance for pair, difference in differences.items()}
    spread = max((d for pair, d in differences.items() if close[pair]), default=0.0)
    if all(close.values()):
        return Verdict(agreed=True, minority=(), trusted=peers[0], largest_agreeing_difference=spread)
    for outlier in peers:
        rest = [p for p in peers if p != outlier]
        if len(rest) < 2:
            break
        rest_agree = all(close[(p, q)] for p in rest for q in rest if p != q)
        if rest_agree and not any(close[(outlier, p)] for p in rest):
            trusted = peers[0] if peers[0] != outlier else rest[0]
            return Verdict(agreed=False, minority=(outlier,), trusted=trusted, largest_agreeing_difference=spread)
    return Verdict(agreed=False, minority=(), trusted=peers[0], largest_agreeing_difference=spread)
